"""Stage 3, serving: a profile deployed on an engine, its boot watched, its GPU memory and Shared Usage sampled,
its checks run and its report written; sweeps and fleets."""

"""This machine: `doctor` (what it has for building and serving, each line with its fix) and `monitor` (its GPU memory
and, on WSL2, Shared Usage, sampled for as long as asked)."""

"""The files servekit writes and later trusts, as typed models (run, sweep, fleet, release), and the run report's
rendering (report.md, memory.png, compare)."""

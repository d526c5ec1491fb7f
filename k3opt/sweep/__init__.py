"""Capacity sweeps: a grid of jobs planned on a local process pool or a Ray cluster, one resumable output file
(`k3opt sweep`). inputs.sweep reads the grid, `rows` turns a plan into rows, `store` keeps the output file,
`run` executes the points."""

from k3opt.sweep.rows import SweepSettings, point_key, point_rows
from k3opt.sweep.run import SweepResult, run_sweep

__all__ = ["SweepResult", "SweepSettings", "point_key", "point_rows", "run_sweep"]

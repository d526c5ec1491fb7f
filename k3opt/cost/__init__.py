"""The cost model: the model's tensors (structure), how they are sharded and placed, the collectives and the
pipeline schedule, the per-layer coefficients, and evaluate(): a layout's per-rank memory ledger and step time.
Reads k3opt.inputs only."""

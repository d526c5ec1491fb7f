"""What a plan reads: the input specs (model, cluster, runtime, layout, job), their loaders and presets, the
measured kernel and collective rates, and the typed errors for bad input. Imports nothing else of k3opt."""

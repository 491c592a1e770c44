"""Data parallelism and ZeRO: gradient buckets overlapped with the backward, ZeRO-1 and ZeRO-3, global-norm
clipping, uneven shares rebalanced, the gradient communication checked against the plan."""

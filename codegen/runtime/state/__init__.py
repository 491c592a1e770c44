"""What one rank holds: its stages' tensors bound, sharded and glued, initialised from (seed, FQN) streams, a full
state dict's keys checked, the random streams' seed."""

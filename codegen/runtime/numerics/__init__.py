"""A step's numbers watched: a non-finite loss or gradient norm met with the user's policy (stop, skip, roll
back), and loss spikes reported."""

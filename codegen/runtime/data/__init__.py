"""What a step reads: each data-parallel rank's rows of every global batch, and the checks of a batch before any
rank computes."""

"""Memory a step holds: activation offload, half-precision weight copies remade in the backward, the probe that
measures saved activations, storage identity on real and fake tensors."""

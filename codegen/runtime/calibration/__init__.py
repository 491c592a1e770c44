"""Measuring the machine and the run: the microbenchmarks of xirang calibrate, the World fitted from them, and a
run's measured step costs for re-pricing."""

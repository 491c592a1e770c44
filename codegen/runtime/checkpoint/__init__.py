"""Distributed checkpoints under the single-device model's names: save and load, the layout of each rank's pieces,
step folders on disk."""

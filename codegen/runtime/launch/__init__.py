"""Starting ranks and wiring them: the local launcher and torchrun commands, each rank's device, the mesh's process
groups."""

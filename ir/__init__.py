"""Data only: meta keys, placements, mesh, device and cluster specs, plans."""

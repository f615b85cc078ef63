"""Launching: the torchrun-based launcher and job generators for SLURM and Kubernetes."""

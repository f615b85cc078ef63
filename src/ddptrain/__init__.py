"""ddptrain: multi-node DistributedDataParallel training for PyTorch."""

__version__ = "0.1.0"

"""Data: corpus preparation, memory-mapped token datasets, the resumable sampler, and the sources
(data/source.py: one object per kind of data, which the run and the commands ask)."""

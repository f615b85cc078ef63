"""Checkpoint formats: how a checkpoint's state becomes files and back, one module per format."""

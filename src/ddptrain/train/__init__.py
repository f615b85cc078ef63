"""Training core: the Trainer and its step, precision, RNG state, coordinated stops."""

"""ddptrain benchmarks: `python -m bench all` (see docs/benchmarks.md). Not part of the test suite."""

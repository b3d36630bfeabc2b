"""Benchmarks of iresflow, each a user of its public API: ``python -m benchmarks --help``."""

"""Measurements and probes of a checkout, run from the repository root: ``python -m benchmarks.NAME``."""

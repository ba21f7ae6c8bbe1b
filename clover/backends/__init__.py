"""Engine backends. Each implements the two callables of :mod:`clover.engine`."""

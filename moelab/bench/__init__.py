"""Benchmarks of moelab components (``moelab.bench.maps``: speed of the probability maps)."""

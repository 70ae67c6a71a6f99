"""Benchmarks of moelab components (``moelab.bench.maps``: speed of the probability maps).

What the command line needs to describe them lives here, without torch (``moelab bench
--help`` does not load it): :data:`MOE_SHAPES`."""

MOE_SHAPES: tuple[tuple[int, int, int, int, int], ...] = (
    (8192, 256, 512, 8, 2),
    (8192, 320, 512, 26, 2),
    (4096, 256, 256, 64, 8),
)
"""(T, d, f, E, K): the shapes ``moelab bench moe`` times by default
(``moelab.bench.moe.SHAPES``)."""

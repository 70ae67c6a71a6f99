"""Benchmarks of moelab components (``moelab.bench.maps``: speed of the probability maps).

What the command line needs to describe them lives here, without torch (``moelab bench
--help`` does not load it): :data:`MOE_SHAPES`, :data:`TORCHTITAN_SHAPES`."""

MOE_SHAPES: tuple[tuple[int, int, int, int, int], ...] = (
    (8192, 256, 512, 8, 2),
    (8192, 320, 512, 26, 2),
    (4096, 256, 256, 64, 8),
)
"""(T, d, f, E, K): the shapes ``moelab bench moe`` times by default
(``moelab.bench.moe.SHAPES``)."""
TORCHTITAN_SHAPES: tuple[tuple[int, int, int, int, int], ...] = (
    (4096, 256, 256, 8, 3),
    (4096, 256, 768, 64, 8),
)
"""(T, d, f, E, K): the shapes ``moelab bench torchtitan`` times by default: the MoE layers
of torchtitan's DeepSeek-V3 ``debugmodel`` (d 256, f 256, E 8, top-3) and Qwen3
``debugmodel_moe`` (d 256, f 768, E 64, top-8), on 4096 tokens
(``moelab.bench.torchtitan.SHAPES``)."""

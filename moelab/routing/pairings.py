"""The checks that span two stages: settings of one stage that another stage's variant
cannot work with. Each stage checks only its own config (``__post_init__`` of
:class:`~moelab.routing.mapping.MapConfig`, ...); the pairings are checked here, where
``RouterConfig`` (the front that builds every stage's config) and the Router's wiring
call them, so that no stage reads another stage's settings. The messages name the
``RouterConfig`` keys to change.
"""

from __future__ import annotations

from moelab import maps
from moelab.routing.mapping import MapConfig

__all__ = ["relative_cut_needs_a_budget"]


def relative_cut_needs_a_budget(truncation_relative: bool, map_config: MapConfig) -> None:
    """Selection x map: a cut read in units of k / E (``truncation_relative``) needs a
    map with a budget k."""
    if truncation_relative and not maps.info(map_config.name).needs_k:
        with_k = " or ".join(f"map={n!r}" for n, i in maps.registry().items() if i.needs_k)
        raise ValueError(
            "truncation_relative (threshold_relative) reads the cut in units of k / E, "
            f"the mean value of a map with a budget k; it needs {with_k}, not "
            f"{map_config.name!r}"
        )

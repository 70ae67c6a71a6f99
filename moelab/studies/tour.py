"""The tour of the probability maps (``moelab demo --maps``).

Shows, on a few hand-picked score vectors, the weights every registered map gives
(:func:`moelab.maps.registry`), which experts keep a non-zero weight, and the singleton
threshold law; then checks the law on many random score rows. The trained comparison of
the maps is the ``sparse-maps`` study (:mod:`moelab.studies.sparse_maps`, ``moelab demo``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from moelab import maps

# Settings the tour shows beyond a map's defaults, by map name; every registered
# map appears, with its defaults (and k = TOUR_K where it needs k) unless named here.
VARIANTS: dict[str, tuple[dict[str, float], ...]] = {
    "entmax": ({"alpha": 1.5}, {"alpha": 1.25}),
    "normmax": ({"alpha": 2.0}, {"alpha": 4.0}),
}
TOUR_K = 2.0
_SHORT = {"alpha": "a"}  # parameter names as the labels write them


def tour() -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor], float | None]]:
    """The maps the tour shows, from the registry: ``(label, f, threshold)`` with
    ``f(z)`` the map with the label's parameters and ``threshold`` its singleton
    threshold (None without one)."""
    out = []
    for name, info in maps.registry().items():
        for given in VARIANTS.get(name, ({},)):
            params = {"k": TOUR_K, **given} if info.needs_k else dict(given)
            label = " ".join([name, *(f"{_SHORT.get(p, p)}={v:g}" for p, v in params.items())])
            out.append((label, info.bind(**params), info.threshold(**params)))
    return out


VECTORS = [
    ("top-2 gap 0.8, expert 6 masked", [2.0, 1.2, 0.4, -0.5, -1.0, -math.inf]),
    ("top-2 gap 1.5", [2.5, 1.0, 0.7, 0.0, -0.5, -1.0]),
    ("top-2 gap 2.5", [3.0, 0.5, 0.4, 0.0, -0.2, -1.0]),
]


def run(rows: int = 100_000, experts: int = 8, spread: float = 1.5, seed: int = 0) -> dict:
    """Compute everything the tour shows, as plain data."""
    vectors = []
    for label, values in VECTORS:
        z = torch.tensor([values], dtype=torch.float64)
        top2 = z.topk(2).values[0]
        entries = []
        for name, fn, thr in tour():
            p = fn(z)[0]
            entries.append(
                {
                    "map": name,
                    "weights": [round(float(v), 4) for v in p],
                    "support": int((p > 0).sum()),
                    "sum": round(float(p.sum()), 6),
                    "threshold": thr,
                }
            )
        vectors.append(
            {"label": label, "scores": values, "gap": float(top2[0] - top2[1]), "maps": entries}
        )

    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, experts, generator=g) * spread
    top2 = z.topk(2, dim=-1)
    gap = top2.values[:, 0] - top2.values[:, 1]
    law = []
    for name, fn, thr in tour():
        if thr is None:
            continue
        p = fn(z)
        zero = p.gather(-1, top2.indices[:, 1:2])[:, 0] == 0
        above = gap >= thr
        law.append(
            {
                "map": name,
                "threshold": thr,
                "frac_gap_ge_threshold": float(above.double().mean()),
                "singleton_rate": float(zero.double().mean()),
                "disagreements": int((zero != above).sum()),
                "mean_support": float((p > 0).sum(-1).double().mean()),
            }
        )
    return {
        "backend": maps.backend(),
        "vectors": vectors,
        "law": {"rows": rows, "experts": experts, "spread": spread, "maps": law},
    }


def format_report(result: dict) -> str:
    """The tour as text."""
    out = [
        "moelab demo: the probability maps of MoE routers",
        f"(maps backend: {result['backend']})",
        "",
    ]
    for vec in result["vectors"]:
        scores = " ".join(f"{v:5.1f}" if math.isfinite(v) else " -inf" for v in vec["scores"])
        out.append(f"scores [{scores}]   {vec['label']}")
        out.append(f"  {'map':<14} {'weights':<43} {'support':>7} {'sum':>6}")
        for m in vec["maps"]:
            w = " ".join(f"{x:6.3f}" for x in m["weights"])
            thr = m["threshold"]
            note = ""
            if thr is not None:
                note = f"  singleton: gap >= {thr:g}" if vec["gap"] >= thr else ""
            out.append(f"  {m['map']:<14} {w:<43} {m['support']:>7} {m['sum']:>6.3f}{note}")
        out.append("")
    law = result["law"]
    out.append(
        f"The threshold law on {law['rows']:,} random score rows "
        f"({law['experts']} experts, scores ~ N(0, {law['spread']}^2)):"
    )
    out.append("the runner-up expert gets exactly 0 iff the top-2 gap >= the map's threshold.")
    out.append(
        f"  {'map':<14} {'threshold':>9} {'P(gap>=thr)':>12} {'P(runner-up=0)':>15}"
        f" {'rows disagreeing':>17} {'mean support':>13}"
    )
    for m in law["maps"]:
        out.append(
            f"  {m['map']:<14} {m['threshold']:>9.3g} {m['frac_gap_ge_threshold']:>12.4f}"
            f" {m['singleton_rate']:>15.4f} {m['disagreements']:>17d} {m['mean_support']:>13.2f}"
        )
    return "\n".join(out)

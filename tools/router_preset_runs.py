"""Train the `tiny` model once per router preset (and the default router, the baseline)
and check each run's routing: no dead expert in any MoE layer, and a load CV within
``--cv-factor`` times the baseline's (issue 45: "a tiny run per preset trains 200 steps
with no dead experts and a load CV in the range of the existing mechanisms").

Too slow for the unit suite (about a minute per run on two CPU cores); run by hand:

    python tools/router_preset_runs.py --out runs/presets [--steps 200] [--seeds 0]
        [--presets deepseek-v3,gpt-oss,kimi-k2,deepseek-v4] [--data CORPUS] [--threads N]
        [--set bias_rate=0.01 ...]

The model: `tiny` with every block an MoE layer (``model.moe_layers=all``: 4 MoE layers,
which deepseek-v4's 3 hash layers need). Presets whose map moelab does not register
(deepseek-v4 before "sqrtsoftplus") are listed as skipped. Prints one line per run and
MoE layer (selection, load CV, MaxVio = max load / mean load - 1, dead experts) and the
validation loss, writes ``OUT/summary.json``, and exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from moelab import maps
from moelab.diagnostics import stats
from moelab.model.router_presets import available_router_presets, router_preset
from moelab.train import TrainConfig, train


def _runs(presets: list[str]) -> dict[str, str | None]:
    return {"default": None, **{name: name for name in presets}}


def _one(name: str, preset: str | None, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    model: dict[str, Any] = {"moe_layers": "all"}
    if preset is not None:
        model["router_preset"] = preset
        if args.router_set:  # over the preset's keys (the baseline keeps its own)
            model["router"] = dict(args.router_set)
    out = Path(args.out) / f"{name}-seed{seed}"
    config = TrainConfig(
        preset="tiny",
        model=model,
        steps=args.steps,
        seed=seed,
        data_seed=0,
        out=str(out),
        data=args.data,
        eval_every=0,
        checkpoint_every=0,
        progress=False,
        threads=args.threads,
    )
    summary = train(config)
    st = stats(out)
    layers = [
        {
            "layer": lay["layer"],
            "selection": lay["selection"],
            "load_cv": lay["load_cv"],
            "maxvio": None if lay["load_max_mean"] is None else lay["load_max_mean"] - 1.0,
            "dead_experts": lay["dead_experts"],
        }
        for lay in st["layers"]
    ]
    return {"run": str(out), "val_loss": summary.get("val_loss"), "layers": layers}


def _router_key(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder of the runs")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds")
    parser.add_argument("--presets", default=",".join(available_router_presets()))
    parser.add_argument("--data", default=None, help="corpus (default: moelab's)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cv-factor", type=float, default=2.0)
    parser.add_argument(
        "--set",
        dest="router_set",
        action="append",
        default=[],
        type=_router_key,
        metavar="KEY=VALUE",
        help="a router key for the presets' runs, over the preset's (e.g. bias_rate=0.01); "
        "the value as JSON, else a string",
    )
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    presets, skipped = [], []
    for name in (p.strip() for p in args.presets.split(",") if p.strip()):
        needed = router_preset(name).router.get("map", "softmax")
        (presets if needed in maps.available() else skipped).append(name)
    for name in skipped:
        print(f"{name}: skipped (map not registered in moelab.maps)")
    results: dict[str, list[dict[str, Any]]] = {}
    for name, preset in _runs(presets).items():
        results[name] = [_one(name, preset, seed, args) for seed in seeds]
    base_cv = max(
        lay["load_cv"] for r in results["default"] for lay in r["layers"] if lay["load_cv"]
    )
    failed = []
    for name, runs in results.items():
        for r in runs:
            print(f"{name} {r['run']}: val_loss {r['val_loss']}")
            for lay in r["layers"]:
                print(
                    f"  layer {lay['layer']} {lay['selection']:>6}: load_cv {lay['load_cv']:.3f} "
                    f"maxvio {lay['maxvio']:.3f} dead {lay['dead_experts']}"
                )
                if lay["dead_experts"]:
                    failed.append(f"{name}: layer {lay['layer']} has dead experts")
                if lay["load_cv"] is not None and lay["load_cv"] > args.cv_factor * base_cv:
                    failed.append(
                        f"{name}: layer {lay['layer']} load CV {lay['load_cv']:.3f} > "
                        f"{args.cv_factor} x the default router's {base_cv:.3f}"
                    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    summary = {"results": results, "skipped": skipped, "failed": failed}
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=2))
    for line in failed:
        print("FAILED", line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

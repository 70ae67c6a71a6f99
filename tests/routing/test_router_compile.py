"""The router's forward compiles to one graph (``fullgraph=True``: no host sync, no graph
break) for every map and every selection rule, and for the mechanisms beside them, and
the compiled router equals eager mode, forward and backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moelab import maps
from moelab.routing import Router, RouterConfig
from moelab.routing import selection as rules

D, E, T = 8, 6, 12
MAP_ARGS: dict[str, dict[str, Any]] = {
    "entmax": {"alpha": 1.5},
    "normmax": {"alpha": 2.0},
    "lapsum": {"lapsum_k": 2.0},
}
RULE_ARGS: dict[str, dict[str, Any]] = {
    "threshold": {"truncation": 0.05},
    "hash": {"vocab_size": 50},
}
EXTRAS: dict[str, dict[str, Any]] = {
    "capacity+noise+bias": {"capacity_factor": 1.0, "noise_std": 0.1, "bias_rate": 0.01},
    "null experts": {"n_null_experts": 2, "null_expert": "identity", "aux_weight": 0.01},
    "groups": {
        "map": "sigmoid",
        "n_groups": 3,
        "topk_groups": 2,
        "renorm": True,
        "routed_scaling": 2.5,
        "aux_weight": 0.01,
        "aux_scope": "sequence",
        "aux_probs": "normalized",
    },
    "losses": {"aux_weight": 0.01, "z_loss_weight": 1e-3, "entropy_loss_weight": 0.1},
    "global scope": {"aux_weight": 0.01, "aux_scope": "global"},
    "relu l1": {"map": "relu", "selection": "threshold", "l1_target": 2.0},
    "lipschitz + straight-through": {"schedule": "lipschitz", "straight_through": True},
    "sampling": {"sample_extra": 1},
    "input jitter": {"jitter": 0.1, "noise_std": 0.1},
}
CASES = (
    [(f"map={m}", {"map": m, **MAP_ARGS.get(m, {})}) for m in maps.available()]
    + [(f"selection={s}", {"selection": s, **RULE_ARGS.get(s, {})}) for s in rules.available()]
    + list(EXTRAS.items())
)


@pytest.mark.parametrize(("name", "keys"), CASES, ids=[c[0] for c in CASES])
def test_router_compiles_to_one_graph_and_equals_eager(name: str, keys: dict[str, Any]) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    router = Router(RouterConfig(d_model=D, n_experts=E, top_k=2, **keys)).train()
    x_TD = torch.randn(T, D)
    ids_T = torch.randint(50, (T,))

    def run(fn):
        xr = x_TD.clone().requires_grad_(True)
        # NOTE: exploration draws from the global RNG, as in training (a torch.Generator
        # argument cannot be traced)
        torch.manual_seed(1)
        out = fn(xr, token_ids_T=ids_T, seq_len=4)
        slots = torch.arange(1.0, out.weights_TK.shape[-1] + 1)  # distinct slot weights
        loss = (out.weights_TK * slots).sum() + out.aux_loss
        (dx, dw) = torch.autograd.grad(loss, (xr, router.weight))
        return out, dx, dw

    compiled = torch.compile(router, fullgraph=True, backend="aot_eager")
    out_c, dx_c, dw_c = run(compiled)
    out_e, dx_e, dw_e = run(router)
    assert torch.equal(out_c.ids_TK, out_e.ids_TK)
    assert torch.equal(out_c.selected_TK, out_e.selected_TK)
    assert torch.equal(out_c.dropped_TK, out_e.dropped_TK)
    torch.testing.assert_close(out_c.weights_TK, out_e.weights_TK)
    torch.testing.assert_close(out_c.aux_loss, out_e.aux_loss)
    torch.testing.assert_close(dx_c, dx_e)
    torch.testing.assert_close(dw_c, dw_e)


def test_only_a_map_with_cpu_kernels_loads_them_at_construction() -> None:
    """A softmax router never builds or imports the fused kernels; a sparsemax one loads
    them at construction, so that a compiled forward finds them (fresh processes)."""
    import subprocess
    import sys

    code = (
        "from moelab.maps import _kernels; from moelab.routing import Router, RouterConfig; "
        "Router(RouterConfig(d_model=4, n_experts=4, map={!r})); "
        "print(_kernels._state['loaded'] is not None)"
    )
    seen = {
        m: subprocess.run(
            [sys.executable, "-c", code.format(m)], capture_output=True, text=True, timeout=300
        ).stdout.strip()
        for m in ("softmax", "sparsemax")
    }
    assert seen == {"softmax": "False", "sparsemax": "True"}

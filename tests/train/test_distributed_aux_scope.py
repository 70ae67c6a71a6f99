"""The global scope of the Switch loss (aux_scope="global", Qiu et al. 2025) under two gloo
ranks: f is counted over the global batch, and the rank-averaged gradient (what DDP
applies) equals one process's gradient on the concatenated batch."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moelab.routing import Router, RouterConfig, balancing

from . import free_port, rank_env, spawn_ranks

WORLD, T, E, D = 2, 9, 6, 5
TIMEOUT_S = 120


def _data() -> tuple[torch.Tensor, torch.Tensor, RouterConfig]:
    """The global batch (WORLD * T tokens), a rank's share being rows r*T .. (r+1)*T - 1,
    and the router config (deliberately uneven routing: rank 1's tokens differ)."""
    gen = torch.Generator().manual_seed(0)
    x_ND = torch.randn(WORLD * T, D, generator=gen)
    x_ND[T:] += 2.0  # rank 1's share routes differently from rank 0's
    weight_ED = torch.randn(E, D, generator=gen)
    config = RouterConfig(d_model=D, n_experts=E, top_k=2, aux_weight=1.0, aux_scope="global")
    return x_ND, weight_ED, config


def _worker(rank: int, port: int, out: str) -> None:
    rank_env(rank, WORLD, port)
    dist.init_process_group("gloo")
    try:
        x_ND, weight_ED, config = _data()
        router = Router(config)
        with torch.no_grad():
            router.weight.copy_(weight_ED)
        routed = router(x_ND[rank * T : (rank + 1) * T])
        routed.aux_loss.backward()
        torch.save(
            {
                "loss": routed.losses["switch"].detach(),
                "grad": router.weight.grad,
                "local_counts": balancing.expert_counts(routed.ids_TK, routed.selected_TK, E),
            },
            Path(out) / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_global_scope_counts_f_over_the_ranks(tmp_path: Path) -> None:
    spawn_ranks(_worker, (free_port(), str(tmp_path)), WORLD, TIMEOUT_S)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    # one process on the concatenated batch: its micro-batch is the global batch
    x_ND, weight_ED, config = _data()
    one = Router(dataclasses.replace(config, aux_scope="micro_batch"))
    with torch.no_grad():
        one.weight.copy_(weight_ED)
    whole = one(x_ND)
    whole.aux_loss.backward()
    counts_E = balancing.expert_counts(whole.ids_TK, whole.selected_TK, E)
    assert torch.equal(sum(r["local_counts"] for r in ranks), counts_E)
    assert not torch.equal(ranks[0]["local_counts"], ranks[1]["local_counts"])

    # each rank's loss uses the global f and its own P: E * sum_e f_e P_e(rank)
    f_E = counts_E / counts_E.sum()
    for rank, r in enumerate(ranks):
        P_E = whole.probs_TE[rank * T : (rank + 1) * T].detach().mean(0)
        torch.testing.assert_close(r["loss"], E * (f_E * P_E).sum())
        local_f = r["local_counts"] / r["local_counts"].sum()
        assert abs(float(r["loss"]) - float(E * (local_f * P_E).sum())) > 1e-4  # not local f
    # the losses average to the global batch's loss, the rank-averaged gradient (DDP)
    # to its gradient
    torch.testing.assert_close(sum(r["loss"] for r in ranks) / WORLD, whole.losses["switch"])
    torch.testing.assert_close(sum(r["grad"] for r in ranks) / WORLD, one.weight.grad)

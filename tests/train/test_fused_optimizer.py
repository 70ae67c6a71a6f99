"""The training loop's AdamW takes the fused kernel where it can, and that kernel steps
the parameters as the per-parameter reference loop does (float64)."""

from __future__ import annotations

import torch

from moelab.model import Transformer, load_preset
from moelab.train.config import TrainConfig
from moelab.train.loop import _fused_adamw, build_optimizer


def test_fused_adamw_matches_the_reference_loop_in_float64() -> None:
    torch.manual_seed(0)
    config = TrainConfig(lr=1e-2, weight_decay=0.1)
    models = [Transformer(load_preset("tiny")).double() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    before = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    fused = build_optimizer(models[0], config)
    assert all(g["fused"] for g in fused.param_groups)
    # the reference: the same groups, stepped one parameter at a time
    reference = torch.optim.AdamW(
        [{**g, "params": [dict(models[1].named_parameters())[n] for n in names]}
         for g, names in zip(fused.param_groups, _group_names(models[0], fused), strict=True)],
        lr=config.lr, betas=config.betas, foreach=False,
    )  # fmt: skip
    for g in reference.param_groups:
        g["fused"] = None
    for _ in range(5):
        grads = {n: torch.randn_like(p) for n, p in models[0].named_parameters()}
        for model in models:
            for n, p in model.named_parameters():
                p.grad = grads[n].clone()
        fused.step()
        reference.step()
    a = {n: p.detach() for n, p in models[0].named_parameters()}
    b = {n: p.detach() for n, p in models[1].named_parameters()}
    assert all(float((a[n] - before[n]).abs().min()) > 0 for n in a)  # every one moved
    assert max(float((a[n] - b[n]).abs().max()) for n in a) <= 1e-12


def _group_names(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[list[str]]:
    name = {id(p): n for n, p in model.named_parameters()}
    return [[name[id(p)] for p in g["params"]] for g in opt.param_groups]


def test_parameters_the_kernel_cannot_take_keep_the_default() -> None:
    class Sharded(torch.Tensor):  # stands in for FSDP's DTensor parameters
        pass

    plain = [torch.nn.Parameter(torch.zeros(2))]
    assert _fused_adamw(plain)
    assert not _fused_adamw([torch.zeros(2).as_subclass(Sharded)])
    assert not _fused_adamw([torch.nn.Parameter(torch.zeros(2, device="meta"))])

"""``compile``: training with ``torch.compile``d blocks equals eager training.

Inductor's code generation on two CPU cores takes minutes for the model (each block
compiled for training and for evaluation), so the training loop is checked through
dynamo and AOTAutograd (``backend="aot_eager"``: the graphs the loop captures, their
backward), and inductor's numbers on one dense block, forward and backward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from moelab.model import ModelConfig
from moelab.model.transformer import Block, rope_tables
from moelab.train import latest_checkpoint, train

from . import logged_losses, make_corpus, tiny_config


def test_compiled_blocks_train_like_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[str] = []
    compile_module = nn.Module.compile

    def compile_cheaply(self: nn.Module, *args: object, **kwargs: object) -> None:
        compiled.append(type(self).__name__)
        compile_module(self, backend="aot_eager")

    monkeypatch.setattr(nn.Module, "compile", compile_cheaply)
    torch._dynamo.reset()
    corpus = make_corpus(tmp_path / "corpus")
    eager = train(tiny_config(corpus, tmp_path / "eager", steps=3))
    fast = train(tiny_config(corpus, tmp_path / "compiled", steps=3, compile=True))
    assert compiled == ["Block", "Block"]  # each block, not the model
    assert logged_losses(tmp_path / "compiled") == pytest.approx(
        logged_losses(tmp_path / "eager"), abs=1e-5
    )
    assert fast["val_loss"] == pytest.approx(eager["val_loss"], abs=1e-5)
    a = load_file(latest_checkpoint(tmp_path / "eager") / "model.safetensors")  # type: ignore[operator]
    b = load_file(latest_checkpoint(tmp_path / "compiled") / "model.safetensors")  # type: ignore[operator]
    assert a.keys() == b.keys()  # compiled in place: the same parameter names
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=1e-4)


def test_inductor_block_forward_and_backward_equal_eager() -> None:
    torch._dynamo.reset()
    mc = ModelConfig(
        vocab_size=64, n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=16
    )
    torch.manual_seed(0)
    block = Block(mc, moe=False)
    compiled = Block(mc, moe=False)
    compiled.load_state_dict(block.state_dict())
    compiled.compile()
    cos, sin = rope_tables(16, mc.head_dim)
    x = torch.randn(2, 16, 32)
    results = []
    for module in (block, compiled):
        xi = x.clone().requires_grad_(True)
        y, _ = module(xi, cos, sin)
        y.pow(2).mean().backward()
        results.append((y.detach(), xi.grad, [p.grad for p in module.parameters()]))
    (y0, gx0, gp0), (y1, gx1, gp1) = results
    torch.testing.assert_close(y1, y0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gx1, gx0, atol=1e-5, rtol=1e-5)
    for a, b in zip(gp0, gp1, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)

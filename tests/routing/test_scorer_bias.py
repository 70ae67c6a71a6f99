"""The router's optional scorer bias (RouterConfig.scorer_bias): off by default, no new
state-dict key when off, added to the scores when on, and trained by the gradient."""

import torch

from moelab.routing.config import RouterConfig
from moelab.routing.router import Router


def _router(**kw) -> Router:
    torch.manual_seed(0)
    return Router(RouterConfig(d_model=6, n_experts=5, top_k=2, **kw))


def test_off_by_default_and_state_dict_unchanged() -> None:
    off = _router()
    assert off.scorer_bias is None
    assert "scorer_bias" not in off.state_dict()
    assert "scorer_bias" not in dict(off.named_parameters())
    # a state dict written without the key loads into a default router, strict
    fresh = _router()
    fresh.load_state_dict(off.state_dict(), strict=True)
    on = _router(scorer_bias=True)
    assert set(on.state_dict()) == set(off.state_dict()) | {"scorer_bias"}
    assert tuple(on.scorer_bias.shape) == (5,)
    assert torch.equal(on.scorer_bias.detach(), torch.zeros(5))


def test_bias_adds_to_scores_and_changes_the_routing() -> None:
    router = _router(scorer_bias=True, renorm=True)
    x = torch.randn(7, 6)
    bias = torch.tensor([0.0, 3.0, -1.0, 0.5, 2.0])
    with torch.no_grad():
        router.scorer_bias.copy_(bias)
    out = router(x)
    expected = x @ router.weight.detach().t() + bias
    torch.testing.assert_close(out.scores_TE, expected)
    # the choice follows the biased scores: top-2 of x W^T + b
    ref_ids = expected.topk(2, dim=-1).indices
    assert torch.equal(out.ids_TK.sort(-1).values, ref_ids.sort(-1).values)


def test_bias_receives_gradient_and_trains() -> None:
    router = _router(scorer_bias=True, aux_weight=0.1)
    x = torch.randn(16, 6)
    out = router(x)
    (out.weights_TK[:, 0].sum() + out.aux_loss).backward()
    assert router.scorer_bias.grad is not None
    assert router.scorer_bias.grad.abs().sum() > 0
    # the bias has the gradient of the scores summed over tokens (d s / d b = 1)
    router.zero_grad()
    x.requires_grad_(False)
    out = router(x)
    out.scores_TE.retain_grad()
    out.weights_TK[:, 0].sum().backward()
    torch.testing.assert_close(router.scorer_bias.grad, out.scores_TE.grad.sum(0))

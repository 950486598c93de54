"""RaggedTensor's direct path: elementwise methods under no_grad run on the pieces before the dispatcher.

Semantics must not change (tests/distributed/test_ragged_tensor.py checks every optimizer bitwise against full
tensors); these tests pin what is specific to the direct path: when it is taken, that it leaves the version
counter as the dispatcher does, and that what it does not handle still reaches __torch_dispatch__ and its errors.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_vescale.engine.tensor import RaggedLayout, RaggedTensor, UnsupportedRaggedOp


def _layout(n: int) -> RaggedLayout:
    return RaggedLayout((n,), ((0, n),), None, 0)


def _param(values: torch.Tensor, layout: RaggedLayout) -> nn.Parameter:
    return nn.Parameter(RaggedTensor(values.clone(), layout))


@pytest.fixture
def dispatches(monkeypatch):
    """The ops that reached RaggedTensor.__torch_dispatch__."""
    seen: list = []
    original = RaggedTensor.__dict__["__torch_dispatch__"].__func__

    def counting(cls, func, types, args=(), kwargs=None):
        seen.append(func)
        return original(cls, func, types, args, kwargs)

    monkeypatch.setattr(RaggedTensor, "__torch_dispatch__", classmethod(counting))
    return seen


def test_single_tensor_adamw_step_skips_the_dispatcher(dispatches) -> None:
    torch.manual_seed(0)
    layout = _layout(10)
    values, grads = torch.randn(3, 10), torch.randn(3, 10)
    ragged = [_param(v, layout) for v in values]
    plain = [nn.Parameter(v.clone()) for v in values]
    for p, q, g in zip(ragged, plain, grads):
        p.grad, q.grad = RaggedTensor(g.clone(), layout), g.clone()
    on_ragged = torch.optim.AdamW(ragged, lr=1e-2, weight_decay=0.1, foreach=False)
    on_plain = torch.optim.AdamW(plain, lr=1e-2, weight_decay=0.1, foreach=False)
    on_ragged.step()  # the first step creates the states (zeros_like, a factory: dispatched)
    on_plain.step()
    dispatches.clear()
    on_ragged.step()
    on_plain.step()
    assert dispatches == [], f"the step's elementwise ops reached the dispatcher: {dispatches[:5]}"
    for p, q in zip(ragged, plain):
        assert torch.equal(p.to_local(), q.detach())
        assert torch.equal(on_ragged.state[p]["exp_avg_sq"].to_local(), on_plain.state[q]["exp_avg_sq"])


def test_grad_mode_goes_through_the_dispatcher(dispatches) -> None:
    p = _param(torch.randn(6), _layout(6))
    out = p * 2.0
    assert dispatches, "under grad mode autograd must see the op"
    assert out.grad_fn is not None and isinstance(out, RaggedTensor)


def test_in_place_bumps_the_version_like_the_dispatcher() -> None:
    p = _param(torch.randn(6), _layout(6))
    with torch.no_grad():
        before = p._version
        torch.ops.aten.mul_.Scalar(p, 2.0)  # the dispatcher's path
        by_dispatch = p._version - before
        before = p._version
        p.mul_(2.0)  # the direct path
        direct = p._version - before
    assert by_dispatch >= 1 and direct == by_dispatch


def test_out_of_place_result_keeps_the_layout() -> None:
    layout = _layout(6)
    p = _param(torch.rand(6) + 0.5, layout)
    with torch.no_grad():
        out = (p.sqrt() / 3.0).add_(1e-8)
    assert isinstance(out, RaggedTensor) and out.layout_info is layout
    assert torch.equal(out.to_local(), (p.to_local().sqrt() / 3.0).add_(1e-8))


def test_mixed_arguments_still_raise_under_no_grad() -> None:
    a = _param(torch.randn(6), _layout(6))
    b = _param(torch.randn(6), RaggedLayout((6,), ((0, 6),), None, 0))  # equal shape, another layout object
    with torch.no_grad():
        with pytest.raises(UnsupportedRaggedOp, match="plain tensor"):
            a.mul_(torch.randn(6))
        a.add_(b)  # equal layouts (by value) combine, through the checked path
        with pytest.raises(UnsupportedRaggedOp, match="not supported|full_tensor"):
            a.cumsum(0)

"""Sharded parameters (RaggedTensor) behave like the full parameters wherever user code can see them.

On 3 gloo ranks shared by one class of tests (:class:`tests.dist_pool.DistributedTest`), one test per behaviour
(the MLP's sizes divide by none of them, so pieces are uneven and some cut rows):

* every elementwise ``torch.optim`` optimizer, with ``foreach`` off and on and ``fused`` where torch has
  it on the device, steps the sharded parameters exactly like the optimizer on the full tensors given the
  same gradients: bitwise in fp32 (the same elementwise ops on the same values), fused kernels within an
  ulp (see ``same``);
* reductions (``sum``, ``mean``, ``max``, ``abs().max()``, norms, ``_foreach_norm``) are the global values,
  and ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` clip like on the full model (1e-6: the norm
  adds per-rank partial sums in another order);
* shape-based rules (init by ``p.ndim``, freezing by ``p.shape``) do what they do on the full model;
* an op outside the supported set, a mix with a plain tensor, and two layouts in one op raise on every
  rank, naming the problem, and change nothing.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lightning_vescale as lv
from lightning_vescale.engine.tensor import RaggedTensor, UnsupportedRaggedOp, is_ragged
from tests.dist_pool import DistributedTest
from tests.toy_models import MLP

WORLD = 3
STEPS = 2

# (name, class, kwargs, variants): every elementwise torch.optim optimizer; fused only where CPU has it.
OPTIMIZERS = [
    ("SGD", torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01), ("single", "foreach", "fused")),
    ("Adam", torch.optim.Adam, dict(lr=1e-2), ("single", "foreach", "fused")),
    ("AdamW", torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), ("single", "foreach", "fused")),
    ("Adagrad", torch.optim.Adagrad, dict(lr=1e-2), ("single", "foreach", "fused")),
    ("RMSprop", torch.optim.RMSprop, dict(lr=1e-2, momentum=0.9), ("single", "foreach")),
    ("Adamax", torch.optim.Adamax, dict(lr=1e-2), ("single", "foreach")),
    ("NAdam", torch.optim.NAdam, dict(lr=1e-2), ("single", "foreach")),
    ("RAdam", torch.optim.RAdam, dict(lr=1e-2), ("single", "foreach")),
]


def sharded_copy(ref: nn.Module) -> nn.Module:
    model = copy.deepcopy(ref)
    for block in model.blocks:
        lv.fully_shard(block)
    return lv.fully_shard(model)


def set_grads(model: nn.Module, ref: nn.Module) -> None:
    """Give the sharded model this rank's pieces of the reference's gradients."""
    for p, q in zip(model.parameters(), ref.parameters()):
        p.grad = RaggedTensor.from_full(q.grad, p.layout_info)


def random_grads(ref: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in ref.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def same(got: torch.Tensor, want: torch.Tensor, variant: str, what: str) -> None:
    """Bitwise, except fused kernels: they vectorize a piece's last elements differently from the same elements
    inside the whole tensor (FMA in the vector body, not in the scalar tail), so they may differ by an ulp."""
    if variant == "fused":
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(got, want), f"{what} differs by {(got - want).abs().max().item()}"


OPTIMIZER_CASES = [(name, variant) for name, _, _, variants in OPTIMIZERS for variant in variants]


def _optimizer_steps_like_full_tensors(rank: int, world: int, name: str, variant: str) -> None:
    torch.manual_seed(0)
    ref0 = MLP()
    cls, kwargs = next((cls, kwargs) for n, cls, kwargs, _ in OPTIMIZERS if n == name)
    flag = {"single": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[variant]
    ref = copy.deepcopy(ref0)
    model = sharded_copy(ref0)
    ref_opt, opt = cls(ref.parameters(), **kwargs, **flag), cls(model.parameters(), **kwargs, **flag)
    for step in range(STEPS):
        random_grads(ref, seed=10 * step)
        set_grads(model, ref)
        ref_opt.step()
        opt.step()
    what = f"{name} ({variant})"
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        same(p.full_tensor(), q.detach(), variant, f"{what}: parameter {n}")
        for key, value in opt.state[p].items():
            want = ref_opt.state[q][key]
            got = value.full_tensor() if is_ragged(value) else value
            same(got, want, variant, f"{what}: state {key!r} of {n}")
            if torch.is_tensor(want) and want.dim() > 0:
                assert is_ragged(value) and value.layout_info == p.layout_info, (what, n, key)


def _reductions_are_global(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = MLP()
    model = sharded_copy(ref)
    lv.comm_stats.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        q = q.detach()
        assert p.shape == q.shape and p.ndim == q.ndim and p.numel() == q.numel() and p.dtype == q.dtype, n
        checks = {
            "sum": (p.sum(), q.sum()),
            "mean": (p.mean(), q.mean()),
            "max": (p.max(), q.max()),
            "min": (p.min(), q.min()),
            "abs().max()": (p.abs().max(), q.abs().max()),
            "norm()": (p.norm(), q.norm()),
            "vector_norm(3)": (torch.linalg.vector_norm(p, 3), torch.linalg.vector_norm(q, 3)),
            "vector_norm(inf)": (torch.linalg.vector_norm(p, math.inf), torch.linalg.vector_norm(q, math.inf)),
        }
        for what, (got, want) in checks.items():
            assert not is_ragged(got) and got.shape == want.shape, (n, what)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=lambda m: f"{n} {what}: {m}")
        assert torch.equal(p.abs().max(), q.abs().max()), n  # max is exact
        assert bool((p > 0).any()) == bool((q > 0).any()) and bool((p > -9).all()) == bool((q > -9).all()), n
    assert lv.comm_stats.step_calls["all_reduce_ragged"] > 0, "a reduction of a piece must communicate"


def _foreach_norm_is_one_all_reduce(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = MLP()
    model = sharded_copy(ref)
    params = list(model.parameters())
    got = torch._foreach_norm(params)
    want = torch._foreach_norm([q.detach() for q in ref.parameters()])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=0)
    lv.comm_stats.step()
    torch._foreach_norm(params)
    assert lv.comm_stats.step_calls["all_reduce_ragged"] == 1, "one all-reduce for the whole list"


FOREACH = {"default": None, "foreach": True, "for_loop": False}


def _clip_grad_norm_like_full_model(rank: int, world: int, foreach_case: str) -> None:
    """Clipping with torch's own functions: same total norm and the same clipped gradients."""
    torch.manual_seed(0)
    ref = MLP()
    model = sharded_copy(ref)
    foreach = FOREACH[foreach_case]
    random_grads(ref, seed=1)
    set_grads(model, ref)
    max_norm = 0.3 * torch.nn.utils.get_total_norm([q.grad for q in ref.parameters()]).item()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=foreach)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, foreach=foreach)
    torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-9)


def _clip_grad_value_like_full_model(rank: int, world: int, foreach_case: str) -> None:
    torch.manual_seed(0)
    ref = MLP()
    model = sharded_copy(ref)
    foreach = FOREACH[foreach_case]
    random_grads(ref, seed=2)
    set_grads(model, ref)
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.5, foreach=foreach)
    torch.nn.utils.clip_grad_value_(ref.parameters(), 0.5, foreach=foreach)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad.full_tensor(), q.grad)


def _init_by_ndim_gives_full_model_values(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = MLP()
    model = sharded_copy(ref)
    # Init by ndim: matrices xavier, vectors zero, with the same seed on every rank: the full model's values.
    for m in (ref, model):
        torch.manual_seed(5)
        for p in m.parameters():
            if p.ndim >= 2:
                nn.init.xavier_uniform_(p)
            else:
                nn.init.trunc_normal_(p, std=0.02)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.full_tensor(), q.detach()), f"init of {n}"


def _local_draw_gives_other_values(rank: int, world: int) -> None:
    """Negative control: drawing each rank's piece by itself (what a local op would do) gives other values."""
    torch.manual_seed(0)
    ref = MLP()
    model = sharded_copy(ref)
    w = model.inp.weight
    for draw in (w, w.to_local()):
        torch.manual_seed(6)
        with torch.no_grad():
            draw.uniform_(-0.5, 0.5)
        torch.manual_seed(6)
        nn.init.uniform_(ref.inp.weight, -0.5, 0.5)
        assert torch.equal(w.full_tensor(), ref.inp.weight.detach()) == (draw is w)


def _freezing_by_shape(rank: int, world: int) -> None:
    """Freezing by shape: the rule selects the same parameters, and they stay unchanged through training."""
    torch.manual_seed(0)
    ref = MLP()
    model = sharded_copy(ref)
    frozen = {n for n, p in ref.named_parameters() if p.shape[0] == 13}
    assert frozen == {n for n, p in model.named_parameters() if p.shape[0] == 13} and frozen
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    before = {n: p.full_tensor() for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    x = torch.randn(4, 7)
    F.mse_loss(model(x), torch.randn(4, 5)).backward()
    opt.step()
    for n, p in model.named_parameters():
        moved = not torch.equal(p.full_tensor(), before[n])
        assert moved == (n not in frozen), n
        assert (p.grad is None) == (n in frozen), n


def _weight_decay_groups_by_ndim(rank: int, world: int) -> None:
    """Weight decay by ndim, the nanoGPT idiom: the groups are the full model's on every rank."""
    torch.manual_seed(0)
    ref = MLP()
    model = sharded_copy(ref)
    decay = sorted(n for n, p in model.named_parameters() if p.dim() >= 2)
    assert decay == sorted(n for n, p in ref.named_parameters() if p.dim() >= 2)


UNSUPPORTED_OPS = ["aten.mm", "aten.select", "aten.sum.dim_IntList", "aten.t", "aten.cumsum", "aten.randn_like"]


def _refusal(rank: int, world: int, case: str) -> None:
    torch.manual_seed(0)
    model = sharded_copy(MLP())
    before = {n: p.full_tensor() for n, p in model.named_parameters()}
    w, b = model.inp.weight, model.blocks[0].up.weight
    x = torch.randn(7, 3)
    with torch.no_grad():
        ops = {"aten.mm": lambda: torch.mm(w, x), "aten.select": lambda: w[0],
               "aten.sum.dim_IntList": lambda: w.sum(dim=0), "aten.t": lambda: w.t(),
               "aten.cumsum": lambda: w.cumsum(0), "aten.randn_like": lambda: torch.randn_like(w)}
        if case in ops:
            with pytest.raises(UnsupportedRaggedOp, match=rf"{case}.*full_tensor\(\)"):
                ops[case]()
        elif case == "plain_tensor":
            with pytest.raises(UnsupportedRaggedOp,
                               match=r"mixes a sharded RaggedTensor with a plain tensor of shape"):
                w.add_(torch.ones(w.shape))
        else:
            # b's shape, whole on a rank
            other = lv.fully_shard(nn.Linear(13, 37, bias=False), granularity="tensor").weight
            assert other.shape == b.shape and other.layout_info != b.layout_info
            with pytest.raises(UnsupportedRaggedOp, match="two different layouts"):
                b.add_(other)
    for n, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), before[n]), f"{n} changed by a refused op"


class TestRaggedTensorOn3Ranks(DistributedTest):
    world_size = WORLD

    @pytest.mark.parametrize(("name", "variant"), OPTIMIZER_CASES, ids=[f"{n}-{v}" for n, v in OPTIMIZER_CASES])
    def test_elementwise_optimizer_matches_full_tensors(self, name: str, variant: str) -> None:
        self.run_ranks(_optimizer_steps_like_full_tensors, name, variant)

    def test_reductions_are_global_values(self) -> None:
        self.run_ranks(_reductions_are_global)

    def test_foreach_norm_is_one_all_reduce_for_the_list(self) -> None:
        self.run_ranks(_foreach_norm_is_one_all_reduce)

    @pytest.mark.parametrize("foreach", list(FOREACH))
    def test_clip_grad_norm_clips_like_the_full_model(self, foreach: str) -> None:
        self.run_ranks(_clip_grad_norm_like_full_model, foreach)

    @pytest.mark.parametrize("foreach", list(FOREACH))
    def test_clip_grad_value_clips_like_the_full_model(self, foreach: str) -> None:
        self.run_ranks(_clip_grad_value_like_full_model, foreach)

    def test_init_by_ndim_gives_the_full_model_values(self) -> None:
        self.run_ranks(_init_by_ndim_gives_full_model_values)

    def test_a_per_rank_draw_gives_other_values(self) -> None:
        self.run_ranks(_local_draw_gives_other_values)

    def test_freezing_by_shape_selects_the_same_parameters(self) -> None:
        self.run_ranks(_freezing_by_shape)

    def test_weight_decay_groups_by_ndim_are_the_full_models(self) -> None:
        self.run_ranks(_weight_decay_groups_by_ndim)

    @pytest.mark.parametrize("case", [*UNSUPPORTED_OPS, "plain_tensor", "two_layouts"])
    def test_unsupported_op_raises_on_every_rank_and_changes_nothing(self, case: str) -> None:
        self.run_ranks(_refusal, case)

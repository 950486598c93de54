"""Buffer lifetimes of fully_shard (DESIGN invariant 5): what is allocated when, on 2 gloo ranks.

One class of tests sharing the 2 ranks (:class:`tests.dist_pool.DistributedTest`), one test per behaviour (each rank
function's docstring names it); training results are covered by test_fully_shard_training.py. Gradients compared
with one process to 1e-6 (``allclose``); buffer states, storages and collective counts exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lightning_vescale as lv
from lightning_vescale.engine import collectives
from lightning_vescale.engine.fully_shard import sharded_groups
from tests.dist_pool import DistributedTest
from tests.toy_models import MLP


def _sharded_mlp() -> nn.Module:
    torch.manual_seed(0)
    model = MLP(num_blocks=4)
    for block in model.blocks:
        lv.fully_shard(block)
    return lv.fully_shard(model)


def _buffers(model: nn.Module) -> list:
    return [b for g in sharded_groups(model) for b in g.buffers.values()]


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, *, set_to_none: bool = True) -> None:
    F.mse_loss(model(torch.randn(4, 7)), torch.randn(4, 5)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)


def _grads_freed_before_forward(rank: int, world: int) -> None:
    """zero_grad(set_to_none=True) releases the sharded gradient storage by the next forward (FSDP2 frees its
    sharded gradients then too); a gradient the user kept is left untouched."""
    model = _sharded_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optimizer, set_to_none=False)
    kept = next(p for p in model.parameters() if p.to_local().numel() > 0).grad
    kept_values = kept.to_local().clone()
    optimizer.zero_grad(set_to_none=True)
    seen = []
    hook = model.blocks[0].register_forward_pre_hook(lambda m, a: seen.append([b.local_grad for b in _buffers(model)]))
    _step(model, optimizer)
    hook.remove()
    assert seen and all(g is None for g in seen[0]), "sharded gradient storage still allocated during forward"
    assert torch.equal(kept.to_local(), kept_values), "a gradient the user kept was overwritten"
    # The new gradients live in new storage: the kept one is not a view of it.
    assert all(b.local_grad is None or b.local_grad.untyped_storage()._cdata != kept.to_local().untyped_storage()._cdata
               for b in _buffers(model))


def _grads_freed_when_backward_starts(rank: int, world: int) -> None:
    """Lightning zeroes gradients between forward and backward: the storage is released when backward starts,
    before any group's ReduceScatter allocates its new piece."""
    model = _sharded_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optimizer, set_to_none=False)
    first_block = sharded_groups(model.blocks[0])[0]
    seen = []
    hook = model.blocks[-1].register_full_backward_pre_hook(
        lambda m, g: seen.append([b.local_grad for b in first_block.buffers.values()]))
    loss = F.mse_loss(model(torch.randn(4, 7)), torch.randn(4, 5))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    hook.remove()
    assert seen and all(g is None for g in seen[0]), "sharded gradient storage kept into backward"
    assert all(p.grad is not None for p in model.parameters())


def _grads_kept_without_set_to_none(rank: int, world: int) -> None:
    """zero_grad(set_to_none=False) zeroes the gradients in place: the storage and the .grad objects stay."""
    model = _sharded_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optimizer, set_to_none=False)
    before = [b.local_grad.untyped_storage()._cdata for b in _buffers(model)]
    grads = [p.grad for p in model.parameters()]
    _step(model, optimizer, set_to_none=False)
    assert [b.local_grad.untyped_storage()._cdata for b in _buffers(model)] == before
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))


def _one_reduce_scatter_in_flight(rank: int, world: int) -> None:
    """With one ReduceScatter allowed in flight (the default on accelerators), when a group issues its
    ReduceScatter the previous group's has been finished and its unsharded gradient buffer freed: at most one
    group's reduction overlaps compute (plus the root's buffer, still accumulating)."""
    model = _sharded_mlp()
    model.set_reduces_in_flight(1)
    groups = sharded_groups(model)
    root = groups[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    observed = []
    original = collectives.reduce_scatter_tensor

    def spy(out, inp, *args, **kwargs):
        in_flight = [g for g in groups if any(b.reducing for b in g.buffers.values())]
        allocated = [g for g in groups if g is not root and any(
            b.unsharded_grad is not None and b.unsharded_grad.untyped_storage().nbytes() for b in g.buffers.values())]
        observed.append((len(in_flight), len(allocated)))
        return original(out, inp, *args, **kwargs)

    collectives.reduce_scatter_tensor = spy
    try:
        for _ in range(2):
            _step(model, optimizer)
    finally:
        collectives.reduce_scatter_tensor = original
    assert len(observed) == 2 * len(groups), observed
    # In flight beforehand: no other; allocated: only the issuing group's buffer.
    assert all(n == 0 for n, _ in observed), observed
    assert all(a <= 1 for _, a in observed), observed


def _no_reduce_scatter_in_flight_on_cpu(rank: int, world: int) -> None:
    """On CPU (the default there, 0 in flight) a group's ReduceScatter is finished and its unsharded gradient
    buffer freed before backward reaches the next group: no finished group's gradients in the backward peak."""
    model = _sharded_mlp()
    groups = sharded_groups(model)
    assert {g.reduces_in_flight for g in groups} == {0}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen = []
    hooks = [block.register_full_backward_pre_hook(lambda m, g: seen.append(
        [g2 for g2 in groups if g2 is not groups[0] and any(b.reducing or b.grad_allocated for b in g2.buffers.values())]))
        for block in model.blocks]
    for _ in range(2):
        _step(model, optimizer)
    for h in hooks:
        h.remove()
    assert len(seen) == 2 * len(model.blocks) and all(not s for s in seen), seen


def _grad_buffer_allocated_at_first_gradient(rank: int, world: int) -> None:
    """A group's unsharded gradient buffer is allocated when its first gradient arrives, not when backward reaches
    its outputs: the root (inp and out) is gathered for backward before the loss's gradient reaches its head, and
    holds no gradient buffer yet; its gradients are still complete (training parity: test_fully_shard_training)."""
    model = _sharded_mlp()
    root = sharded_groups(model)[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen = []
    out = model(torch.randn(4, 7))
    # Runs after the root's pre-backward hook (registered on the output at its post-forward, before this one).
    out.register_hook(lambda grad: seen.append((root.training_state.name, root.is_unsharded, [
        b.unsharded_grad.untyped_storage().nbytes() for b in root.buffers.values()])))
    F.mse_loss(out, torch.randn(4, 5)).backward()
    optimizer.step()
    assert seen == [("PRE_BACKWARD", True, [0])], seen
    assert all(p.grad is not None for p in model.parameters())


def _cast_grad_buffer_freed_at_reduce_scatter(rank: int, world: int) -> None:
    """Under mixed precision with a wider reduce dtype the ReduceScatter reads a cast copy: the gradient buffer
    (param_dtype) is freed as soon as it is issued, not when it completes; the reduced gradient is unchanged."""
    policy = lv.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    buf = next(iter(sharded_groups(lv.fully_shard(nn.Linear(7, 5), mp_policy=policy))[0].buffers.values()))
    buf.alloc_grad()
    buf.unsharded_grad.fill_(3.0)
    buf.reduce_grad(accumulate=False, async_op=True)
    assert buf.reducing and buf.unsharded_grad.untyped_storage().nbytes() == 0
    buf.wait_reduce()
    assert torch.equal(buf.local_grad, torch.full_like(buf.local_grad, 3.0))


class _EmbeddingMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 7)
        self.mlp = MLP(num_blocks=2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(idx))


def _embedding_not_gathered_for_backward(rank: int, world: int) -> None:
    """A group of embeddings is freed after forward and not gathered for backward, which reads no weight: one
    AllGather per step, nothing gathered while its backward runs, and the same gradient as one process."""
    torch.manual_seed(0)
    ref = _EmbeddingMLP()
    model = copy.deepcopy(ref)
    lv.fully_shard(model.embed)
    for block in model.mlp.blocks:
        lv.fully_shard(block)
    lv.fully_shard(model)
    embed = sharded_groups(model.embed)[0]
    idx, target = torch.randint(0, 11, (4, 3)), torch.randn(4, 3, 5)  # the same batch on every rank
    seen = []

    def watch_backward(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(lambda grad: seen.append(embed.is_unsharded))

    model.embed.register_forward_hook(watch_backward)
    for _ in range(2):  # the first step also checks the plans (one more AllGather); the second one is counted
        calls = []
        original = collectives.all_gather_into_tensor
        collectives.all_gather_into_tensor = lambda *a, **k: calls.append(1) or original(*a, **k)
        try:
            F.mse_loss(model(idx), target).backward()
        finally:
            collectives.all_gather_into_tensor = original
        assert seen[-1] is False and not embed.is_unsharded
        got = model.embed.weight.grad.full_tensor()
        model.zero_grad()
    assert len(calls) == 1 + 2 * len(model.mlp.blocks) + 1, len(calls)  # embedding, blocks twice, root
    F.mse_loss(ref(idx), target).backward()
    assert torch.allclose(got, ref.embed.weight.grad, atol=1e-6), (got - ref.embed.weight.grad).abs().max()


def _embedding_split_from_the_root(rank: int, world: int, split: bool) -> None:
    """The FSDP2 idiom (each block, then the model) gives an untied embedding a group of its own, sharded with the
    root's arguments (a granularity mapping matches names relative to the root), so it is not gathered for
    backward; the same gradients as one process. ``split_embeddings=False`` keeps it in the root's group."""
    torch.manual_seed(0)
    ref = _EmbeddingMLP()
    idx, target = torch.randint(0, 11, (4, 3)), torch.randn(4, 3, 5)
    F.mse_loss(ref(idx), target).backward()
    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
    for block in model.mlp.blocks:
        lv.fully_shard(block)
    lv.fully_shard(model, granularity={"embed.weight": "row"}, split_embeddings=split)
    root = sharded_groups(model)[0]  # modules() order: the root first
    in_root = [mp.fqn for mp in root.managed]
    embed = sharded_groups(model.embed)
    assert ("embed.weight" not in in_root and len(embed) == 1) if split else ("embed.weight" in in_root), in_root
    if split:
        assert embed[0].buffers[(torch.float32, True)].plan.specs[0].granularity == 7  # a row, from the mapping
    seen: list = []

    def watch_backward(module: nn.Module, args: tuple, out: torch.Tensor, split: bool = split) -> None:
        if split:
            out.register_hook(lambda grad: seen.append(embed[0].is_unsharded))

    model.embed.register_forward_hook(watch_backward)
    F.mse_loss(model(idx), target).backward()
    assert seen == ([False] if split else []), seen
    for name, p in model.named_parameters():
        ref_grad = ref.get_parameter(name).grad
        assert torch.allclose(p.grad.full_tensor(), ref_grad, atol=1e-6), name


def _root_resharded_after_forward_when_asked(rank: int, world: int, asked: bool) -> None:
    """The root keeps its parameters from forward to backward by default, whatever fully_shard was given; after
    set_reshard_after_forward(True) on it (FSDP2's method) it frees them after forward and gathers them again when
    backward reaches its outputs: one more AllGather, the same gradients."""
    torch.manual_seed(0)
    ref = MLP(num_blocks=2)
    x, target = torch.randn(4, 7), torch.randn(4, 5)
    F.mse_loss(ref(x), target).backward()
    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
    for block in model.blocks:
        lv.fully_shard(block)
    lv.fully_shard(model)
    if asked:
        model.set_reshard_after_forward(True, recurse=False)
    root = sharded_groups(model)[0]
    calls = []
    original = collectives.all_gather_into_tensor
    collectives.all_gather_into_tensor = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        out = model(x)
        assert root.is_unsharded is not asked
        F.mse_loss(out, target).backward()
    finally:
        collectives.all_gather_into_tensor = original
    # The first forward also checks the plans (one more AllGather); root, blocks twice, and the root again.
    assert len(calls) == 1 + 1 + 2 * len(model.blocks) + asked, (asked, len(calls))
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad.full_tensor(), ref.get_parameter(name).grad, atol=1e-6), name


def _backward_prefetch_follows_post_forward_order(rank: int, world: int) -> None:
    """Backward prefetches in reverse order of the groups' post-forwards: a root holding only the head is done
    first in backward and is not gathered again; the input layer, in a group of its own kept gathered from
    forward to backward, is gathered once. One AllGather per group and pass, nothing more."""
    torch.manual_seed(0)
    model = MLP(num_blocks=4)
    lv.fully_shard(model.inp, reshard_after_forward=False)
    for block in model.blocks:
        lv.fully_shard(block)
    lv.fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optimizer)  # records the order
    calls = []
    original = collectives.all_gather_into_tensor

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    collectives.all_gather_into_tensor = spy
    try:
        _step(model, optimizer)
    finally:
        collectives.all_gather_into_tensor = original
    assert len(calls) == 1 + 1 + 2 * len(model.blocks), len(calls)


def _backward_prefetch_switch(rank: int, world: int) -> None:
    """With set_backward_prefetch(True) (the default on accelerators) a block's backward has already started
    gathering the next block in backward order; with False (CPU's default) it is left sharded until its own
    backward. The bytes sent are the same."""
    sent, prefetched = {}, {}
    assert not any(s.backward_prefetch for s in _sharded_mlp()._vescale_states(recurse=True))
    for enabled in (True, False):
        model = _sharded_mlp()
        model.set_backward_prefetch(enabled)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _step(model, optimizer)  # records the forward order that prefetching follows
        nxt = sharded_groups(model.blocks[-2])[0]
        seen = []

        def inside_last_block_backward(module, args, output):
            output.register_hook(lambda grad: seen.append(nxt.is_unsharded))

        hook = model.blocks[-1].up.register_forward_hook(inside_last_block_backward)
        lv.comm_stats.step()
        _step(model, optimizer)
        sent[enabled] = lv.comm_stats.step()
        hook.remove()
        prefetched[enabled] = seen
    assert prefetched[True] == [True] and prefetched[False] == [False], prefetched
    assert sent[True]["all_gather"] == sent[False]["all_gather"], sent


def _explicit_prefetch_plans(rank: int, world: int) -> None:
    """set_modules_to_forward_prefetch / set_modules_to_backward_prefetch (FSDP2's methods): block 0's forward gathers
    exactly the listed blocks (none: block 1 is still sharded inside it; [block 2]: block 2 is gathered before its
    turn), and the last block's backward gathers the listed block even on CPU, where backward prefetch is off."""
    model = _sharded_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optimizer)
    b0, b1, b2 = model.blocks[0], model.blocks[1], model.blocks[2]
    groups = [sharded_groups(b)[0] for b in (b1, b2)]
    seen: list = []
    hook = b0.up.register_forward_hook(lambda *_: seen.append([g.is_unsharded for g in groups]))
    _step(model, optimizer)  # default: the next block in forward order
    b0.set_modules_to_forward_prefetch([])
    _step(model, optimizer)
    b0.set_modules_to_forward_prefetch([b2])
    _step(model, optimizer)
    hook.remove()
    assert seen == [[True, False], [False, False], [False, True]], seen
    with pytest.raises(ValueError, match="not sharded"):
        b0.set_modules_to_forward_prefetch([b0.up])
    target = sharded_groups(model.blocks[-3])[0]
    backward_seen: list = []
    model.blocks[-1].set_modules_to_backward_prefetch([model.blocks[-3]])

    def inside_last_block_backward(module, args, output) -> None:
        output.register_hook(lambda grad: backward_seen.append(target.is_unsharded))

    hook = model.blocks[-1].up.register_forward_hook(inside_last_block_backward)
    _step(model, optimizer)
    hook.remove()
    assert backward_seen == [True], backward_seen


class TestBufferLifetimesOn2Ranks(DistributedTest):
    world_size = 2

    def test_sharded_gradients_are_freed_before_the_next_forward(self) -> None:
        self.run_ranks(_grads_freed_before_forward)

    def test_sharded_gradients_are_freed_when_backward_starts(self) -> None:
        self.run_ranks(_grads_freed_when_backward_starts)

    def test_zero_grad_without_set_to_none_keeps_the_storage(self) -> None:
        self.run_ranks(_grads_kept_without_set_to_none)

    def test_one_reduce_scatter_in_flight_at_most(self) -> None:
        self.run_ranks(_one_reduce_scatter_in_flight)

    def test_no_reduce_scatter_in_flight_on_cpu(self) -> None:
        self.run_ranks(_no_reduce_scatter_in_flight_on_cpu)

    def test_gradient_buffer_is_allocated_at_the_first_gradient(self) -> None:
        self.run_ranks(_grad_buffer_allocated_at_first_gradient)

    def test_cast_gradient_buffer_is_freed_when_the_reduce_scatter_is_issued(self) -> None:
        self.run_ranks(_cast_grad_buffer_freed_at_reduce_scatter)

    def test_embedding_group_is_not_gathered_for_backward(self) -> None:
        self.run_ranks(_embedding_not_gathered_for_backward)

    @pytest.mark.parametrize("split", [True, False], ids=["split_embeddings", "embedding_in_root"])
    def test_embedding_split_from_the_root(self, split: bool) -> None:
        self.run_ranks(_embedding_split_from_the_root, split)

    @pytest.mark.parametrize("asked", [False, True], ids=["default", "reshard_after_forward"])
    def test_root_reshards_after_forward_only_when_asked(self, asked: bool) -> None:
        self.run_ranks(_root_resharded_after_forward_when_asked, asked)

    def test_backward_prefetch_follows_the_post_forward_order(self) -> None:
        self.run_ranks(_backward_prefetch_follows_post_forward_order)

    def test_backward_prefetch_switch_gathers_early_with_the_same_bytes(self) -> None:
        self.run_ranks(_backward_prefetch_switch)

    def test_explicit_forward_and_backward_prefetch_plans(self) -> None:
        self.run_ranks(_explicit_prefetch_plans)

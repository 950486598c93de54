"""Expert parallelism over "ep" composed with sharding over "dp" equals single-process training.

4 gloo ranks as a (dp, ep) = (2, 2) mesh: the experts of each ep rank are sharded over ``mesh["dp"]``
in their own group, everything else over all 4 ranks. Each rank trains on its own quarter of the
global batch; the reference is one process on the whole batch (fp32, 1e-5 relative: the collectives
sum in another order than one backward). Negative controls: the plain dp division of the expert
gradients (off by a factor ep) and the plain dp norm group (experts of the other ep rank missing
from the clipping norm) are both detected. One test per behaviour (:class:`tests.dist_pool.DistributedTest`, the
four ranks shared); the checks by hand start from a reference trained as in the parity test (rebuilt in each test).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import lightning_vescale as lv
from lightning_vescale.engine.fully_shard import get_state
from lightning_vescale.models import MoE, moe_config
from lightning_vescale.parallel import (
    apply_expert_parallel,
    fully_shard_expert_parallel,
)
from tests.dist_pool import DistributedTest

LOCAL_BATCH, SEQ = 2, 8
TOL = 1e-5


def _make_reference() -> MoE:
    torch.manual_seed(0)
    config = dataclasses.replace(moe_config("tiny"), vocab_size=64, dim=32, moe_hidden=32, shared_expert_hidden=32)
    ref = MoE(config)
    with torch.no_grad():
        for layer in ref.moe_layers():
            layer.router.weight.normal_(0, 1.0)  # decisive routing: no near-ties that 1e-7 could flip
    return ref


def _batch(step: int, world: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, vocab, (world * LOCAL_BATCH, SEQ + 1), generator=generator)


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _ref_slice(model, ref, name: str, full: torch.Tensor) -> torch.Tensor:
    """The reference values matching a sharded parameter's local piece (its range in the full tensor: for
    experts, the tensor of all experts)."""
    start, end = model.get_parameter(name).local_range
    return full.reshape(-1)[start:end]


def _max_rel_diff(model, ref, *, grads: bool, experts_only: bool = False) -> float:
    """Largest |local piece - reference piece| / max |reference tensor|, agreed by all ranks."""
    worst = torch.zeros(())
    for name, p in model.named_parameters():
        if experts_only and ".experts." not in name:
            continue
        full = ref.get_parameter(name)
        full = full.grad if grads else full.detach()
        mine = (p.grad if grads else p.detach()).to_local()
        want = _ref_slice(model, ref, name, full)
        if want.numel():
            diff = (mine.reshape(-1) - want).abs().max() / full.abs().max().clamp_min(1e-12)
            worst = torch.maximum(worst, diff)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def _expert_norms(model, ref) -> tuple[float, float]:
    """The experts' gradient norm as the engine computes it (nothing clipped) and the reference's."""
    got = lv.clip_grad_norm_([p for n, p in model.named_parameters() if ".experts." in n], float("inf"))
    want = torch.nn.utils.get_total_norm([p.grad for n, p in ref.named_parameters() if ".experts." in n])
    return got.item(), want.item()


def _global_loss(loss: torch.Tensor) -> float:
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _manual_composition(ref, mesh, flat, *, divide: bool, norm: bool):
    """The same composition by hand, optionally without the divide factor or the norm group."""
    model = apply_expert_parallel(copy.deepcopy(ref), mesh["ep"])
    for layer in model.moe_layers():
        lv.fully_shard(
            layer.experts, mesh=mesh["dp"], gradient_divide_factor=4 if divide else None,
            norm_group=flat if norm else None,
        )
    for block in model.layers:
        lv.fully_shard(block, mesh=flat)
    return lv.fully_shard(model, mesh=flat)


def _meshes():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep")), init_device_mesh("cpu", (4,))


def _embedding_is_a_group_of_its_own(rank: int, world: int) -> None:
    mesh, _ = _meshes()
    model = fully_shard_expert_parallel(_make_reference(), mesh)
    # The token embedding is a group of its own (as the default plan makes it), not in the root: there its gradient
    # buffer would live through the whole backward.
    embedding = get_state(model.tok_embeddings)
    assert embedding is not None and [mp.fqn for mp in embedding.group.managed] == ["weight"]
    assert "tok_embeddings.weight" not in [mp.fqn for mp in get_state(model).group.managed]


def _layout(rank: int, world: int) -> None:
    mesh, _ = _meshes()
    ref = _make_reference()
    model = fully_shard_expert_parallel(copy.deepcopy(ref), mesh)
    # The layout: every parameter reports the unsharded model's shape (experts: all E experts), laid out over
    # all 4 ranks. An expert stack's piece lies inside this rank's experts (E/ep of them, split over dp).
    num_local = ref.config.num_experts // 2
    for name, p in model.named_parameters():
        assert p.shape == ref.get_parameter(name).shape, name
        layout = p.layout_info
        assert dist.get_world_size(layout.group) == 4, name
        if ".experts." in name:
            module = model.get_submodule(name.rsplit(".", 1)[0])
            block = p.numel() // ref.config.num_experts * num_local
            start, end = layout.local_range
            lo = module.expert_start // num_local * block
            assert start == end or lo <= start <= end <= lo + block, (name, layout)


def _ref_step(ref, ref_opt, tokens: torch.Tensor) -> torch.Tensor:
    """One reference step, clipped at half its true norm (so that clipping is active); returns its loss."""
    ref_loss = _loss(ref, tokens)
    ref_loss.backward()
    true_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5 * true_norm)
    ref_opt.step()
    ref_opt.zero_grad()
    return ref_loss


def _trained_reference(world: int) -> MoE:
    """The reference as the parity test leaves it: 3 clipped SGD steps on the whole batch."""
    ref = _make_reference()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        _ref_step(ref, ref_opt, _batch(step, world, ref.config.vocab_size))
    return ref


def _trains_like_single_process(rank: int, world: int) -> None:
    mesh, _ = _meshes()
    ref = _make_reference()
    vocab = ref.config.vocab_size
    model = fully_shard_expert_parallel(copy.deepcopy(ref), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    for step in range(3):
        tokens = _batch(step, world, vocab)
        loss = _loss(model, tokens[mine])
        loss.backward()
        ref_loss = _loss(ref, tokens)
        ref_loss.backward()
        got = _global_loss(loss)
        assert abs(got - ref_loss.item()) <= TOL * max(1.0, abs(ref_loss.item())), (step, got, ref_loss.item())
        assert _max_rel_diff(model, ref, grads=True) < TOL, step
        # The experts' part of the norm alone (it is small next to the embeddings'), then clipping at half
        # the true norm, so that it is active.
        got_norm, want_norm = _expert_norms(model, ref)
        assert abs(got_norm - want_norm) <= TOL * want_norm, (step, got_norm, want_norm)
        true_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()
        norm = lv.clip_grad_norm_(model.parameters(), 0.5 * true_norm)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5 * true_norm)
        assert abs(norm.item() - ref_norm.item()) <= TOL * ref_norm.item(), (step, norm, ref_norm)
        assert _max_rel_diff(model, ref, grads=True) < TOL, step
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert _max_rel_diff(model, ref, grads=False) < TOL, step
    moved = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), _make_reference().parameters()))
    assert moved > 1e-2, "training must change the parameters for the parity check to mean anything"
    # The reference the checks by hand rebuild is this one, bitwise.
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), _trained_reference(world).parameters()))


def _fresh_batch_gradients(world: int):
    """The trained reference's gradients on a fresh batch, and that batch."""
    ref = _trained_reference(world)
    tokens = _batch(10, world, ref.config.vocab_size)
    ref_loss = _loss(ref, tokens)
    ref_loss.backward()
    return ref, tokens


def _composition_by_hand(rank: int, world: int) -> None:
    """The same by hand, from the trained reference, one step on a fresh batch."""
    mesh, flat = _meshes()
    ref, tokens = _fresh_batch_gradients(world)
    mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    true_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()
    good = _manual_composition(ref, mesh, flat, divide=True, norm=True)
    _loss(good, tokens[mine]).backward()
    assert _max_rel_diff(good, ref, grads=True) < TOL
    assert abs(lv.clip_grad_norm_(good.parameters(), 1e9).item() - true_norm) <= TOL * true_norm
    got_norm, want_norm = _expert_norms(good, ref)
    assert abs(got_norm - want_norm) <= TOL * want_norm, (got_norm, want_norm)


def _plain_dp_division_is_detected(rank: int, world: int) -> None:
    """Negative control 1: the default division by the dp group size leaves expert gradients ep (2) times too
    large; the other gradients are right."""
    mesh, flat = _meshes()
    ref, tokens = _fresh_batch_gradients(world)
    mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    no_divide = _manual_composition(ref, mesh, flat, divide=False, norm=True)
    _loss(no_divide, tokens[mine]).backward()
    assert _max_rel_diff(no_divide, ref, grads=True, experts_only=True) > 0.1
    for name, p in no_divide.named_parameters():
        full = ref.get_parameter(name).grad
        want = _ref_slice(no_divide, ref, name, full)
        scale = 2.0 if ".experts." in name else 1.0
        torch.testing.assert_close(p.grad.to_local().reshape(-1), scale * want, rtol=TOL, atol=TOL * full.abs().max().item())


def _plain_dp_norm_group_is_refused(rank: int, world: int) -> None:
    """Negative control 2: without the norm group the expert stacks could only be laid out over the dp shard
    group, which misses the other ep rank's experts (their norm would be too small): refused, named."""
    mesh, flat = _meshes()
    with pytest.raises(ValueError, match="norm_group"):
        _manual_composition(_trained_reference(world), mesh, flat, divide=True, norm=False)


class TestExpertParallelWithDpSharding(DistributedTest):
    """(dp, ep) = (2, 2) on 4 ranks."""

    world_size = 4

    def test_token_embedding_is_a_group_of_its_own(self) -> None:
        self.run_ranks(_embedding_is_a_group_of_its_own)

    def test_parameters_report_full_shapes_and_experts_lie_in_their_ep_block(self) -> None:
        self.run_ranks(_layout)

    def test_training_with_clipping_matches_single_process(self) -> None:
        self.run_ranks(_trains_like_single_process)

    def test_composition_by_hand_matches_single_process(self) -> None:
        self.run_ranks(_composition_by_hand)

    def test_plain_dp_gradient_division_is_detected(self) -> None:
        self.run_ranks(_plain_dp_division_is_detected)

    def test_experts_without_a_norm_group_are_refused(self) -> None:
        self.run_ranks(_plain_dp_norm_group_is_refused)

"""Optimizer states, master weights, gradients, activations and gathered parameters on the disk tier train bitwise
like those in memory, and checkpoint exactly.

One class of tests per world size (1, 2 and 3 gloo ranks, fp32, CPU; :class:`tests.dist_pool.DistributedTest`), one
test per behaviour and optimizer; every comparison is bitwise:

* 1 and 3 ranks: a sharded MLP trained with AdamW and with Muon + AdamW (``build_optimizer``), once with states in
  memory and once with ``MemoryPolicy(optimizer_states="disk")`` and small buckets (so several buckets, prefetch
  included, are exercised, and the first buckets are read during backward): every parameter and state is equal
  after every step; between steps the states' storage is released once the write-back finished (the ledger counts
  it on disk); a save and a resume into a fresh offloaded optimizer continue bitwise.
* 2 ranks: offloaded and recomputed activations give the same gradients; master weights, gradient pieces and
  states on disk (with accumulation and clipping) train like memory, torch's clip_grad_norm_ refuses pieces on
  disk, and a save/resume from disk continues the run; a disk without room is refused before anything moves;
  a plan's per-parameter tiers move exactly what the plan places; gathered parameters on disk replace exactly
  the backward AllGathers' bytes.
* In the test process: bad policies fail before training.
"""

from __future__ import annotations

import copy
import os
import shutil
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import lightning_vescale as lv
from lightning_vescale import checkpoint as ckpt
from lightning_vescale.memory import (
    DiskTierError,
    MemoryPolicy,
    memory_stats,
    offload_optimizer_states,
    resident_states,
)
from lightning_vescale.optim import build_optimizer
from tests.dist_pool import DistributedTest
from tests.toy_models import MLP

STEPS = 3


def sharded(ref):
    model = copy.deepcopy(ref)
    for block in model.blocks:
        lv.fully_shard(block)
    return lv.fully_shard(model)


def make_optimizer(kind: str, model):
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return build_optimizer(model, lr=1e-2, muon_lr=2e-2)


def train_step(model, opt, step: int, rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(4 * world, 7, generator=g), torch.randn(4 * world, 5, generator=g)
    F.mse_loss(model(x[rank::world]), y[rank::world]).backward()
    opt.step()
    opt.zero_grad()


def states_of(opt) -> list[torch.Tensor]:
    return [v.full_tensor() if hasattr(v, "full_tensor") else v for p in opt.state for v in opt.state[p].values()
            if isinstance(v, torch.Tensor)]

def _states_on_disk_run(rank: int, world: int, tmp: str, kind: str):
    """STEPS steps in memory and with states on disk side by side: bitwise after every step, the states' storage
    released between steps."""
    torch.manual_seed(0)
    ref = MLP()
    plain, swapped = sharded(ref), sharded(ref)
    plain_opt, opt = make_optimizer(kind, plain), make_optimizer(kind, swapped)
    policy = MemoryPolicy(optimizer_states="disk", disk_dir=os.path.join(tmp, f"swap{rank}"), bucket_bytes=2048)
    offload = offload_optimizer_states(opt, policy, model=swapped)  # the model: reads during backward too
    assert len(offload.buckets()) > 2, "several buckets must be swapped for the test to mean anything"
    memory_stats.reset()
    for step in range(STEPS):
        train_step(plain, plain_opt, step, rank, world)
        train_step(swapped, opt, step, rank, world)
        for p, q in zip(plain.parameters(), swapped.parameters()):
            assert torch.equal(p.to_local(), q.to_local()), (kind, step)
        # Between steps every per-element state lives on disk (once the write-back in flight finished): its
        # storage is released.
        offload.flush()
        released = [v.to_local().untyped_storage().nbytes() == 0
                    for s in opt.state.values() for v in s.values() if hasattr(v, "to_local")]
        assert released and all(released), (kind, step)
    return plain, plain_opt, swapped, opt, offload


def _states_on_disk_train_bitwise(rank: int, world: int, tmp: str, kind: str) -> None:
    plain, plain_opt, swapped, opt, offload = _states_on_disk_run(rank, world, tmp, kind)
    assert memory_stats.current[("optimizer_states", "disk")] > 0
    with resident_states(opt):  # to read offloaded states, bring them in
        assert [torch.equal(a, b) for a, b in zip(states_of(plain_opt), states_of(opt))] == [True] * len(
            states_of(plain_opt)), kind
    offload.close()


def _states_on_disk_save_and_resume(rank: int, world: int, tmp: str, kind: str) -> None:
    """Save while the states are on disk, resume into a fresh offloaded optimizer: bitwise the same run."""
    plain, plain_opt, swapped, opt, offload = _states_on_disk_run(rank, world, tmp, kind)
    path = os.path.join(tmp, f"ck_{kind}")
    ckpt.save(path, swapped, opt)
    assert all(v.to_local().untyped_storage().nbytes() == 0
               for s in opt.state.values() for v in s.values() if hasattr(v, "to_local")), "put back after save"
    torch.manual_seed(5)
    resumed = sharded(MLP())
    resumed_opt = make_optimizer(kind, resumed)
    offload_optimizer_states(resumed_opt, MemoryPolicy(optimizer_states="disk", bucket_bytes=2048,
                                                       disk_dir=os.path.join(tmp, f"swap_resumed{rank}")),
                             model=resumed)
    ckpt.load(path, resumed, resumed_opt)
    for step in range(STEPS, STEPS + 2):
        train_step(plain, plain_opt, step, rank, world)
        train_step(resumed, resumed_opt, step, rank, world)
    for p, q in zip(plain.parameters(), resumed.parameters()):
        assert torch.equal(p.to_local(), q.to_local()), f"{kind}: resumed run differs"
    offload.close()


KINDS = ["adamw", "muon"]


class _StatesOnDiskTests(DistributedTest):
    @pytest.mark.parametrize("kind", KINDS)
    def test_optimizer_states_on_disk_train_bitwise(self, tmp_path, kind: str) -> None:
        self.run_ranks(_states_on_disk_train_bitwise, str(tmp_path), kind)

    @pytest.mark.parametrize("kind", KINDS)
    def test_save_and_resume_with_states_on_disk_continue_bitwise(self, tmp_path, kind: str) -> None:
        self.run_ranks(_states_on_disk_save_and_resume, str(tmp_path), kind)


class TestMemoryOffloadOn1Rank(_StatesOnDiskTests):
    world_size = 1


class TestMemoryOffloadOn3Ranks(_StatesOnDiskTests):
    world_size = 3


def test_bad_policies_fail_before_training(tmp_path) -> None:
    with pytest.raises(ValueError, match="needs disk_dir"):
        MemoryPolicy(optimizer_states="disk")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    if os.access(read_only, os.W_OK):  # root ignores permissions: nothing to check here
        pytest.skip("running as a user that can write anywhere")
    with pytest.raises(ValueError, match="is not writable"):
        MemoryPolicy(optimizer_states="disk", disk_dir=str(read_only))



def _llama_grads(rank: int, setup) -> tuple[list[torch.Tensor], float]:
    from lightning_vescale.models import Llama, llama_config

    torch.manual_seed(0)
    model = Llama(llama_config("tiny"))
    setup(model)
    for block in model.layers:
        lv.fully_shard(block)
    lv.fully_shard(model)
    g = torch.Generator().manual_seed(7 + rank)
    tokens = torch.randint(0, model.config.vocab_size, (2, 33), generator=g)
    logits = model(tokens[:, :-1])
    on_disk = memory_stats.current[("activations", "disk")]
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    return [p.grad.to_local().clone() for p in model.parameters()], on_disk


def _offloaded_activations(rank: int, world: int, tmp: str) -> None:
    from lightning_vescale.memory import offload_activations

    memory_stats.reset()
    want, _ = _llama_grads(rank, lambda m: None)
    got, held = _llama_grads(rank, lambda m: offload_activations(m, ["layers.*"], "disk",
                                                                 disk_dir=os.path.join(tmp, f"a{rank}"),
                                                                 min_bytes=1024))
    assert held > 0, "activations must be on disk between forward and backward"
    assert memory_stats.current[("activations", "disk")] == 0, "backward read every offloaded activation back"
    assert all(torch.equal(a, b) for a, b in zip(want, got)), "offloaded activations change the gradients"


def _recomputed_activations(rank: int, world: int) -> None:
    from lightning_vescale.memory import checkpoint_blocks

    want, _ = _llama_grads(rank, lambda m: None)
    recomputed, _ = _llama_grads(rank, lambda m: checkpoint_blocks(m, ["layers.*"]))
    assert all(torch.equal(a, b) for a, b in zip(want, recomputed)), "activation checkpointing changes the gradients"


def _unmatched_pattern(rank: int, world: int) -> None:
    from lightning_vescale.memory import checkpoint_blocks
    from lightning_vescale.models import Llama, llama_config

    with pytest.raises(ValueError, match=r"pattern\(s\) \['decoder\.\*'\] match no module"):
        checkpoint_blocks(Llama(llama_config("tiny")), ["decoder.*"])


def train_step_clipped(model, opt, step: int, rank: int, world: int, micro: int = 2) -> None:
    """``micro`` micro-batches accumulated (the second adds to the offloaded gradient pieces), clipped, stepped;
    step 1 zeroes the gradients in place (the next backward adds to the zeroed pieces on disk)."""
    for m in range(micro):
        g = torch.Generator().manual_seed(1000 * step + m)
        x, y = torch.randn(4 * world, 7, generator=g), torch.randn(4 * world, 5, generator=g)
        F.mse_loss(model(x[rank::world]), y[rank::world]).backward()
    lv.clip_grad_norm_(model.parameters(), 0.05)
    opt.step()
    opt.zero_grad(set_to_none=step != 1)



def _released(model) -> list[bool]:
    return [p.to_local().untyped_storage().nbytes() == 0 for p in model.parameters() if p.to_local().numel()]


def _no_room_refused(rank: int, world: int, tmp: str) -> None:
    """A disk without room for what goes there is refused before anything moves."""
    from lightning_vescale.memory import apply_memory_policy

    full = sharded(MLP())
    with mock.patch("shutil.disk_usage", return_value=shutil._ntuple_diskusage(10**9, 10**9 - 100, 100)):
        with pytest.raises(DiskTierError, match=r"has 0.0 MiB free, but master weights \+ gradients need about"):
            apply_memory_policy(full, [], MemoryPolicy(params="disk", grads="disk", disk_dir=os.path.join(tmp, "f")))
    assert not any(_released(full)), "nothing was moved"


def _pieces_on_disk_run(rank: int, world: int, tmp: str, kind: str):
    """STEPS clipped, accumulated steps in memory and with weights, gradients and states on disk, side by side:
    bitwise after every step, the master weights on disk between uses."""
    from lightning_vescale.memory import apply_memory_policy, resident_pieces
    from lightning_vescale.memory.pieces import PieceOffload

    torch.manual_seed(0)
    ref = MLP()
    plain, swapped = sharded(ref), sharded(ref)
    plain_opt, opt = make_optimizer(kind, plain), make_optimizer(kind, swapped)
    policy = MemoryPolicy(params="disk", grads="disk", optimizer_states="disk", bucket_bytes=1024,
                          disk_dir=os.path.join(tmp, f"p{kind}"))
    handles = apply_memory_policy(swapped, [opt], policy, rank=rank)
    assert isinstance(handles.pieces, PieceOffload) and len(handles.states[0].buckets()) > 2
    assert all(_released(swapped)), "the master weights live on disk between uses"
    memory_stats.reset()
    for step in range(STEPS):
        train_step_clipped(plain, plain_opt, step, rank, world)
        train_step_clipped(swapped, opt, step, rank, world)
        assert all(_released(swapped)), (kind, step)
        with resident_pieces(swapped):
            for p, q in zip(plain.parameters(), swapped.parameters()):
                assert torch.equal(p.to_local(), q.to_local()), (kind, step)
    return plain, plain_opt, swapped, opt, handles


def _pieces_on_disk_train_bitwise(rank: int, world: int, tmp: str, kind: str) -> None:
    *_, handles = _pieces_on_disk_run(rank, world, tmp, kind)
    handles.close()


def _gradients_wait_on_disk(rank: int, world: int, tmp: str, kind: str) -> None:
    """After backward the gradient pieces wait on disk for the step; torch's own clip_grad_norm_ cannot read them."""
    _, _, swapped, opt, handles = _pieces_on_disk_run(rank, world, tmp, kind)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(4 * world, 7, generator=g)
    swapped(x[rank::world]).sum().backward()
    grads = [p.grad for p in swapped.parameters() if p.grad.to_local().numel()]
    assert grads and all(gr.to_local().untyped_storage().nbytes() == 0 for gr in grads), "gradients on disk"
    # torch's own clip_grad_norm_ cannot read pieces on disk: a clear error (it read freed memory before).
    with pytest.raises(RuntimeError, match=r"not in memory .* clip with lightning_vescale.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(swapped.parameters(), 1.0)
    assert memory_stats.current[("grads", "disk")] > 0 and memory_stats.current[("params", "disk")] > 0
    assert memory_stats.peak[("params", "device")] > 0, "the ledger follows the pieces' trips to memory"
    opt.zero_grad()
    swapped(x[rank::world]).sum().backward()  # zero_grad dropped the offloaded gradients: a fresh one
    opt.zero_grad()
    assert memory_stats.current[("grads", "disk")] >= 0
    handles.close()


def _pieces_on_disk_save_and_resume(rank: int, world: int, tmp: str, kind: str) -> None:
    """Save while everything is on disk; resume into a fresh offloaded model and optimizer: the same run."""
    from lightning_vescale.memory import apply_memory_policy, resident_pieces

    plain, plain_opt, swapped, opt, handles = _pieces_on_disk_run(rank, world, tmp, kind)
    path = os.path.join(tmp, f"ckp_{kind}")
    ckpt.save(path, swapped, opt)
    assert all(_released(swapped)), "put back on disk after the save"
    torch.manual_seed(5)
    resumed = sharded(MLP())
    resumed_opt = make_optimizer(kind, resumed)
    apply_memory_policy(resumed, [resumed_opt], MemoryPolicy(
        params="disk", grads="disk", optimizer_states="disk", bucket_bytes=1024,
        disk_dir=os.path.join(tmp, f"r{kind}")), rank=rank)
    ckpt.load(path, resumed, resumed_opt)
    assert all(_released(resumed)), "loaded weights written back to disk"
    for step in range(STEPS, STEPS + 2):
        train_step_clipped(plain, plain_opt, step, rank, world)
        train_step_clipped(resumed, resumed_opt, step, rank, world)
    with resident_pieces(resumed):
        for p, q in zip(plain.parameters(), resumed.parameters()):
            assert torch.equal(p.to_local(), q.to_local()), f"{kind}: resumed run differs"
    full = ckpt.export_full_state_dict(resumed, rank0_only=False)
    assert torch.equal(full["out.weight"], plain.out.weight.full_tensor())
    handles.close()
    assert not any(_released(swapped)), "close() brings the weights back"


def _twins(plain_plan: dict, other_plan: dict, mesh) -> tuple:
    """The same seeded MLP sharded twice (the reference run and the offloaded one), each with its AdamW."""
    torch.manual_seed(0)
    ref = MLP()
    plain = lv.parallelize(copy.deepcopy(ref), plain_plan, mesh)
    other = lv.parallelize(copy.deepcopy(ref), other_plan, mesh)
    return (plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1),
            other, torch.optim.AdamW(other.parameters(), lr=1e-2, weight_decay=0.1))



_BLOCKS = {"rules": [{"match": "blocks.*", "group": True}]}
# (plan, the policy's class placement, the groups whose pieces move, the modules whose states move)
TIER_CASES = {
    # blocks.0: weights, gradients and states on disk; blocks.1: its states only; the policy moves nothing.
    "plan_places_blocks": ({"rules": _BLOCKS["rules"] + [{"match": "blocks.0", "tier": "disk"},
                                                         {"match": "blocks.1", "tier": {"optimizer_states": "disk"}}]},
                           {}, {"blocks.0"}, {"blocks.0", "blocks.1"}),
    # The policy puts everything on disk; the plan keeps blocks.2 on the device: the plan wins there.
    "plan_overrides_policy": ({"rules": _BLOCKS["rules"] + [{"match": "blocks.2", "tier": "device"}]},
                              {"params": "disk", "grads": "disk", "optimizer_states": "disk"},
                              {"blocks.0", "blocks.1", ""}, {"blocks.0", "blocks.1", "inp", "out"}),
}


def _plan_tiers(rank: int, world: int, tmp: str, case: str) -> None:
    """A plan's per-parameter tiers on 2 ranks, fp32 AdamW: bitwise the run without offload, and exactly the
    planned buffers and states move; the policy's class placement applies to the rest."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_vescale.memory import apply_memory_policy
    from lightning_vescale.memory.pieces import resident_pieces

    mesh = init_device_mesh("cpu", (world,))
    plan, classes, moved_pieces, moved_states = TIER_CASES[case]
    plain, plain_opt, tiered, opt = _twins(_BLOCKS, plan, mesh)
    handles = apply_memory_policy(tiered, [opt], MemoryPolicy(
        disk_dir=os.path.join(tmp, case), bucket_bytes=1024, **classes), rank=rank)
    held = {n: p for n, p in tiered.named_parameters() if p.to_local().numel()}  # this rank's pieces

    def module_of(name: str) -> str:  # "blocks.0", or "inp" / "out" (the root group: "")
        return name.rsplit(".", 2)[0] if name.startswith("blocks.") else name.split(".")[0]

    def released(t: torch.Tensor) -> bool:
        return t.to_local().untyped_storage().nbytes() == 0

    for step in range(2):  # step 1 zeroes the gradients in place
        train_step_clipped(plain, plain_opt, step, rank, world)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            train_step_clipped(tiered, opt, step, rank, world)
        assert not [w for w in said if "nothing applied it" in str(w.message)], "applied tiers warned as unapplied"
        pieces = {n for n, p in held.items() if released(p)}
        assert pieces == {n for n in held if (module_of(n) if n.startswith("blocks.") else "") in moved_pieces}, \
            (case, step, pieces)
        for offload in handles.states:
            offload.flush()  # the last buckets' write-back, finishing in the background
        states = {n for n, p in held.items() if released(opt.state[p]["exp_avg"])}
        assert states == {n for n in held if module_of(n) in moved_states}, (case, step, states)
        with resident_pieces(tiered), resident_states(opt):
            for (n, p), q in zip(plain.named_parameters(), tiered.parameters()):
                assert torch.equal(p.to_local(), q.to_local()), (case, step, n)
            assert all(torch.equal(a, b) for a, b in zip(states_of(plain_opt), states_of(opt))), (case, step)
    handles.close()


def _disk_tier_without_directory_refused(rank: int, world: int) -> None:
    """The disk tier's directory is the policy's: none given, none guessed."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_vescale.memory import apply_memory_policy

    mesh = init_device_mesh("cpu", (world,))
    _, _, tiered, opt = _twins(_BLOCKS, TIER_CASES["plan_places_blocks"][0], mesh)
    with pytest.raises(ValueError, match=r"puts params, grads, optimizer_states of \w*MLP on disk, but no "
                                         r"MemoryPolicy names a directory"):
        apply_memory_policy(tiered, [opt], None)


def _unapplied_tiers_warn(rank: int, world: int) -> None:
    """Plain torch that forgets apply_memory_policy: the first forward says the plan's tiers were not applied."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    forgotten = lv.parallelize(MLP(), TIER_CASES["plan_places_blocks"][0], mesh)
    with pytest.warns(UserWarning, match=r"on host or disk, but nothing applied it.*apply_memory_policy"):
        with torch.no_grad():
            forgotten(torch.randn(2, 7))


_GATHER_PLAN = {"rules": [{"match": "blocks.*", "group": True, "reshard_after_forward": True}]}


def _gathered_run(rank: int, world: int, tmp: str):
    """Gathered parameters on disk between forward and backward (fp32 AdamW, accumulation, clipping): bitwise the
    run that gathers again, and exactly the backward AllGathers' bytes replaced by reads."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_vescale.memory import apply_memory_policy
    from lightning_vescale.memory.pieces import resident_pieces

    mesh = init_device_mesh("cpu", (world,))
    plain, plain_opt, saved, opt = _twins(_GATHER_PLAN, _GATHER_PLAN, mesh)
    handles = apply_memory_policy(saved, [opt], MemoryPolicy(gathered_params="disk", disk_dir=os.path.join(tmp, "g")),
                                  rank=rank)
    offload = handles.gathered
    for step in range(3):
        lv.comm_stats.step()
        train_step_clipped(plain, plain_opt, step, rank, world)
        sent_plain = lv.comm_stats.step()["all_gather"]
        read_before = offload.bytes_read
        train_step_clipped(saved, opt, step, rank, world)
        sent_saved = lv.comm_stats.step()["all_gather"]
        read = offload.bytes_read - read_before
        assert read > 0 and sent_plain - sent_saved == read * (world - 1) // world, (step, sent_plain, sent_saved, read)
        with resident_pieces(saved):
            for (n, p), q in zip(plain.named_parameters(), saved.parameters()):
                assert torch.equal(p.to_local(), q.to_local()), (step, n)
    return saved, handles


def _gathered_replace_backward_allgather(rank: int, world: int, tmp: str) -> None:
    _, handles = _gathered_run(rank, world, tmp)
    handles.close()


def _gathered_storage_after_forward(rank: int, world: int, tmp: str) -> None:
    """After a forward that needs a backward, the blocks' gathered bytes are on disk, not in memory; a forward
    without backward (evaluation) replaces nothing; close() detaches the offload."""
    from lightning_vescale.engine.fully_shard import sharded_groups

    saved, handles = _gathered_run(rank, world, tmp)
    offload = handles.gathered
    blocks = [b for blk in saved.blocks for g in sharded_groups(blk) for b in g.buffers.values()]
    out = saved(torch.randn(3, 7))
    for buf in blocks:
        offload.has(buf) and offload._saved[id(buf)].future.result()
    assert all(offload.has(b) and b.unsharded.untyped_storage().nbytes() == 0 for b in blocks)
    assert memory_stats.snapshot()["gathered_params/disk"][0] == sum(b.unsharded.numel() * 4 for b in blocks)
    # A forward that ends without backward (evaluation) replaces nothing: its unshards gather, nothing is written.
    with torch.no_grad():
        saved(torch.randn(3, 7))
    assert not any(offload.has(b) for b in blocks)
    assert memory_stats.snapshot()["gathered_params/disk"][0] == 0
    del out
    handles.close()
    assert all(b.gathered_offload is None for b in blocks)


class TestMemoryOffloadOn2Ranks(DistributedTest):
    world_size = 2

    def test_offloaded_activations_give_the_same_gradients(self, tmp_path) -> None:
        self.run_ranks(_offloaded_activations, str(tmp_path))

    def test_recomputed_activations_give_the_same_gradients(self) -> None:
        self.run_ranks(_recomputed_activations)

    def test_checkpoint_patterns_that_match_nothing_are_refused(self) -> None:
        self.run_ranks(_unmatched_pattern)

    def test_a_disk_without_room_is_refused_before_anything_moves(self, tmp_path) -> None:
        self.run_ranks(_no_room_refused, str(tmp_path))

    @pytest.mark.parametrize("kind", KINDS)
    def test_weights_gradients_and_states_on_disk_train_bitwise(self, tmp_path, kind: str) -> None:
        """Master weights, gradient pieces and optimizer states on disk (AdamW; Muon + AdamW), with gradient
        accumulation and clipping: bitwise the run without offload."""
        self.run_ranks(_pieces_on_disk_train_bitwise, str(tmp_path), kind)

    @pytest.mark.parametrize("kind", KINDS)
    def test_gradients_wait_on_disk_and_torch_clipping_refuses_them(self, tmp_path, kind: str) -> None:
        self.run_ranks(_gradients_wait_on_disk, str(tmp_path), kind)

    @pytest.mark.parametrize("kind", KINDS)
    def test_save_and_resume_from_disk_continue_bitwise(self, tmp_path, kind: str) -> None:
        self.run_ranks(_pieces_on_disk_save_and_resume, str(tmp_path), kind)

    @pytest.mark.parametrize("case", list(TIER_CASES))
    def test_plan_tiers_train_bitwise_and_move_only_what_the_plan_places(self, tmp_path, case: str) -> None:
        self.run_ranks(_plan_tiers, str(tmp_path), case)

    def test_a_disk_tier_without_a_directory_is_refused(self) -> None:
        self.run_ranks(_disk_tier_without_directory_refused)

    def test_tiers_nothing_applied_warn_at_the_first_forward(self) -> None:
        self.run_ranks(_unapplied_tiers_warn)

    def test_gathered_params_on_disk_replace_the_backward_allgather_bitwise(self, tmp_path) -> None:
        self.run_ranks(_gathered_replace_backward_allgather, str(tmp_path))

    def test_gathered_params_leave_memory_after_forward_and_not_in_evaluation(self, tmp_path) -> None:
        self.run_ranks(_gathered_storage_after_forward, str(tmp_path))

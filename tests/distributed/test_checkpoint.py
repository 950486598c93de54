"""Sharded checkpoints (DESIGN invariant 6): resume, reshard N -> M, atomic save, full export.

One test per behaviour; each world size starts its ranks once for the module (:class:`tests.dist_pool.
ModuleRanksTest`), shared by its class of tests and by the fixture that saves what the next world size loads:

* 4 ranks: a model trained side by side with a single-process reference is saved (``ck4``, the ``saved``
  fixture), exported in full (safetensors and torch: the same names and order as the unsharded model, equal to the
  reference to 1e-5, readable without the library) and re-imported bitwise; a save + reload into a fresh model and
  optimizer continues bitwise like the run that never stopped (RNG streams included; a fresh optimizer visibly
  differs); an HSDP (2x2) model is saved with each element written once, and ``ck4`` loads into it bitwise; an MLP
  with whole-tensor granularity (empty pieces) is saved.
* 2 ranks: ``ck4``, the HSDP and the MLP checkpoints reload with bitwise the same parameters and optimizer states as
  the full tensors (the MLP on element granularity), and ``ck4`` keeps training like the reference (1e-5); ``ck2`` is
  saved (the ``ck2`` fixture); mismatched models and optimizers are refused before anything changes, and so is a
  checkpoint between forward and backward. Rank 1 dies while a new ``ck2`` is written over a copy of it: the save
  fails, and the previous ``ck2`` is intact.
* 3 ranks: ``ck2`` loads and equals what was saved (2 -> 3); ``ck3`` is saved.
* 1 rank, in the test process (no spawn): ``ck3`` loads (3 -> 1) and keeps training like the reference.
"""

from __future__ import annotations

import copy
import glob
import math
import os
import random
import shutil

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import init_device_mesh

import lightning_vescale as lv
from lightning_vescale import checkpoint as ckpt
from tests.asserts import assert_equal_tree
from tests.dist_pool import DistributedPools, ModuleRanksTest
from tests.toy_models import MLP, TinyTransformer

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks


def shard(model: nn.Module, mesh=None, granularity=None) -> nn.Module:
    blocks = model.layers if hasattr(model, "layers") else model.blocks
    for block in blocks:
        lv.fully_shard(block, mesh=mesh, granularity=granularity)
    return lv.fully_shard(model, mesh=mesh, granularity=granularity)


def make_mlp(seed: int, granularity=None):
    """Whole-tensor granularity on many ranks leaves some ranks with empty pieces."""
    torch.manual_seed(seed)
    model = shard(MLP(), granularity=granularity)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def make(seed: int, mesh=None, **model_kwargs):
    torch.manual_seed(seed)
    model = shard(TinyTransformer(**model_kwargs), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def global_batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 53, (GLOBAL_BATCH, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train_step(model, opt, sched, x, y) -> torch.Tensor:
    loss = lm_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    return loss.detach()


def global_step(model, opt, sched, step: int, num_slices: int, slice_index: int) -> None:
    """One step on this rank's slice of the global batch (equal slices: the mean loss is the global one)."""
    x, y = global_batch(step)
    per = GLOBAL_BATCH // num_slices
    mine = slice(slice_index * per, (slice_index + 1) * per)
    train_step(model, opt, sched, x[mine], y[mine])


def pieces(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_pieces(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


def max_diff(got: dict, want: dict) -> float:
    assert list(got) == list(want)
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want if want[k].numel())


def each_element_once(directory: str) -> None:
    """Every tensor's saved chunks tile it exactly once (no replica wrote a duplicate)."""
    md = FileSystemReader(directory).read_metadata()
    for key, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            written = sum(math.prod(c.sizes) for c in item.chunks)
            assert written == math.prod(item.size), (key, written, tuple(item.size))

# --------------------------------------------------------------------------------------------------------
# The module's ranks: one pool per world size, shared by that world size's tests and by the fixture that saves
# the checkpoint the next world size loads (4 -> 2 -> 3 -> 1), so each world size starts its ranks once.






# --------------------------------------------------------------------------------------------------------
# 4 ranks: save, full export, bitwise resume, HSDP


def _trained4(rank: int, world: int):
    """Train side by side with a single-process reference, 3 steps of the global batch."""
    torch.manual_seed(0)
    ref = TinyTransformer()
    model = shard(copy.deepcopy(ref))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    for step in range(3):
        global_step(model, opt, sched, step, world, rank)
        global_step(ref, ref_opt, ref_sched, step, 1, 0)
    return model, opt, sched, ref


def _save4(rank: int, world: int, tmp: str) -> None:
    """What the other world sizes load: ``ck4`` and its full exports, one step more, HSDP and the MLP."""
    # (1) The trained model: saved, exported in full (files and the reference the loads compare with).
    model, opt, sched, ref = _trained4(rank, world)
    ckpt.save(os.path.join(tmp, "ck4"), model, opt, schedulers=[sched], extra={"step": 3, "tag": "ck4"})
    full = ckpt.export_full_state_dict(model)
    full_optim = ckpt.export_full_optimizer_state_dict(model, opt)
    if rank == 0:
        torch.save({"params": full, "optim": full_optim, "sched": sched.state_dict(), "ref": ref.state_dict()},
                   os.path.join(tmp, "ref4.pt"))
    ckpt.save_full(os.path.join(tmp, "full.safetensors"), model)
    ckpt.save_full(os.path.join(tmp, "full.pt"), model, format="torch")
    # One more step from the global batch: what a reloaded model must reproduce on any world size.
    global_step(model, opt, sched, 3, world, rank)
    nxt = ckpt.export_full_state_dict(model)
    if rank == 0:
        torch.save(nxt, os.path.join(tmp, "ref4_next.pt"))

    # (3) HSDP: replicas hold the same pieces.
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    hsdp, h_opt, h_sched = make(seed=3, mesh=mesh)
    for step in range(2):
        global_step(hsdp, h_opt, h_sched, step, world, rank)
    ckpt.save(os.path.join(tmp, "hsdp"), hsdp, h_opt, schedulers=h_sched)
    h_full = ckpt.export_full_state_dict(hsdp)
    h_optim = ckpt.export_full_optimizer_state_dict(hsdp, h_opt)
    if rank == 0:
        torch.save({"params": h_full, "optim": h_optim}, os.path.join(tmp, "ref_hsdp.pt"))

    # (4) Whole matrices on one rank (empty pieces elsewhere), reloaded later on another layout.
    mlp, mlp_opt = make_mlp(seed=4, granularity="tensor")
    x, y = torch.randn(GLOBAL_BATCH, 7), torch.randn(GLOBAL_BATCH, 5)
    F.mse_loss(mlp(x[rank::world]), y[rank::world]).backward()
    mlp_opt.step()
    ckpt.save(os.path.join(tmp, "mlp"), mlp, mlp_opt)
    m_full = ckpt.export_full_state_dict(mlp)
    m_optim = ckpt.export_full_optimizer_state_dict(mlp, mlp_opt)
    if rank == 0:
        torch.save({"params": m_full, "optim": m_optim}, os.path.join(tmp, "ref_mlp.pt"))
    assert not glob.glob(os.path.join(tmp, "*.tmp-*")) and not glob.glob(os.path.join(tmp, "*.old"))


@pytest.fixture(scope="module")
def saved(ranks: DistributedPools, tmp_path_factory) -> str:
    tmp = str(tmp_path_factory.mktemp("ckpt"))
    ranks(4).run(_save4, tmp)
    return tmp


def _full_export_is_the_unsharded_state_dict(rank: int, world: int) -> None:
    model, opt, _, ref = _trained4(rank, world)
    full = ckpt.export_full_state_dict(model)
    full_optim = ckpt.export_full_optimizer_state_dict(model, opt)
    everywhere = ckpt.export_full_state_dict(model, rank0_only=False)
    assert list(everywhere) == list(ref.state_dict())
    assert all(torch.equal(everywhere[k], v) for k, v in full.items())
    if rank == 0:
        # Same names and order as the unsharded model (tied head.weight included), equal to the reference.
        assert list(full) == list(ref.state_dict()), (list(full), list(ref.state_dict()))
        assert max_diff(full, ref.state_dict()) < 1e-5
        assert full["head.weight"] is full["tok.weight"]
        assert set(full_optim["state"]) == {n for n, p in ref.named_parameters() if p.requires_grad}
        assert full_optim["state"]["tok.weight"]["exp_avg"].shape == (53, 24)
    else:
        assert full == {} and full_optim == {}


def _exported_file_imports_bitwise(rank: int, world: int, tmp: str) -> None:
    """Import: a fresh sharded model starts from the exported file, bitwise equal to the exporting model."""
    from safetensors.torch import load_file

    model, _, _, _ = _trained4(rank, world)
    ckpt.save_full(os.path.join(tmp, "full.safetensors"), model)
    fresh, _, _ = make(seed=5)
    ckpt.load_full_state_dict(fresh, load_file(os.path.join(tmp, "full.safetensors")))
    assert_same_pieces(fresh, pieces(model))


def _resume_is_bitwise(rank: int, world: int, tmp: str) -> None:
    """(2) Resume is bitwise: per-rank RNG streams draw the data, so they must be restored too."""
    model, opt, sched = make(seed=1)
    torch.manual_seed(100 + rank)
    random.seed(rank)
    np.random.seed(rank)

    def rng_batch():
        tokens = torch.randint(0, 53, (3, 9))
        return tokens[:, :-1], tokens[:, 1:]

    for _ in range(3):
        train_step(model, opt, sched, *rng_batch())
    ckpt.save(os.path.join(tmp, "resume"), model, opt, schedulers=sched, extra={"step": 3})
    draws = (torch.rand(3), random.random(), np.random.rand())
    losses = [train_step(model, opt, sched, *rng_batch()) for _ in range(3)]

    resumed, r_opt, r_sched = make(seed=2)
    assert not r_opt.state
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    assert ckpt.load(os.path.join(tmp, "resume"), resumed, r_opt, schedulers=r_sched) == {"step": 3}
    assert torch.equal(torch.rand(3), draws[0]) and random.random() == draws[1] and np.random.rand() == draws[2]
    r_losses = [train_step(resumed, r_opt, r_sched, *rng_batch()) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(losses, r_losses)), (losses, r_losses)
    assert_same_pieces(resumed, pieces(model))
    for (_, p), (_, q) in zip(model.named_parameters(), resumed.named_parameters()):
        assert_equal_tree(r_opt.state[q], opt.state[p])
    assert r_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] and r_sched.state_dict() == sched.state_dict()
    # Negative control: the same continuation (same data: the RNG is restored) with a fresh optimizer and
    # scheduler is visibly different, so the comparison above can see a state that was not restored.
    control, c_opt, c_sched = make(seed=2)
    ckpt.load(os.path.join(tmp, "resume"), control)
    for _ in range(3):
        train_step(control, c_opt, c_sched, *rng_batch())
    differs = torch.tensor([float(any(not torch.equal(p.detach(), q.detach()) for p, q in
                                      zip(control.parameters(), model.parameters())))])
    dist.all_reduce(differs)
    assert differs.item() > 0


def _hsdp_writes_once_and_loads_1d(rank: int, world: int, tmp: str) -> None:
    """(3) Each element of the HSDP checkpoint is written once, and a 1-D checkpoint loads into HSDP: every
    replica gets the same, complete pieces."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    h_load, hl_opt, hl_sched = make(seed=6, mesh=mesh)
    ckpt.load(os.path.join(tmp, "ck4"), h_load, hl_opt, schedulers=hl_sched)
    ref4 = torch.load(os.path.join(tmp, "ref4.pt"))
    assert_equal_tree(ckpt.export_full_state_dict(h_load, rank0_only=False), ref4["params"])
    assert_equal_tree(ckpt.export_full_optimizer_state_dict(h_load, hl_opt, rank0_only=False), ref4["optim"])
    if rank == 0:
        each_element_once(os.path.join(tmp, "hsdp"))
        each_element_once(os.path.join(tmp, "ck4"))


def _whole_tensors_leave_empty_pieces(rank: int, world: int) -> None:
    """(4) The MLP the fixture saves with whole-tensor granularity leaves some ranks with empty pieces."""
    mlp, _ = make_mlp(seed=4, granularity="tensor")
    empty = torch.tensor([float(sum(p.to_local().numel() == 0 for p in mlp.parameters()))])
    dist.all_reduce(empty)
    assert empty.item() > 0


class TestCheckpointOn4Ranks(ModuleRanksTest):
    world_size = 4

    def test_full_export_is_the_unsharded_state_dict(self) -> None:
        self.run_ranks(_full_export_is_the_unsharded_state_dict)

    def test_exported_file_imports_bitwise(self, tmp_path) -> None:
        self.run_ranks(_exported_file_imports_bitwise, str(tmp_path))

    def test_resume_is_bitwise_with_rng_streams(self, tmp_path) -> None:
        self.run_ranks(_resume_is_bitwise, str(tmp_path))

    def test_hsdp_writes_each_element_once_and_loads_a_1d_checkpoint(self, saved: str) -> None:
        self.run_ranks(_hsdp_writes_once_and_loads_1d, saved)

    def test_whole_tensor_granularity_leaves_empty_pieces(self) -> None:
        self.run_ranks(_whole_tensors_leave_empty_pieces)


def test_full_export_loads_without_the_library(saved: str) -> None:
    """The exported files are ordinary state dicts: plain safetensors / torch.load + load_state_dict."""
    from safetensors.torch import load_file

    ref = torch.load(os.path.join(saved, "ref4.pt"))
    st = load_file(os.path.join(saved, "full.safetensors"))
    pt = torch.load(os.path.join(saved, "full.pt"))
    assert list(pt) == list(ref["ref"]) and set(st) == set(ref["ref"])
    for sd in (st, pt):
        model = TinyTransformer()
        model.load_state_dict(sd, strict=True)
        assert model.head.weight is model.tok.weight
        assert max_diff(model.state_dict(), ref["ref"]) < 1e-5  # the single-process reference
        assert max_diff(model.state_dict(), ref["params"]) == 0.0  # bitwise the sharded model's values


# --------------------------------------------------------------------------------------------------------
# 4 -> 2 -> (killed) -> 3 -> 1


def _check_against_reference(model, opt, sched, tmp: str, ref_name: str = "ref4.pt") -> None:
    full = ckpt.export_full_state_dict(model)
    full_optim = ckpt.export_full_optimizer_state_dict(model, opt)
    if dist.get_rank() == 0:
        ref = torch.load(os.path.join(tmp, ref_name))
        assert_equal_tree(full, ref["params"])
        assert_equal_tree(full_optim, ref["optim"])
        if "sched" in ref:
            assert sched.state_dict() == ref["sched"]


def _continue_like_reference(model, opt, sched, tmp: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    global_step(model, opt, sched, 3, world, rank)
    nxt = ckpt.export_full_state_dict(model)
    if rank == 0:
        diff = max_diff(nxt, torch.load(os.path.join(tmp, "ref4_next.pt")))
        assert diff < 1e-5, diff


def _save2(rank: int, world: int, tmp: str) -> None:
    """``ck4`` loaded on 2 ranks and saved again: ``ck2``."""
    model, opt, sched = make(seed=11)
    assert ckpt.load(os.path.join(tmp, "ck4"), model, opt, schedulers=sched) == {"step": 3, "tag": "ck4"}
    ckpt.save(os.path.join(tmp, "ck2"), model, opt, schedulers=sched, extra={"step": 3})


@pytest.fixture(scope="module")
def ck2(ranks: DistributedPools, saved: str) -> str:
    ranks(2).run(_save2, saved)
    return saved


def _load4_on2(rank: int, world: int, tmp: str) -> None:
    model, opt, sched = make(seed=11)
    assert ckpt.load(os.path.join(tmp, "ck4"), model, opt, schedulers=sched) == {"step": 3, "tag": "ck4"}
    _check_against_reference(model, opt, sched, tmp)
    _continue_like_reference(model, opt, sched, tmp)


def _hsdp_loads_on_1d(rank: int, world: int, tmp: str) -> None:
    """An HSDP checkpoint loads on a plain 1-D mesh of another size."""
    h_model, h_opt, h_sched = make(seed=12)
    ckpt.load(os.path.join(tmp, "hsdp"), h_model, h_opt, schedulers=h_sched)
    _check_against_reference(h_model, h_opt, h_sched, tmp, "ref_hsdp.pt")


def _whole_tensors_load_on_elements(rank: int, world: int, tmp: str) -> None:
    """Whole-tensor pieces with empty ones -> element granularity on another world size."""
    mlp, mlp_opt = make_mlp(seed=15)
    ckpt.load(os.path.join(tmp, "mlp"), mlp, mlp_opt)
    _check_against_reference(mlp, mlp_opt, None, tmp, "ref_mlp.pt")


def _refused_between_forward_and_backward(rank: int, world: int) -> None:
    """Between forward and backward the root's parameters are gathered: checkpointing refuses."""
    busy, _, _ = make(seed=16)
    out = busy(global_batch(0)[0][:2])
    with pytest.raises(RuntimeError, match="between steps"):
        ckpt.get_model_state_dict(busy)
    out.float().sum().backward()
    ckpt.get_model_state_dict(busy)


def _another_model_refused(rank: int, world: int, tmp: str) -> None:
    """Another model: every difference is named, and nothing changes."""
    other, o_opt, o_sched = make(seed=13, vocab=60, n_layers=1)
    before = pieces(other)
    with pytest.raises(ValueError, match="does not match the model") as err:
        ckpt.load(os.path.join(tmp, "ck4"), other, o_opt, schedulers=o_sched)
    message = str(err.value)
    assert "ck4" in message and "layers.1.attn.qkv.weight (72, 24)" in message, message
    assert "tok.weight: checkpoint (53, 24), model (60, 24)" in message, message
    assert_same_pieces(other, before)
    assert not o_opt.state


def _another_optimizer_refused(rank: int, world: int, tmp: str) -> None:
    """Another optimizer: refused before its states are created or the model is touched."""
    model, _, _ = make(seed=14)
    before = pieces(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sgd_sched = torch.optim.lr_scheduler.StepLR(sgd, step_size=2)
    with pytest.raises(ValueError, match="not of a torch.optim.sgd.SGD"):
        ckpt.load(os.path.join(tmp, "ck4"), model, sgd, schedulers=sgd_sched)
    assert not sgd.state
    assert_same_pieces(model, before)


def _die_while_saving(rank: int, world: int, tmp: str) -> None:
    """Rank 1 dies after writing its data for a new ck2, before the checkpoint's .metadata exists."""
    model, opt, sched = make(seed=21)
    global_step(model, opt, sched, 0, world, rank)
    open(os.path.join(tmp, f"checks_passed_rank{rank}"), "w").close()  # both ranks reach the save
    dist.barrier()
    write_data = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        fut = write_data(self, plan, planner)
        fut.wait()
        if rank == 1:
            os._exit(1)
        return fut

    FileSystemWriter.write_data = write_then_die
    try:
        ckpt.save(os.path.join(tmp, "ck2"), model, opt, schedulers=sched, extra={"step": 99})
    finally:
        FileSystemWriter.write_data = write_data
    open(os.path.join(tmp, f"save_returned_rank{rank}"), "w").close()  # must never happen


def _previous_ck2_loads(rank: int, world: int, tmp: str) -> None:
    model, opt, sched = make(seed=22)
    assert ckpt.load(os.path.join(tmp, "ck2"), model, opt, schedulers=sched) == {"step": 3}
    _check_against_reference(model, opt, sched, tmp)


class TestCheckpointOn2Ranks(ModuleRanksTest):
    world_size = 2

    def test_4_rank_checkpoint_loads_and_continues_like_the_reference(self, saved: str) -> None:
        self.run_ranks(_load4_on2, saved)

    def test_hsdp_checkpoint_loads_on_a_1d_mesh(self, saved: str) -> None:
        self.run_ranks(_hsdp_loads_on_1d, saved)

    def test_whole_tensor_pieces_load_on_element_granularity(self, saved: str) -> None:
        self.run_ranks(_whole_tensors_load_on_elements, saved)

    def test_checkpointing_between_forward_and_backward_is_refused(self) -> None:
        self.run_ranks(_refused_between_forward_and_backward)

    def test_another_model_is_refused_naming_every_difference(self, saved: str) -> None:
        self.run_ranks(_another_model_refused, saved)

    def test_another_optimizer_is_refused_before_anything_changes(self, saved: str) -> None:
        self.run_ranks(_another_optimizer_refused, saved)

    def test_a_rank_dying_mid_save_leaves_the_previous_checkpoint(self, ck2: str, tmp_path) -> None:
        work = str(tmp_path)  # a copy of ck2 (and the reference), so the other tests' ck2 stays out of it
        shutil.copytree(os.path.join(ck2, "ck2"), os.path.join(work, "ck2"))
        shutil.copy(os.path.join(ck2, "ref4.pt"), work)
        with pytest.raises(AssertionError, match="rank 0 of 2 failed|did not finish") as err:
            self.run_ranks(_die_while_saving, work, timeout=120)
        # It failed in the save that rank 1 left (rank 0 raises there, or gloo aborts it without a traceback),
        # after both ranks had reached it, and the save returned nowhere.
        if "rank 0 of 2 failed" in str(err.value):
            assert "in save\n" in str(err.value) and "saving checkpoint" in str(err.value), err.value
        assert all(os.path.exists(os.path.join(work, f"checks_passed_rank{r}")) for r in range(2))
        assert not glob.glob(os.path.join(work, "save_returned_rank*"))
        assert os.path.isfile(os.path.join(work, "ck2", ".metadata"))
        # Rank 0 removed the directory the dead rank left unfinished (an incomplete one is refused by load:
        # tests/unit/test_checkpoint_errors.py).
        assert not glob.glob(os.path.join(work, "ck2.tmp-*"))
        # The previous ck2 still loads (on the restarted ranks), equal to what was saved.
        self.run_ranks(_previous_ck2_loads, work)


def _load2_on3(rank: int, world: int, tmp: str) -> None:
    model, opt, sched = make(seed=31)
    assert ckpt.load(os.path.join(tmp, "ck2"), model, opt, schedulers=sched) == {"step": 3}
    _check_against_reference(model, opt, sched, tmp)


def _save3(rank: int, world: int, tmp: str) -> None:
    """``ck2`` loaded on 3 ranks and saved again: ``ck3``."""
    model, opt, sched = make(seed=31)
    assert ckpt.load(os.path.join(tmp, "ck2"), model, opt, schedulers=sched) == {"step": 3}
    ckpt.save(os.path.join(tmp, "ck3"), model, opt, schedulers=sched, extra={"step": 3})


@pytest.fixture(scope="module")
def ck3(ranks: DistributedPools, ck2: str) -> str:
    ranks(3).run(_save3, ck2)
    return ck2


class TestCheckpointOn3Ranks(ModuleRanksTest):
    world_size = 3

    def test_2_rank_checkpoint_loads_on_3_ranks(self, ck2: str) -> None:
        self.run_ranks(_load2_on3, ck2)

    def test_2_rank_checkpoint_saves_again_on_3_ranks(self, ck3: str) -> None:
        assert os.path.isfile(os.path.join(ck3, "ck3", ".metadata"))


def _load1(rank: int, world: int, tmp: str) -> None:
    model, opt, sched = make(seed=41)
    ckpt.load(os.path.join(tmp, "ck3"), model, opt, schedulers=sched)
    _check_against_reference(model, opt, sched, tmp)
    _continue_like_reference(model, opt, sched, tmp)


def test_3_rank_checkpoint_loads_on_1_rank_and_continues(ck3: str, tmp_path) -> None:
    """On one gloo rank in this process (no spawn: a spawn costs seconds on a busy machine)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg_single'}", rank=0, world_size=1)
    try:
        _load1(0, 1, ck3)
    finally:
        dist.destroy_process_group()

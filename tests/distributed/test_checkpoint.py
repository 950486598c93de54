"""Sharded checkpoints (DESIGN invariant 6): resume, reshard N -> M, atomic save, full export.

Process groups are expensive here, so a few ``run_distributed`` calls check many things each:

* 4 ranks (fixture): a model trained side by side with a single-process reference is saved (``ck4``),
  exported in full (safetensors and torch) and re-imported; a save + reload into a fresh model and
  optimizer continues bitwise like the run that never stopped (RNG streams included); an HSDP (2x2)
  model is saved with each element written once, and ``ck4`` loads into it; an MLP with whole-tensor granularity (empty pieces)
  is saved.
* 2 ranks: ``ck4``, the HSDP and the MLP checkpoints reload with the same parameters and optimizer
  states as the full tensors (the MLP on element granularity), and ``ck4`` keeps training like the
  reference; ``ck2`` is saved; mismatched models and optimizers
  are refused before anything changes. Then rank 1 dies while a new ``ck2`` is being written, so this
  run is expected to fail (after it has left a marker that its checks passed).
* 3 ranks: the old ``ck2`` still loads and equals what was saved (2 -> 3); ``ck3`` is saved.
* 1 rank, in the test process (no spawn): ``ck3`` loads (3 -> 1) and keeps training like the reference.
"""

from __future__ import annotations

import copy
import glob
import math
import os
import random

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
from tests.dist_utils import run_distributed
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
# 4 ranks: save, full export, bitwise resume, HSDP


def _save4(rank: int, world: int, tmp: str) -> None:
    # (1) Train side by side with a single-process reference; save; export in full.
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
    ckpt.save(os.path.join(tmp, "ck4"), model, opt, schedulers=[sched], extra={"step": 3, "tag": "ck4"})
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
        torch.save({"params": full, "optim": full_optim, "sched": sched.state_dict(), "ref": ref.state_dict()},
                   os.path.join(tmp, "ref4.pt"))
    else:
        assert full == {} and full_optim == {}
    ckpt.save_full(os.path.join(tmp, "full.safetensors"), model)
    ckpt.save_full(os.path.join(tmp, "full.pt"), model, format="torch")
    # Import: a fresh sharded model starts from the exported file, bitwise equal to the exporting model.
    from safetensors.torch import load_file

    fresh, _, _ = make(seed=5)
    ckpt.load_full_state_dict(fresh, load_file(os.path.join(tmp, "full.safetensors")))
    assert_same_pieces(fresh, pieces(model))
    # One more step from the global batch: what a reloaded model must reproduce on any world size.
    global_step(model, opt, sched, 3, world, rank)
    nxt = ckpt.export_full_state_dict(model)
    if rank == 0:
        torch.save(nxt, os.path.join(tmp, "ref4_next.pt"))

    # (2) Resume is bitwise: per-rank RNG streams draw the data, so they must be restored too.
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

    # (3) HSDP: replicas hold the same pieces; each element is written once.
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    hsdp, h_opt, h_sched = make(seed=3, mesh=mesh)
    for step in range(2):
        global_step(hsdp, h_opt, h_sched, step, world, rank)
    ckpt.save(os.path.join(tmp, "hsdp"), hsdp, h_opt, schedulers=h_sched)
    h_full = ckpt.export_full_state_dict(hsdp)
    h_optim = ckpt.export_full_optimizer_state_dict(hsdp, h_opt)
    # ... and a 1-D checkpoint loads into HSDP: every replica gets the same, complete pieces.
    h_load, hl_opt, hl_sched = make(seed=6, mesh=mesh)
    ckpt.load(os.path.join(tmp, "ck4"), h_load, hl_opt, schedulers=hl_sched)
    ref4 = torch.load(os.path.join(tmp, "ref4.pt"))  # written by rank 0 before the collectives above
    assert_equal_tree(ckpt.export_full_state_dict(h_load, rank0_only=False), ref4["params"])
    assert_equal_tree(ckpt.export_full_optimizer_state_dict(h_load, hl_opt, rank0_only=False), ref4["optim"])
    if rank == 0:
        each_element_once(os.path.join(tmp, "hsdp"))
        each_element_once(os.path.join(tmp, "ck4"))
        torch.save({"params": h_full, "optim": h_optim}, os.path.join(tmp, "ref_hsdp.pt"))

    # (4) Whole matrices on one rank (empty pieces elsewhere), reloaded later on another layout.
    mlp, mlp_opt = make_mlp(seed=4, granularity="tensor")
    empty = torch.tensor([float(sum(p.to_local().numel() == 0 for p in mlp.parameters()))])
    dist.all_reduce(empty)
    assert empty.item() > 0
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
def saved(tmp_path_factory) -> str:
    tmp = str(tmp_path_factory.mktemp("ckpt"))
    run_distributed(_save4, 4, tmp)
    return tmp


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


def _load2(rank: int, world: int, tmp: str) -> None:
    model, opt, sched = make(seed=11)
    assert ckpt.load(os.path.join(tmp, "ck4"), model, opt, schedulers=sched) == {"step": 3, "tag": "ck4"}
    _check_against_reference(model, opt, sched, tmp)
    ckpt.save(os.path.join(tmp, "ck2"), model, opt, schedulers=sched, extra={"step": 3})
    _continue_like_reference(model, opt, sched, tmp)

    # An HSDP checkpoint loads on a plain 1-D mesh of another size.
    h_model, h_opt, h_sched = make(seed=12)
    ckpt.load(os.path.join(tmp, "hsdp"), h_model, h_opt, schedulers=h_sched)
    _check_against_reference(h_model, h_opt, h_sched, tmp, "ref_hsdp.pt")

    # Whole-tensor pieces with empty ones -> element granularity on another world size.
    mlp, mlp_opt = make_mlp(seed=15)
    ckpt.load(os.path.join(tmp, "mlp"), mlp, mlp_opt)
    _check_against_reference(mlp, mlp_opt, None, tmp, "ref_mlp.pt")

    # Between forward and backward the root's parameters are gathered: checkpointing refuses.
    busy, _, _ = make(seed=16)
    out = busy(global_batch(0)[0][:2])
    with pytest.raises(RuntimeError, match="between steps"):
        ckpt.get_model_state_dict(busy)
    out.float().sum().backward()
    ckpt.get_model_state_dict(busy)

    # Another model: every difference is named, and nothing changes.
    other, o_opt, o_sched = make(seed=13, vocab=60, n_layers=1)
    before = pieces(other)
    with pytest.raises(ValueError, match="does not match the model") as err:
        ckpt.load(os.path.join(tmp, "ck4"), other, o_opt, schedulers=o_sched)
    message = str(err.value)
    assert "ck4" in message and "layers.1.attn.qkv.weight (72, 24)" in message, message
    assert "tok.weight: checkpoint (53, 24), model (60, 24)" in message, message
    assert_same_pieces(other, before)
    assert not o_opt.state
    # Another optimizer: refused before its states are created or the model is touched.
    model, _, _ = make(seed=14)
    before = pieces(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sgd_sched = torch.optim.lr_scheduler.StepLR(sgd, step_size=2)
    with pytest.raises(ValueError, match="not of a torch.optim.sgd.SGD"):
        ckpt.load(os.path.join(tmp, "ck4"), model, sgd, schedulers=sgd_sched)
    assert not sgd.state
    assert_same_pieces(model, before)
    open(os.path.join(tmp, f"checks_passed_rank{rank}"), "w").close()
    dist.barrier()

    # Rank 1 dies after writing its data for a new ck2, before the checkpoint's .metadata exists.
    model, opt, sched = make(seed=21)
    global_step(model, opt, sched, 0, world, rank)
    write_data = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        fut = write_data(self, plan, planner)
        fut.wait()
        if rank == 1:
            os._exit(1)
        return fut

    FileSystemWriter.write_data = write_then_die
    ckpt.save(os.path.join(tmp, "ck2"), model, opt, schedulers=sched, extra={"step": 99})
    open(os.path.join(tmp, f"save_returned_rank{rank}"), "w").close()  # must never happen


def _load3(rank: int, world: int, tmp: str) -> None:
    model, opt, sched = make(seed=31)
    assert ckpt.load(os.path.join(tmp, "ck2"), model, opt, schedulers=sched) == {"step": 3}
    _check_against_reference(model, opt, sched, tmp)
    ckpt.save(os.path.join(tmp, "ck3"), model, opt, schedulers=sched, extra={"step": 3})


def _load1(rank: int, world: int, tmp: str) -> None:
    model, opt, sched = make(seed=41)
    ckpt.load(os.path.join(tmp, "ck3"), model, opt, schedulers=sched)
    _check_against_reference(model, opt, sched, tmp)
    _continue_like_reference(model, opt, sched, tmp)


def _in_process(fn, tmp: str) -> None:
    """``fn(0, 1, tmp)`` on a one-rank gloo group in this process: a spawn costs seconds on a busy machine."""
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'pg_single')}", rank=0, world_size=1)
    try:
        fn(0, 1, tmp)
    finally:
        dist.destroy_process_group()


def test_reshard_and_atomic_save(saved: str) -> None:
    with pytest.raises(AssertionError, match="rank 0 of 2 failed|exited with codes") as err:
        run_distributed(_load2, 2, saved, timeout=300)
    # It failed in the save that rank 1 left (rank 0 raises there, or gloo aborts it without a traceback),
    # after every check had passed on both ranks, and the save returned nowhere.
    if "rank 0 of 2 failed" in str(err.value):
        assert "in save\n" in str(err.value) and "saving checkpoint" in str(err.value), err.value
    assert all(os.path.exists(os.path.join(saved, f"checks_passed_rank{r}")) for r in range(2))
    assert not glob.glob(os.path.join(saved, "save_returned_rank*"))
    assert os.path.isfile(os.path.join(saved, "ck2", ".metadata"))
    # Rank 0 removed the directory the dead rank left unfinished (an incomplete one is refused by load:
    # tests/unit/test_checkpoint_errors.py).
    assert not glob.glob(os.path.join(saved, "ck2.tmp-*"))
    run_distributed(_load3, 3, saved)
    _in_process(_load1, saved)

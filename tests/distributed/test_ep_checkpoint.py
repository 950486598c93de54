"""Sharded checkpoints of expert-parallel models hold all E experts of every expert parameter.

4 gloo ranks as a (dp, ep) = (2, 2) mesh with ``fully_shard_expert_parallel`` train two AdamW steps and
save. The checkpoint (a) loads into a fresh identical EP model: parameters and optimizer states are
bitwise equal; (b) loads into a plain ``fully_shard``-ed model on 2 ranks, whose experts then equal the
full expert tensors exported on the 4-rank side, and into an EP model without ``fully_shard`` (plain local
expert stacks), which saves and reloads too. Negative control: the two ep ranks' expert blocks differ, so
a checkpoint that dropped the ep offset (one block written twice, the other never) would be detected.

One test per behaviour (:class:`tests.dist_pool.DistributedTest`): the 4-rank checks train and save in each test; the
2-rank class loads one checkpoint that a 4-rank run (``run_distributed``, once per class) trains and saves first.
Every comparison is bitwise.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import lightning_vescale as lv
from lightning_vescale import checkpoint as ckpt
from lightning_vescale.models import MoE, moe_config
from lightning_vescale.parallel import apply_expert_parallel, fully_shard_expert_parallel
from lightning_vescale.parallel.expert_parallel import ExpertParallelGroupedExperts
from tests.dist_pool import DistributedTest
from tests.dist_utils import run_distributed

LOCAL_BATCH, SEQ = 2, 8


def _make(seed: int) -> MoE:
    torch.manual_seed(seed)
    config = dataclasses.replace(moe_config("tiny"), vocab_size=64, dim=32, moe_hidden=32, shared_expert_hidden=32)
    return MoE(config)


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_and_save(rank: int, path: str):
    """Two AdamW steps on a (dp, ep) = (2, 2) mesh, saved under ``path``/ckpt, the full export in ``path``/full.pt."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    model = fully_shard_expert_parallel(_make(0), mesh)
    opt = _optimizer(model)
    vocab = model.config.vocab_size
    for step in range(2):
        generator = torch.Generator().manual_seed(10 * step + rank)
        tokens = torch.randint(0, vocab, (LOCAL_BATCH, SEQ + 1), generator=generator)
        _loss(model, tokens).backward()
        opt.step()
        opt.zero_grad()
    ckpt.save(os.path.join(path, "ckpt"), model, opt)
    full = ckpt.export_full_state_dict(model, rank0_only=False)
    full_optim = ckpt.export_full_optimizer_state_dict(model, opt, rank0_only=False)
    if rank == 0:
        torch.save({"model": full, "optim": full_optim}, os.path.join(path, "full.pt"))
    dist.barrier()
    return mesh, model, opt, full


def _save4(rank: int, world: int, path: str) -> None:
    _train_and_save(rank, path)


def _full_export_holds_all_experts(rank: int, world: int, path: str) -> None:
    """The full export holds all E experts; each rank's piece is its block of them."""
    _, model, _, full = _train_and_save(rank, path)
    num_experts = model.config.num_experts
    experts = [n for n, _ in model.named_parameters() if ".experts." in n]
    assert experts
    for name, p in model.named_parameters():
        module = model.get_submodule(name.rsplit(".", 1)[0])
        want = full[name]
        if isinstance(module, ExpertParallelGroupedExperts):
            assert want.shape[0] == num_experts and p.shape == want.shape, (name, want.shape, p.shape)
            # Negative control: the ep ranks' blocks differ (dropping the offset would be visible).
            half = num_experts // 2
            assert not torch.equal(full[name][:half], full[name][half:]), name
        start, end = p.local_range  # the piece's range in the tensor of all experts
        assert torch.equal(want.reshape(-1)[start:end], p.to_local().reshape(-1)), name


def _fresh_ep_model_loads_bitwise(rank: int, world: int, path: str) -> None:
    """(a) A fresh identical EP model: bitwise equal parameters and optimizer states after load."""
    mesh, model, opt, _ = _train_and_save(rank, path)
    fresh = fully_shard_expert_parallel(_make(1), mesh)
    fresh_opt = _optimizer(fresh)
    ckpt.load(os.path.join(path, "ckpt"), fresh, fresh_opt)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p.detach(), q.detach()), name
        mine, theirs = opt.state[p], fresh_opt.state[q]
        assert set(mine) == set(theirs) and mine, name
        for key in mine:
            assert torch.equal(torch.as_tensor(mine[key]), torch.as_tensor(theirs[key])), (name, key)


def _plain_fully_shard_loads_all_experts(rank: int, world: int, path: str) -> None:
    """(b) A plain fully_shard-ed model on 2 ranks: its experts are the full expert tensors."""
    saved = torch.load(os.path.join(path, "full.pt"), weights_only=False)
    flat = init_device_mesh("cpu", (world,))
    model = _make(1)
    for block in model.layers:
        lv.fully_shard(block, mesh=flat)
    lv.fully_shard(model, mesh=flat)
    opt = _optimizer(model)
    ckpt.load(os.path.join(path, "ckpt"), model, opt)
    full = ckpt.export_full_state_dict(model, rank0_only=False)
    assert set(full) == set(saved["model"])
    for name, value in full.items():
        assert torch.equal(value, saved["model"][name]), name
    full_optim = ckpt.export_full_optimizer_state_dict(model, opt, rank0_only=False)
    for name, entries in saved["optim"]["state"].items():
        for key, value in entries.items():
            assert torch.equal(torch.as_tensor(full_optim["state"][name][key]), torch.as_tensor(value)), (name, key)


def _ep_without_fully_shard_loads_saves_and_reloads(rank: int, world: int, path: str, out: str) -> None:
    """An EP model without fully_shard (plain local expert stacks, ep = 2) loads, saves (to ``out``) and reloads."""
    saved = torch.load(os.path.join(path, "full.pt"), weights_only=False)
    ep_model = apply_expert_parallel(_make(2), dist.group.WORLD)
    ckpt.load(os.path.join(path, "ckpt"), ep_model)
    for name, p in ep_model.named_parameters():
        want = saved["model"][name]
        module = ep_model.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(module, ExpertParallelGroupedExperts):
            want = want[module.expert_start : module.expert_start + module.num_experts]
        assert torch.equal(p.detach(), want), name
    exported = ckpt.export_full_state_dict(ep_model, rank0_only=False)
    assert all(torch.equal(v, saved["model"][n]) for n, v in exported.items())
    ckpt.save(os.path.join(out, "ep_plain"), ep_model)
    again = apply_expert_parallel(_make(3), dist.group.WORLD)
    ckpt.load(os.path.join(out, "ep_plain"), again)
    for (name, p), q in zip(ep_model.named_parameters(), again.parameters()):
        assert torch.equal(p.detach(), q.detach()), name


class TestExpertParallelCheckpointOn4Ranks(DistributedTest):
    """(dp, ep) = (2, 2): train two AdamW steps, save."""

    world_size = 4

    def test_full_export_holds_all_experts_and_each_rank_its_block(self, tmp_path) -> None:
        self.run_ranks(_full_export_holds_all_experts, str(tmp_path))

    def test_fresh_expert_parallel_model_loads_bitwise(self, tmp_path) -> None:
        self.run_ranks(_fresh_ep_model_loads_bitwise, str(tmp_path))


class TestExpertParallelCheckpointLoadsOn2Ranks(DistributedTest):
    """The 4-rank checkpoint, loaded on 2 ranks."""

    world_size = 2

    @pytest.fixture(scope="class")
    def saved(self, tmp_path_factory) -> str:
        path = str(tmp_path_factory.mktemp("ep_checkpoint"))
        run_distributed(_save4, 4, path, timeout=120)
        return path

    def test_plain_fully_shard_model_loads_the_full_experts(self, saved: str) -> None:
        self.run_ranks(_plain_fully_shard_loads_all_experts, saved)

    def test_ep_model_without_fully_shard_loads_saves_and_reloads(self, saved: str, tmp_path) -> None:
        self.run_ranks(_ep_without_fully_shard_loads_saves_and_reloads, saved, str(tmp_path))
        # The EP-without-fully_shard save reloads in one process, without expert parallelism.
        plain = _make(4)
        ckpt.load(str(tmp_path / "ep_plain"), plain)
        saved_model = torch.load(os.path.join(saved, "full.pt"), weights_only=False)["model"]
        for name, value in plain.state_dict().items():
            assert torch.equal(value, saved_model[name]), name

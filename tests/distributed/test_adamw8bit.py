"""AdamW8bit on sharded parameters: bitwise one process, blocks never split, checkpoints that reshard, memory tiers.

One test per behaviour (:class:`tests.dist_pool.DistributedTest`: a class per world size, 2, 3 and 1 ranks; the
checkpoint the 3- and 1-rank tests load is saved once for the module, the ``saved`` fixture, by the ranks of the
2-rank tests), on an MLP whose matrices hold 2800 and 2870 elements (not multiples of the 256-element block, nor
evenly split by 2 or 3 ranks). Every comparison is bitwise, except the negative controls (visibly different):

2 ranks:
1. Sharded with ``adamw8bit_granularity()``, every step on the same full gradients is bitwise the unsharded
   AdamW8bit of one process: parameters, codes and scales (each rank quantizes whole blocks, no communication).
2. Negative control: element granularity cuts inside a block, and AdamW8bit refuses it, naming the fix.
3. With ``MemoryPolicy(optimizer_states="disk")`` the same steps are bitwise the same, and the codes and scales
   leave memory between steps.
4. (the ``saved`` fixture) ``checkpoint.save`` after ``SAVED_STEPS``, the full optimizer export (its scales whole),
   then ``MORE_STEPS`` (the run that never stopped); rank 0 keeps its final full parameters.

1 and 3 ranks, on freshly built (differently initialized) models:
5. ``checkpoint.load`` and the same ``MORE_STEPS`` gradients give bitwise the never-stopped run's parameters.
6. So does the full export loaded with ``set_optimizer_state_dict`` (each rank takes its pieces and blocks).
7. Negative control: the model loaded and the optimizer not ends visibly elsewhere.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import lightning_vescale as lv
from lightning_vescale import checkpoint as ckpt
from lightning_vescale.engine.tensor import RaggedTensor, is_ragged, local_tensor
from lightning_vescale.memory import MemoryPolicy, offload_optimizer_states
from lightning_vescale.optim import AdamW8bit, adamw8bit_granularity
from tests.dist_pool import DistributedPools, DistributedTest, ModuleRanksTest

SAVED_STEPS = 3
MORE_STEPS = 3
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(40, 70), nn.Tanh(), nn.Linear(70, 41)) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)[..., :40]
        return x


def make(seed: int, granularity=None) -> tuple[nn.Module, AdamW8bit]:
    torch.manual_seed(seed)
    model = Net()
    for block in model.blocks:
        lv.fully_shard(block, granularity=granularity or adamw8bit_granularity())
    lv.fully_shard(model, granularity=granularity or adamw8bit_granularity())
    return model, AdamW8bit(model.parameters(), **HYPER)


def grads_of(step: int, model: nn.Module) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=g) * 0.01 + 0.001 for n, p in model.named_parameters()}


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        for n, p in model.named_parameters():
            full = grads_of(step, model)[n]
            p.grad = RaggedTensor.from_full(full, p.layout_info) if is_ragged(p) else full
        opt.step()
        opt.zero_grad()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if is_ragged(p) else p.detach().clone()) for n, p in model.named_parameters()}


def assert_equal(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), (k, (got[k] - want[k]).abs().max().item())


def _sharded_steps_bitwise(rank: int, world: int) -> None:
    """1. Sharded == one process, bitwise, step after step: parameters, codes and scales."""
    model, opt = make(0)
    torch.manual_seed(0)
    ref = Net()
    ref_opt = AdamW8bit(ref.parameters(), **HYPER)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    assert all(opt.quantizes(p) for p in weights)
    assert any(lo % 256 == 0 and 0 < lo < p.numel() for p in weights for lo, _ in p.layout_info.ranges), (
        "some matrix must be cut between the ranks for this test to mean something")
    for step in range(SAVED_STEPS):
        train(model, opt, range(step, step + 1))
        train(ref, ref_opt, range(step, step + 1))
        assert_equal(full_params(model), full_params(ref))
    for (n, p), rp in zip(model.named_parameters(), ref.parameters()):
        for key, value in opt.state[p].items():
            assert torch.equal(value.full_tensor() if is_ragged(value) else value, ref_opt.state[rp][key]), (n, key)


def _element_granularity_refused(rank: int, world: int) -> None:
    """2. Negative control: element granularity cuts inside a block."""
    torch.manual_seed(0)
    lone = nn.Linear(70, 41)
    lv.fully_shard(lone, granularity="element")
    with pytest.raises(ValueError, match=r"falls inside an 8-bit block of 256 elements.*granularity='elements:256'"):
        AdamW8bit(lone.parameters(), **HYPER)


def _disk_tier_bitwise(rank: int, world: int, tmp: str) -> None:
    """3. States on the disk tier: the same bits, and out of memory between steps."""
    model, opt = make(0)
    train(model, opt, range(SAVED_STEPS))
    swapped, swapped_opt = make(0)
    policy = MemoryPolicy(optimizer_states="disk", disk_dir=os.path.join(tmp, f"swap{rank}"), bucket_bytes=4096)
    offload = offload_optimizer_states(swapped_opt, policy, model=swapped)
    train(swapped, swapped_opt, range(SAVED_STEPS))
    offload.flush()
    codes = swapped_opt.state[next(swapped.parameters())]["exp_avg_codes"]
    assert local_tensor(codes).untyped_storage().nbytes() == 0  # on disk between steps
    assert_equal(full_params(swapped), full_params(model))
    offload.close()


def _save2(rank: int, world: int, tmp: str) -> None:
    """4. Train SAVED_STEPS steps, save, export, and keep going (the run that never stopped)."""
    model, opt = make(0)
    train(model, opt, range(SAVED_STEPS))
    ckpt.save(os.path.join(tmp, "ck"), model, opt)
    full_optim = ckpt.export_full_optimizer_state_dict(model, opt, rank0_only=True)
    train(model, opt, range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
    final = full_params(model)
    if rank == 0:
        scales = full_optim["state"]["blocks.0.0.weight"]["exp_avg_scales"]
        assert scales.shape == (11,) and not is_ragged(scales)  # ceil(2800 / 256) blocks, whole
        torch.save({"final": final, "full_optim": full_optim}, os.path.join(tmp, "ref.pt"))
    dist.barrier()


@pytest.fixture(scope="module")
def saved(ranks: DistributedPools, tmp_path_factory) -> str:
    """The checkpoint, full optimizer export and final parameters of the 2-rank run, once for the module."""
    tmp = str(tmp_path_factory.mktemp("adamw8bit_ckpt"))
    ranks(2).run(_save2, tmp)
    return tmp


def _checkpoint_continues_bitwise(rank: int, world: int, tmp: str) -> None:
    """5. The sharded checkpoint on another world size continues bit for bit."""
    saved = torch.load(os.path.join(tmp, "ref.pt"), weights_only=True)
    model, opt = make(5)
    ckpt.load(os.path.join(tmp, "ck"), model, opt)
    state = opt.state[next(model.parameters())]
    assert state["exp_avg_codes"].dtype == torch.uint8 and is_ragged(state["exp_avg_scales"])
    train(model, opt, range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
    assert_equal(full_params(model), saved["final"])


def _full_export_continues_bitwise(rank: int, world: int, tmp: str) -> None:
    """6. The full export, each rank taking its pieces and blocks."""
    saved = torch.load(os.path.join(tmp, "ref.pt"), weights_only=True)
    model2, opt2 = make(6)
    ckpt.load(os.path.join(tmp, "ck"), model2)  # the weights only
    ckpt.set_optimizer_state_dict(model2, opt2, saved["full_optim"])
    train(model2, opt2, range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
    assert_equal(full_params(model2), saved["final"])


def _without_optimizer_state_differs(rank: int, world: int, tmp: str) -> None:
    """7. Negative control: without the optimizer state the continuation differs."""
    saved = torch.load(os.path.join(tmp, "ref.pt"), weights_only=True)
    model3, opt3 = make(7)
    ckpt.load(os.path.join(tmp, "ck"), model3)
    train(model3, opt3, range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
    diff = max((full_params(model3)[k] - saved["final"][k]).abs().max().item() for k in saved["final"])
    assert diff > 1e-3, diff


class TestAdamW8bitOn2Ranks(ModuleRanksTest):
    """On the module's 2 ranks, those that save the checkpoint."""

    world_size = 2

    def test_sharded_steps_are_bitwise_one_process(self) -> None:
        self.run_ranks(_sharded_steps_bitwise)

    def test_element_granularity_inside_a_block_is_refused(self) -> None:
        self.run_ranks(_element_granularity_refused)

    def test_states_on_disk_are_bitwise_and_leave_memory(self, tmp_path) -> None:
        self.run_ranks(_disk_tier_bitwise, str(tmp_path))


class _LoadTests(DistributedTest):
    """The 2-rank checkpoint loaded on another world size."""

    def test_checkpoint_load_continues_bitwise(self, saved: str) -> None:
        self.run_ranks(_checkpoint_continues_bitwise, saved)

    def test_full_optimizer_export_continues_bitwise(self, saved: str) -> None:
        self.run_ranks(_full_export_continues_bitwise, saved)

    def test_without_the_optimizer_state_the_continuation_differs(self, saved: str) -> None:
        self.run_ranks(_without_optimizer_state_differs, saved)


class TestAdamW8bitLoadOn3Ranks(_LoadTests):
    world_size = 3


class TestAdamW8bitLoadOn1Rank(_LoadTests):
    world_size = 1

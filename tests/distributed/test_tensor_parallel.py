"""Tensor parallelism composed with RaggedShard sharding, the torchtitan way: ``parallelize_module`` over
``mesh["tp"]`` per block, then ``lightning_vescale.fully_shard`` over ``mesh["dp"]``, on 4 gloo ranks as dp2 x tp2.

One class of tests on the 4 ranks (:class:`tests.dist_pool.DistributedTest`), one test per behaviour: the parameters are DTensors on the (dp, tp) mesh with (RaggedShard, tp placement) and
the global shapes (and HSDP parameters their (replicate, shard) mesh); training (AdamW, gradient accumulation with no_sync, clipping by the global norm) equals one
process on the whole batch (fp32, 1e-5: reductions run in other orders); a tensor-parallel-unaware norm (each
rank's pieces summed over dp only) differs from the true one (the negative control: the test can tell); a sharded
Muon takes tensor-parallel weights except in mode="local", which refuses them, and block quantization refuses them; a
checkpoint saved on dp2 x tp2 loads bitwise into the same model sharded over 4 ranks without tensor parallelism.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import lightning_vescale as lv
from lightning_vescale import checkpoint as ckpt
from lightning_vescale.engine.placement import RaggedShard
from lightning_vescale.optim import Muon
from lightning_vescale.quant import BlockFormat, quantize_all_gather
from tests.dist_pool import DistributedTest

GLOBAL_BATCH, ACCUM, CLIP = 8, 2, 0.5


class Block(nn.Module):
    def __init__(self, dim: int = 13, hidden: int = 38) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(13, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _shard(model: Net, mesh, tensor_parallel: bool) -> Net:
    dp_mesh = mesh["dp"] if tensor_parallel else mesh
    for block in model.blocks:
        if tensor_parallel:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        lv.fully_shard(block, mesh=dp_mesh)
    return lv.fully_shard(model, mesh=dp_mesh)


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def _tp_unaware_norm(model: nn.Module, dp_group) -> float:
    """What an implementation that reduces only over dp would call the gradient norm."""
    total = torch.zeros(())
    for p in model.parameters():
        total += p.grad.to_local().double().square().sum().float()
    dist.all_reduce(total, group=dp_group)
    return total.sqrt().item()


def _dp_tp_mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _sharded_pair(mesh) -> tuple[Net, Net]:
    """The reference Net and a dp2 x tp2 copy of it."""
    torch.manual_seed(0)
    ref = Net()
    return ref, _shard(copy.deepcopy(ref), mesh, tensor_parallel=True)


def _layout_on_the_dp_tp_mesh(rank: int, world: int) -> None:
    """The parameters: DTensors of the whole tensor on the (dp, tp) mesh."""
    ref, model = _sharded_pair(_dp_tp_mesh())
    up = model.blocks[0].up.weight
    assert isinstance(up, DTensor) and up.shape == (38, 13) and up.device_mesh.mesh_dim_names == ("dp", "tp")
    assert isinstance(up.placements[0], RaggedShard) and up.placements[1] == Shard(0), up.placements
    assert model.blocks[0].down.bias.placements[1] == Replicate()
    assert all(torch.equal(_full(model)[n], p) for n, p in ref.named_parameters()), "sharding changed the values"


def _train_like_one_process(mesh, ref: Net, model: Net) -> torch.optim.Optimizer:
    """Three AdamW steps with accumulation (no_sync) and clipping, checked against one process at every step."""
    dp = mesh["dp"].get_local_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    mine = slice(dp * GLOBAL_BATCH // 2, (dp + 1) * GLOBAL_BATCH // 2)
    for step in range(3):
        losses, ref_losses = [], []
        for micro in range(ACCUM):
            x, y = _batch(step, micro)
            with model.no_sync() if micro < ACCUM - 1 else torch.enable_grad():
                loss = F.mse_loss(model(x[mine]), y[mine])
                (loss / ACCUM).backward()
            ref_loss = F.mse_loss(ref(x), y)
            (ref_loss / ACCUM).backward()
            losses.append(loss.detach())
            ref_losses.append(ref_loss.item())
        unaware = _tp_unaware_norm(model, mesh["dp"].get_group())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        assert abs(norm.item() - ref_norm.item()) <= 1e-5 * max(1.0, ref_norm.item()), (step, norm, ref_norm)
        assert abs(unaware - ref_norm.item()) > 1e-3, "negative control: a dp-only norm must be detectably wrong"
        assert ref_norm.item() > CLIP, "clipping must be active for the comparison to mean anything"
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro, loss in enumerate(losses):
            dist.all_reduce(loss, group=mesh["dp"].get_group())
            assert abs(loss.item() / 2 - ref_losses[micro]) <= 1e-5, (step, micro, loss.item() / 2, ref_losses[micro])
    return opt


def _training_matches_one_process(rank: int, world: int) -> None:
    mesh = _dp_tp_mesh()
    ref, model = _sharded_pair(mesh)
    _train_like_one_process(mesh, ref, model)
    worst = max((_full(model)[n] - p).abs().max().item() for n, p in ref.named_parameters())
    assert worst <= 1e-5, f"dp2 x tp2 differs from one process by {worst}"


def _muon_takes_tp_weights_except_local(rank: int, world: int) -> None:
    """Muon orthogonalizes a tensor-parallel matrix whole (tests/distributed/test_muon_tensor_parallel.py); only
    mode="local" (no communication) cannot, and says so, naming the parameter."""
    _, model = _sharded_pair(_dp_tp_mesh())
    Muon([("blocks.0.up.weight", model.blocks[0].up.weight)])
    with pytest.raises(ValueError, match=r"mode='local' .* tensor parallelism splits blocks\.0\.up\.weight"):
        Muon([("blocks.0.up.weight", model.blocks[0].up.weight)], mode="local")


def _block_quantization_refuses_tp_weights(rank: int, world: int) -> None:
    mesh = _dp_tp_mesh()
    torch.manual_seed(0)
    quantized = Net()
    parallelize_module(quantized.blocks[0], mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    quantize_all_gather(quantized.blocks[0], BlockFormat("fp8_e4m3", 8), targets=["up.weight"])
    with pytest.raises(ValueError, match="up.weight is declared block-quantized and is a tensor-parallel DTensor"):
        lv.fully_shard(quantized.blocks[0], mesh=mesh["dp"])


def _hsdp_reports_its_2d_mesh(rank: int, world: int) -> None:
    """HSDP reports its 2-D (replicate, shard) mesh, as FSDP2's (Replicate(), Shard(0))."""
    hsdp = _shard(Net(), init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")), tensor_parallel=False)
    w = hsdp.blocks[0].up.weight
    assert w.device_mesh.mesh_dim_names == ("replicate", "shard") and w.placements[0] == Replicate(), w.placements
    assert isinstance(w.placements[1], RaggedShard)


def _checkpoint_loads_into_dp4_bitwise(rank: int, world: int, tmp: str) -> None:
    """A checkpoint of a trained dp2 x tp2 model loads into the model sharded over 4 ranks without tensor
    parallelism, bitwise."""
    mesh = _dp_tp_mesh()
    ref, model = _sharded_pair(mesh)
    opt = _train_like_one_process(mesh, ref, model)
    path = os.path.join(tmp, "tp_ckpt")
    ckpt.save(path, model, opt)
    flat = _shard(Net(), init_device_mesh("cpu", (world,)), tensor_parallel=False)
    flat_opt = torch.optim.AdamW(flat.parameters(), lr=1e-2)
    ckpt.load(path, flat, flat_opt)
    want, got = _full(model), _full(flat)
    assert all(torch.equal(got[n], want[n]) for n in want), "dp2 x tp2 -> dp4 changed the values"
    for (n, p), q in zip(model.named_parameters(), flat.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"].full_tensor(), flat_opt.state[q]["exp_avg"].full_tensor()), n


class TestTensorParallelDp2Tp2(DistributedTest):
    world_size = 4

    def test_parameters_are_dtensors_on_the_dp_tp_mesh(self) -> None:
        self.run_ranks(_layout_on_the_dp_tp_mesh)

    def test_training_with_accumulation_and_clipping_matches_one_process(self) -> None:
        self.run_ranks(_training_matches_one_process)

    def test_muon_takes_tp_weights_except_in_local_mode(self) -> None:
        self.run_ranks(_muon_takes_tp_weights_except_local)

    def test_block_quantization_refuses_tp_weights(self) -> None:
        self.run_ranks(_block_quantization_refuses_tp_weights)

    def test_hsdp_reports_its_replicate_shard_mesh(self) -> None:
        self.run_ranks(_hsdp_reports_its_2d_mesh)

    def test_checkpoint_reshards_from_dp2_tp2_to_dp4_bitwise(self, tmp_path) -> None:
        self.run_ranks(_checkpoint_loads_into_dp4_bitwise, str(tmp_path))

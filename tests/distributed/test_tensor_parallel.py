"""Tensor parallelism composed with RaggedShard sharding, the torchtitan way: ``parallelize_module`` over
``mesh["tp"]`` per block, then ``lightning_vescale.fully_shard`` over ``mesh["dp"]``, on 4 gloo ranks as dp2 x tp2.

One process group checks: the parameters are DTensors on the (dp, tp) mesh with (RaggedShard, tp placement) and
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
from tests.dist_utils import run_distributed

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


def _run(rank: int, world: int, tmp: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    ref = Net()
    model = _shard(copy.deepcopy(ref), mesh, tensor_parallel=True)

    # The parameters: DTensors of the whole tensor on the (dp, tp) mesh.
    up = model.blocks[0].up.weight
    assert isinstance(up, DTensor) and up.shape == (38, 13) and up.device_mesh.mesh_dim_names == ("dp", "tp")
    assert isinstance(up.placements[0], RaggedShard) and up.placements[1] == Shard(0), up.placements
    assert model.blocks[0].down.bias.placements[1] == Replicate()
    assert all(torch.equal(_full(model)[n], p) for n, p in ref.named_parameters()), "sharding changed the values"

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
    worst = max((_full(model)[n] - p).abs().max().item() for n, p in ref.named_parameters())
    assert worst <= 1e-5, f"dp2 x tp2 differs from one process by {worst}"

    # Muon orthogonalizes a tensor-parallel matrix whole (tests/distributed/test_muon_tensor_parallel.py); only
    # mode="local" (no communication) cannot, and says so, naming the parameter. Block quantization refuses.
    Muon([("blocks.0.up.weight", model.blocks[0].up.weight)])
    with pytest.raises(ValueError, match=r"mode='local' .* tensor parallelism splits blocks\.0\.up\.weight"):
        Muon([("blocks.0.up.weight", model.blocks[0].up.weight)], mode="local")
    quantized = Net()
    parallelize_module(quantized.blocks[0], mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    quantize_all_gather(quantized.blocks[0], BlockFormat("fp8_e4m3", 8), targets=["up.weight"])
    with pytest.raises(ValueError, match="up.weight is declared block-quantized and is a tensor-parallel DTensor"):
        lv.fully_shard(quantized.blocks[0], mesh=mesh["dp"])

    # HSDP reports its 2-D (replicate, shard) mesh, as FSDP2's (Replicate(), Shard(0)).
    hsdp = _shard(Net(), init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")), tensor_parallel=False)
    w = hsdp.blocks[0].up.weight
    assert w.device_mesh.mesh_dim_names == ("replicate", "shard") and w.placements[0] == Replicate(), w.placements
    assert isinstance(w.placements[1], RaggedShard)

    # A checkpoint of dp2 x tp2 loads into the model sharded over 4 ranks without tensor parallelism, bitwise.
    path = os.path.join(tmp, "tp_ckpt")
    ckpt.save(path, model, opt)
    flat = _shard(Net(), init_device_mesh("cpu", (world,)), tensor_parallel=False)
    flat_opt = torch.optim.AdamW(flat.parameters(), lr=1e-2)
    ckpt.load(path, flat, flat_opt)
    want, got = _full(model), _full(flat)
    assert all(torch.equal(got[n], want[n]) for n in want), "dp2 x tp2 -> dp4 changed the values"
    for (n, p), q in zip(model.named_parameters(), flat.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"].full_tensor(), flat_opt.state[q]["exp_avg"].full_tensor()), n


def test_dp2_tp2_trains_like_one_process_and_reshards() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_run, 4, tmp, timeout=300, pg_timeout=120)

"""The engine on a CUDA device (``gpu`` marker: skipped without one; ``benchmarks/gpu_check.sh`` measures speed).

One rank on ``nccl``: a sharded model trains like the same model unsharded on the same device (fp32, AdamW, 3 steps;
1e-5, not bitwise: the sharded gradients pass through a ReduceScatter), its DBuffer storage lives on the device, and
a bf16 mixed-precision step runs and stays finite. Nothing here names a backend the test did not choose.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import lightning_vescale as lv
from tests.toy_models import MLP

pytestmark = pytest.mark.gpu


@pytest.fixture
def one_cuda_rank(tmp_path):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield torch.device("cuda", 0)
    dist.destroy_process_group()


def _steps(model: torch.nn.Module, device: torch.device, steps: int = 3) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        g = torch.Generator(device="cpu").manual_seed(100 + step)
        x = torch.randn(8, 7, generator=g).to(device)
        y = torch.randn(8, 5, generator=g).to(device)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_sharded_training_on_cuda_matches_unsharded(one_cuda_rank: torch.device) -> None:
    torch.manual_seed(0)
    ref = MLP().to(one_cuda_rank)
    model = copy.deepcopy(ref)
    lv.fully_shard(model)
    assert all(p.to_local().device.type == "cuda" for p in model.parameters())
    got, want = _steps(model, one_cuda_rank), _steps(ref, one_cuda_rank)
    assert all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(got, want)), (got, want)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_mixed_precision_step_on_cuda_is_finite(one_cuda_rank: torch.device) -> None:
    torch.manual_seed(0)
    model = MLP().to(one_cuda_rank)
    lv.fully_shard(model, mp_policy=lv.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    losses = _steps(model, one_cuda_rank, steps=2)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert all(p.to_local().dtype == torch.float32 for p in model.parameters())  # fp32 masters

"""Qwen3-MoE and DeepSeek-V3 under expert parallelism with sharding equal single-process training.

2 gloo ranks as a (dp, ep) = (1, 2) mesh through ``fully_shard_expert_parallel``: each rank holds half of
every layer's experts; the rest is sharded over both ranks. Each rank trains one SGD step on its half of
the global batch, with DeepSeek-V3's auxiliary-loss-free bias update as a pre-step hook; the reference is
one process on the whole batch. fp32, 1e-5 relative (the collectives sum in another order). One test per family
(:class:`tests.dist_pool.DistributedTest`, the two ranks shared).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from lightning_vescale.checkpoint import export_full_state_dict
from lightning_vescale.models import DeepSeekV3, Qwen3MoE, deepseek_v3_config, qwen3_moe_config
from lightning_vescale.parallel import fully_shard_expert_parallel, register_expert_bias_update
from lightning_vescale.parallel.expert_parallel import ExpertParallelGroupedExperts
from tests.dist_pool import DistributedTest

LOCAL_BATCH, SEQ, TOL, LR, BIAS_RATE = 2, 12, 1e-5, 0.5, 0.01


def _reference(family: str):
    torch.manual_seed(0)  # the same full model on every rank
    model = Qwen3MoE(qwen3_moe_config("tiny")) if family == "qwen3_moe" else DeepSeekV3(deepseek_v3_config("tiny"))
    with torch.no_grad():
        for layer in model.moe_layers():
            layer.router.weight.normal_(0, 1.0)  # decisive routing: no near-ties that 1e-7 could flip
    return model


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _train_one_step(rank: int, world: int, family: str) -> None:
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "ep"))
    ref = _reference(family)
    model = fully_shard_expert_parallel(copy.deepcopy(ref), mesh)
    assert all(isinstance(m.experts, ExpertParallelGroupedExperts) for m in model.moe_layers())
    assert all(m.experts.num_experts == ref.config.num_experts // world for m in model.moe_layers())

    tokens = torch.randint(0, ref.config.vocab_size, (world * LOCAL_BATCH, SEQ + 1),
                           generator=torch.Generator().manual_seed(7))
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
    register_expert_bias_update(model, opt, rate=BIAS_RATE, group=dist.group.WORLD)
    register_expert_bias_update(ref, ref_opt, rate=BIAS_RATE)

    loss = _loss(model, tokens[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH])
    loss.backward()
    ref_loss = _loss(ref, tokens)
    ref_loss.backward()
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    assert abs(global_loss.item() / world - ref_loss.item()) <= TOL * ref_loss.item(), (family, global_loss, ref_loss)
    opt.step()
    ref_opt.step()

    got = export_full_state_dict(model, rank0_only=False)
    want = ref.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        scale = value.abs().max().clamp_min(1e-12)
        assert (got[name] - value).abs().max() <= TOL * scale, (family, name)
    if family == "deepseek_v3":
        # The balancing step moved the biases the same way as on one process.
        assert all(layer.router.expert_bias.abs().sum() > 0 for layer in ref.moe_layers())
    initial = _reference(family).state_dict()
    moved = max((want[k] - initial[k]).abs().max().item() for k in want if k.endswith("experts.w1_EDF"))
    assert moved > 1e-4, "the step must change the experts for the comparison to mean anything"


class TestMoEFamiliesUnderExpertParallelism(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
    def test_one_sgd_step_equals_single_process(self, family: str) -> None:
        self.run_ranks(_train_one_step, family)

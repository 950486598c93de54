"""Experts on ep, attention on tp: ``parallelize(moe, "moe", mesh)`` on a ``("dp", "ep", "tp")`` mesh.

Four ranks, mesh (dp, ep, tp) = (1, 2, 2), one test per behaviour (``tests.dist_pool.DistributedTest``), check against one process on the whole batch (fp32, AdamW, clipping,
auxiliary-loss-free balancing; 1e-5: the collectives sum in other orders than one backward):

* the layout: attention projections report (RaggedShard, Shard) on the (dp_ep, tp) mesh, expert stacks all E experts,
  the feed-forward a group of its own over every rank (the plan's ``tp: split_tokens``);
* the Mixtral-like MoE and DeepSeek-V3 (latent attention, whole on every tp rank in its plan; a dense first layer)
  both train like one process, the router biases included (each tp rank counts other tokens: summed over every rank);
* the same by hand, torchtitan's way (``parallelize_module`` on the attention, then ``fully_shard_expert_parallel``
  on the 3-D mesh);
* gradient accumulation (the first micro-batch unsynchronized) with activation checkpointing, fp32 1e-5; bf16 mixed
  precision deviates from fp32 one process no more than 3x what bf16 deviates on plain dp over the same 4 ranks;
* Qwen3-MoE's per-head norms (``tp: heads``) train like one process too;
* on a ``("dp", "tp")`` mesh (no ep) the MoE trains like one process too, its experts sharded over every rank;
* a checkpoint saved there is read whole by one process, bitwise equal to the trained model.

Negative controls: the same plan without ``split_tokens`` is refused before anything is sharded, naming the rule to
add; so is a MoE with a switch-style auxiliary loss (it would be computed per sequence shard).
On 8 ranks, (2, 2, 2), the MoE trains like one process too.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import lightning_vescale as lv
from lightning_vescale import checkpoint as ckpt
from lightning_vescale.engine.fully_shard import get_state
from lightning_vescale.engine.placement import RaggedShard
from lightning_vescale.memory import checkpoint_blocks
from lightning_vescale.models import MoE, moe_config
from lightning_vescale.models.deepseek_v3 import DeepSeekV3, deepseek_v3_config
from lightning_vescale.models.qwen3_moe import Qwen3MoE, qwen3_moe_config
from lightning_vescale.parallel import fully_shard_expert_parallel, register_expert_bias_update
from lightning_vescale.plan import PlanError, load_plan
from tests.dist_pool import DistributedTest

LOCAL_BATCH, SEQ, STEPS, CLIP, LR, BIAS_RATE = 2, 8, 3, 0.5, 1e-2, 1e-2
# Adam's update g / (|g| + eps) moves an element whose gradient is near zero by up to lr * dg / eps for a gradient
# error dg. Gradients here match one process to ~1e-8 absolute (5e-7 of their largest), the collectives summing in
# another order; with torch's eps=1e-8 that is ~1e-3 of a weight after one step on the few elements whose gradient is
# ~1e-8 (measured 5.6e-4, and 5.2e-5 for plain dp over 4 ranks). eps=1e-3 bounds it at ~1e-7, so 1e-5 holds.
ADAM_EPS = 1e-3
TOL = 1e-5


def _decisive(model):
    """Router weights large enough that no near-tie between experts can flip at 1e-7."""
    with torch.no_grad():
        for layer in model.moe_layers():
            layer.router.weight.normal_(0, 1.0)
    return model


def _moe() -> MoE:
    torch.manual_seed(0)
    config = dataclasses.replace(moe_config("tiny"), vocab_size=64, dim=32, moe_hidden=32, shared_expert_hidden=32)
    return _decisive(MoE(config))


def _deepseek() -> DeepSeekV3:
    torch.manual_seed(0)
    return _decisive(DeepSeekV3(deepseek_v3_config("tiny")))


def _qwen3() -> MoE:
    torch.manual_seed(0)
    return _decisive(Qwen3MoE(qwen3_moe_config("tiny")))


def _batch(step: int, replicas: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, vocab, (replicas * LOCAL_BATCH, SEQ + 1), generator=generator)


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _train(model, replica: int, replicas: int, group, accum: int = 1) -> list[float]:
    """STEPS AdamW steps with clipping and bias balancing on this replica's share of each global batch, in ``accum``
    micro-batches (gradients synchronized on the last only)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    register_expert_bias_update(model, opt, rate=BIAS_RATE, group=group)
    mine = slice(replica * LOCAL_BATCH, (replica + 1) * LOCAL_BATCH)
    losses = []
    for step in range(STEPS):
        tokens = _batch(step, replicas, model.config.vocab_size)
        tokens = tokens if group is None else tokens[mine]
        total = torch.zeros(())
        for i, micro in enumerate(tokens.chunk(accum)):
            if group is not None and accum > 1:
                model.set_requires_gradient_sync(i == accum - 1)
            loss = _loss(model, micro) / accum
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        if group is not None:
            dist.all_reduce(total)
            total /= dist.get_world_size()  # every tp rank of a replica holds that replica's loss
        losses.append(total.item())
    model._test_optimizer = opt
    return losses


def _worst(model, ref) -> float:
    """Largest |sharded - reference| over parameters and router biases, relative to each tensor's largest value."""
    worst = 0.0
    for name, p in ref.named_parameters():
        got = model.get_parameter(name).full_tensor()
        worst = max(worst, ((got - p.detach()).abs().max() / p.abs().max().clamp_min(1e-12)).item())
    for name, b in ref.named_buffers():
        if name.endswith("expert_bias"):
            worst = max(worst, (model.get_buffer(name) - b).abs().max().item())
    return worst


def _check_layout(model, ref, world: int, expert_ranks: int) -> None:
    attention = model.layers[0].attention
    dp_name = "dp_ep" if expert_ranks < world else "dp"
    if isinstance(model, DeepSeekV3):  # its plan keeps the latent attention whole on every tp rank
        assert attention.wq_b.weight.device_mesh.mesh_dim_names == (dp_name,), attention.wq_b.weight.device_mesh
    else:
        wq = attention.wq.weight
        assert wq.device_mesh.mesh_dim_names == (dp_name, "tp"), wq.device_mesh
        assert isinstance(wq.placements[0], RaggedShard) and wq.placements[1] == Shard(0), wq.placements
        assert attention.wo.weight.placements[1] == Shard(1), "rowwise splits input features"
    for name, p in model.named_parameters():
        assert p.shape == ref.get_parameter(name).shape, name  # experts: all E of them
    ffn = model.moe_layers()[0]
    state = get_state(ffn)
    assert state is not None and state.mesh.size() == world, \
        "the token-split feed-forward is a group over every rank"
    assert {mp.fqn.split(".")[0] for mp in state.group.managed} <= {"router", "shared_experts", "shared_gate"}
    experts = get_state(ffn.experts)
    assert experts is not None and experts.mesh.size() == expert_ranks, \
        "experts are sharded over the dp * tp ranks of their ep coordinate (every rank without ep)"


def _torchtitan_idiom(model, mesh):
    """By hand, as torchtitan: attention split with parallelize_module, then the engine's expert parallel sharding."""
    for block in model.layers:
        parallelize_module(block, mesh["tp"], {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                                               "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel()})
    return fully_shard_expert_parallel(model, mesh)


def _parity(make, rank: int, world: int, mesh, tmp: str, name: str, shard=None, *, accum: int = 1,
            checkpointing: bool = False, mp_policy=None, tol: float = TOL) -> float:
    """Train sharded on ``mesh`` and one process side by side; assert they agree within ``tol``; the deviation."""
    tp = mesh["tp"].size() if "tp" in (mesh.mesh_dim_names or ()) else 1
    replicas, replica = world // tp, rank // tp
    ref = make()
    # The family's plan, or sharded by hand.
    model = (lv.parallelize(copy.deepcopy(ref), name, mesh, mp_policy=mp_policy) if shard is None
             else shard(copy.deepcopy(ref), mesh))
    if tp > 1:
        ep = mesh["ep"].size() if "ep" in (mesh.mesh_dim_names or ()) else 1
        _check_layout(model, ref, world, world // ep)
    if checkpointing:
        checkpoint_blocks(model, ["layers.*"])  # the experts' all-to-alls run again in backward
    ref_losses = _train(ref, 0, replicas, None)
    losses = _train(model, replica, replicas, dist.group.WORLD, accum)
    loss_tol = TOL if mp_policy is None else 3e-2
    assert all(abs(a - b) <= loss_tol * max(1.0, abs(b)) for a, b in zip(losses, ref_losses)), (name, losses, ref_losses)
    worst = _worst(model, ref)
    assert worst <= tol, f"{name} on {mesh}: differs from one process by {worst}"
    moved = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), make().parameters()))
    assert moved > 1e-3, "training must change the parameters for the parity check to mean anything"
    if tmp:
        ckpt.save(os.path.join(tmp, name), model, model._test_optimizer)
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        if rank == 0:
            save_file(full, os.path.join(tmp, f"{name}.safetensors"))
        dist.barrier()
    return worst


def _mesh_3d() -> Any:
    return init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "ep", "tp"))


def _moe_trains_and_saves(rank: int, world: int, tmp: str) -> None:
    _parity(_moe, rank, world, _mesh_3d(), tmp, "moe")


def _deepseek_trains_and_saves(rank: int, world: int, tmp: str) -> None:
    _parity(_deepseek, rank, world, _mesh_3d(), tmp, "deepseek_v3")


def _torchtitan_idiom_trains(rank: int, world: int) -> None:
    _parity(_moe, rank, world, _mesh_3d(), "", "moe", shard=_torchtitan_idiom)


def _accumulation_and_checkpointing(rank: int, world: int) -> None:
    """Gradient accumulation without synchronizing the first micro-batch, and activation checkpointing."""
    _parity(_moe, rank, world, _mesh_3d(), "", "moe", accum=2, checkpointing=True)


def _bf16_at_the_noise_floor(rank: int, world: int) -> None:
    """bf16 mixed precision deviates from fp32 one process as much as bf16 does without ep x tp (dp4, same run)."""
    bf16 = lv.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    deviation = _parity(_moe, rank, world, _mesh_3d(), "", "moe", mp_policy=bf16, tol=1.0)
    floor = _parity(_moe, rank, world, init_device_mesh("cpu", (world,)), "", "moe", mp_policy=bf16, tol=1.0)
    assert deviation > 1e-4 and floor > 1e-4, "bf16 must differ from fp32 measurably for the comparison to mean anything"
    assert deviation <= 3 * floor, f"bf16 dp1 x ep2 x tp2 deviates {deviation}, bf16 dp4 (the noise floor) {floor}"


def _qwen3_per_head_norms(rank: int, world: int) -> None:
    """Per-head q_norm / k_norm: tp: heads sums their gradients over tp."""
    _parity(_qwen3, rank, world, _mesh_3d(), "", "moe")


def _moe_on_dp_tp(rank: int, world: int) -> None:
    """Tensor parallelism without ep: the experts, whole, run inside the token-split feed-forward on every rank."""
    _parity(_moe, rank, world, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), "", "moe")


def _refusals(rank: int, world: int) -> None:
    mesh = _mesh_3d()
    # The moe plan without its split_tokens rule: refused before anything is sharded, naming the rule to add.
    plan = load_plan("moe")
    plan = dataclasses.replace(plan, rules=tuple(r for r in plan.rules if r.tp != "split_tokens"))
    with pytest.raises(PlanError, match=r"lie in no module with tp: split_tokens: add a rule \{match: 'layers.0.feed_forward'"):
        lv.parallelize(_moe(), plan, mesh)
    # A switch-style auxiliary loss would be computed per sequence shard: refused, naming the fix.
    aux = MoE(dataclasses.replace(_moe().config, aux_loss_coef=0.01))
    with pytest.raises(PlanError, match=r"aux_loss_coef > 0 and tp: split_tokens.*auxiliary-loss-free balancing"):
        lv.parallelize(aux, "moe", mesh)


class TestExpertsOnEpAttentionOnTp(DistributedTest):
    """dp1 x ep2 x tp2 on 4 ranks."""

    world_size = 4

    @pytest.mark.parametrize("family", ["moe", "deepseek_v3"])
    def test_trains_like_one_process_and_saves(self, family: str, tmp_path) -> None:
        self.run_ranks(_moe_trains_and_saves if family == "moe" else _deepseek_trains_and_saves, str(tmp_path))
        state, _ = ckpt.read_full_checkpoint(tmp_path / family)
        want = load_file(str(tmp_path / f"{family}.safetensors"))
        assert set(want) <= set(state)
        assert all(torch.equal(state[n], want[n]) for n in want), f"{family}: one process reads the checkpoint whole"

    def test_torchtitan_idiom_by_hand(self) -> None:
        self.run_ranks(_torchtitan_idiom_trains)

    def test_accumulation_and_activation_checkpointing(self) -> None:
        self.run_ranks(_accumulation_and_checkpointing)

    def test_bf16_mixed_precision_at_the_dp_noise_floor(self) -> None:
        self.run_ranks(_bf16_at_the_noise_floor)

    def test_qwen3_per_head_norms(self) -> None:
        self.run_ranks(_qwen3_per_head_norms)

    def test_moe_under_tensor_parallelism_without_ep(self) -> None:
        self.run_ranks(_moe_on_dp_tp)

    def test_plans_that_would_train_wrong_are_refused(self) -> None:
        self.run_ranks(_refusals)


def _dp2_ep2_tp2(rank: int, world: int) -> None:
    _parity(_moe, rank, world, init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "ep", "tp")), "", "moe")


class TestExpertsOnEpAttentionOnTp8Ranks(DistributedTest):
    world_size = 8

    def test_dp2_ep2_tp2_trains_like_one_process(self) -> None:
        self.run_ranks(_dp2_ep2_tp2)

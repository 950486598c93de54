"""Predicted step time of an MPMD layout next to uniform sharding, with the dry run's cost model.

Both layouts are priced with the same pieces, on the meta device, for a given global batch and hardware
profile (:mod:`lightning_vescale.plan._hardware`):

* compute: forward FLOPs counted by ``torch.utils.flop_counter`` on the meta device (the model's real ops, each
  stage on the slice one of its ranks computes), times 3 for forward + backward, at the profile's FLOP/s per
  rank;
* sharding collectives: the dry run (:func:`~lightning_vescale.plan._dry_run.dry_run`) of each stage's modules on
  its own ranks (or of the whole model on all ranks), its AllGather and ReduceScatter seconds per forward and
  backward; an MPMD stage gathers per micro-batch and reduces once per step (after the last micro-batch);
* they overlap: a micro-batch takes ``max(compute, AllGathers)``, the uniform step ``max(compute, collectives)``;
* MPMD adds the transfers between stages (activations forward, their gradients back, point to point) and,
  for a stage wider than its pipelines, the team's scatter and gather (see [Note: teams] in ``_team``);
* the pipeline: with per-micro-batch stage times ``t_s`` and ``M`` micro-batches, GPipe and 1F1B both take
  ``sum(t_s) + (M - 1) * max(t_s)`` (plus the last ReduceScatters); a stage is busy ``M * t_s`` of it, and its
  *bubble fraction* is the rest.
  (1F1B keeps fewer activations alive, not less idle time.)

Then the optimizer step (the dry run's, per stage; stages step in parallel). :func:`choose_layout` ranks the
candidates by predicted step time: an MPMD layout is chosen only where it is predicted faster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_vescale.pipeline._runtime import _meta_clone, _to_meta, check_batch, check_stage_shapes, run_chain
from lightning_vescale.pipeline._spec import MPMDPlan
from lightning_vescale.plan._dry_run import Workload, dry_run
from lightning_vescale.plan._hardware import HardwareProfile

__all__ = ["LayoutCost", "StageCost", "choose_layout", "predict_mpmd", "predict_uniform"]


@dataclass
class StageCost:
    """One stage of a predicted layout (uniform sharding is one stage over every rank)."""

    name: str
    ranks: int
    compute_seconds: float
    """Forward + backward of one micro-batch on one of the stage's ranks."""
    collective_seconds: float
    """The stage's AllGathers for one micro-batch (uniform: AllGathers and ReduceScatters of the step)."""
    transfer_seconds: float
    """Point-to-point to the next stage and back, plus the team's scatter and gather, for one micro-batch."""
    microbatch_seconds: float
    """``max(compute, collectives) + transfers``."""
    optimizer_seconds: float
    bubble_fraction: float = 0.0
    """Idle share of the pipeline's time on this stage's ranks."""
    reduce_seconds: float = 0.0
    """MPMD: the stage's ReduceScatters, once per step (gradients accumulate over the micro-batches)."""


@dataclass
class LayoutCost:
    """The predicted step of one layout."""

    name: str
    step_seconds: float
    bubble_fraction: float
    """Idle share of the step, averaged over ranks (0 for uniform sharding)."""
    stages: list = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


def _forward_flops(modules: Sequence[nn.Module], values: Sequence[Any]) -> float:
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        run_chain(modules, tuple(_to_meta(v) for v in values))
    return float(counter.get_total_flops())


def _bytes(values: Sequence[Any]) -> float:
    return float(sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor)))


def _head(values: Sequence[Any], n: int) -> tuple:
    return tuple(v[:n] if isinstance(v, torch.Tensor) else v for v in values)


def _collectives(modules: Mapping[str, nn.Module], plan: Any, ranks: int, hardware: HardwareProfile,
                 precision: str) -> tuple[float, float, float]:
    """(AllGather seconds per forward and backward, ReduceScatter seconds, optimizer seconds) of ``modules`` sharded
    by ``plan`` over ``ranks`` ranks, from the dry run."""
    from lightning_vescale.parallelize import resolve_for

    container = nn.Module()
    for name, module in modules.items():
        container.add_module(name, module)
    resolved = resolve_for(container, plan)
    est = dry_run(container, resolved, ranks, workload=Workload(batch_size=1, seq_len=1, precision=precision,
                                                               clip_grad=False),
                  hardware=hardware, activations={})
    reduce = sum(hardware.collective_seconds(g["reduce_scatter_bytes"], ranks) for g in est.groups)
    return est.vescale.comm_seconds - reduce, reduce, est.vescale.optimizer_seconds


def _link_seconds(nbytes: float, hardware: HardwareProfile, world_size: int) -> float:
    if nbytes == 0:
        return 0.0
    link = hardware.link(world_size)
    return link.latency + nbytes / (link.bandwidth * hardware.link_efficiency)


def predict_uniform(model: nn.Module, inputs: Sequence[torch.Tensor], world_size: int, hardware: HardwareProfile,
                    *, plan: Any = None, precision: str = "32-true") -> LayoutCost:
    """The whole model sharded over every rank by ``plan`` (data parallel: each rank takes ``1/N`` of the batch)."""
    shadow = model if all(p.is_meta for p in model.parameters()) else _meta_clone(model)
    batch = inputs[0].shape[0]
    if batch % world_size:
        raise ValueError(f"uniform sharding over {world_size} ranks needs a batch divisible by {world_size}, got {batch}")
    dtype = next(shadow.parameters()).dtype
    compute = 3 * _forward_flops([shadow], _head(inputs, batch // world_size))
    compute /= hardware.flops_per_rank(dtype, world_size)
    gather, reduce, opt = _collectives(dict(shadow.named_children()), plan, world_size, hardware, precision)
    step = max(compute, gather + reduce)
    stage = StageCost("all", world_size, compute, gather + reduce, 0.0, step, opt)
    return LayoutCost("uniform", step + opt, 0.0, [stage])


def predict_mpmd(model: nn.Module, plan: MPMDPlan, inputs: Sequence[torch.Tensor], hardware: HardwareProfile,
                 *, precision: str = "32-true") -> LayoutCost:
    """The step of ``plan`` for the global batch ``inputs`` (see the module note)."""
    plan = MPMDPlan.from_dict(plan)
    shadow = model if all(p.is_meta for p in model.parameters()) else _meta_clone(model)
    world = plan.world_size
    R, M = plan.num_pipelines, plan.microbatches
    check_batch(plan, inputs[0].shape[0])
    micro = inputs[0].shape[0] // (R * M)
    boundaries = check_stage_shapes(shadow, plan, _head(inputs, micro))
    dtype = next(shadow.parameters()).dtype
    rate = hardware.flops_per_rank(dtype, world)
    stages = []
    for spec, (stage_in, stage_out) in zip(plan.stages, boundaries):
        team = spec.ranks // R
        modules = {m: shadow.get_submodule(m) for m in spec.modules}
        compute = 3 * _forward_flops(list(modules.values()), _head(stage_in, micro // team)) / rate
        gather, reduce, opt = _collectives(modules, spec.plan, spec.ranks, hardware, precision)
        # Forward: receive the inputs, send the outputs; backward: the reverse (the first stage's inputs and the
        # last stage's loss do not travel). Inside a team: scatter in, gather out, and again for the gradients.
        is_last = spec is plan.stages[-1]
        p2p = 2 * _link_seconds(0.0 if is_last else _bytes(stage_out), hardware, world)
        team_bytes = 2 * (_bytes(stage_in) + _bytes(stage_out)) * (team - 1) / team if team > 1 else 0.0
        transfers = p2p + _link_seconds(team_bytes, hardware, world)
        stages.append(StageCost(spec.name, spec.ranks, compute, gather, transfers, max(compute, gather) + transfers,
                                opt, reduce_seconds=reduce))
    times = [s.microbatch_seconds for s in stages]
    # The ReduceScatters run once per step, in the last micro-batch's backward: the first stage's come last.
    pipeline = sum(times) + (M - 1) * max(times) + max(s.reduce_seconds for s in stages)
    for s in stages:
        s.bubble_fraction = 1.0 - M * s.microbatch_seconds / pipeline
    bubble = sum(s.bubble_fraction * s.ranks for s in stages) / world
    step = pipeline + max(s.optimizer_seconds for s in stages)
    return LayoutCost(f"mpmd:{plan.name or 'plan'}", step, bubble, stages)


def choose_layout(model: nn.Module, inputs: Sequence[torch.Tensor], world_size: int, hardware: HardwareProfile,
                  candidates: Sequence[Any], *, uniform_plan: Any = None,
                  precision: str = "32-true") -> tuple[Optional[MPMDPlan], list[LayoutCost]]:
    """Price uniform sharding and every MPMD plan in ``candidates`` (those that fit ``world_size``); return the
    fastest (None: uniform sharding) and every cost, fastest first."""
    costs = [(None, predict_uniform(model, inputs, world_size, hardware, plan=uniform_plan, precision=precision))]
    for candidate in candidates:
        plan = MPMDPlan.from_dict(candidate)
        if plan.world_size == world_size:
            costs.append((plan, predict_mpmd(model, plan, inputs, hardware, precision=precision)))
    costs.sort(key=lambda c: c[1].step_seconds)
    return costs[0][0], [c for _, c in costs]

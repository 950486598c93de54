"""Predicted step time of an MPMD layout next to uniform sharding, with the dry run's cost model.

Both layouts are priced with the same pieces, on the meta device, for a given global batch and hardware
profile (:mod:`lightning_vescale.plan._hardware`):

* compute: the FLOPs of forward and backward counted by ``torch.utils.flop_counter`` on the meta device (the
  model's real ops, each stage on the slice one of its ranks computes) at the profile's FLOP/s per rank, plus
  the profile's ``op_overhead`` per operator dispatched (counted in the same run): a small model on a CPU spends
  more on dispatch than on FLOPs, and a micro-batch pays it again however few samples it holds;
* sharding collectives: the dry run (:func:`~lightning_vescale.plan._dry_run.dry_run`) of each stage's modules on
  its own ranks (or of the whole model on all ranks). An MPMD stage with ``gather_once`` (the default) gathers
  each group once per step and holds the unsharded parameters through the step (``unsharded_bytes``);
  without it, it gathers per micro-batch. It reduces once per step (after the last micro-batch);
* they overlap: a micro-batch takes ``max(compute, AllGathers)``, the uniform step ``max(compute, collectives)``;
* MPMD adds the transfers between stages (activations forward, their gradients back, point to point) and,
  for a stage wider than its pipelines, the team's commands, scatters and gathers (see [Note: teams] in
  ``_team``);
* the pipeline: with per-micro-batch stage times ``t_s`` and ``M`` micro-batches, GPipe and 1F1B both take
  ``sum(t_s) + (M - 1) * max(t_s)`` (plus the once-per-step gathers and ReduceScatters); a stage is busy
  ``M * t_s`` of it, and its *bubble fraction* is the rest.
  (1F1B keeps fewer activations alive, not less idle time.)

Then the optimizer step (the dry run's, per stage; stages step in parallel).

[Note: shared compute]
On a profile with ``shared_compute`` (this CPU: every rank a process on the same ``cores``) a rank computes at
one core's speed, nothing overlaps (the collectives' copies take the same cores), and a rank idle in a bubble
leaves its core to another rank. So the step is the larger of the pipeline's critical path and the machine's
total work (every rank's busy time, summed) divided by ``cores``; the bubble fraction is still the schedule's.
The profile's ``op_overhead`` and ``cores`` were calibrated on this machine against
``benchmarks/mpmd_bench.py`` (CPU seconds per rank and step), see ``benchmarks/results/mpmd.md``.

:func:`choose_layout` ranks the candidates by predicted step time: an MPMD layout is chosen only where it is
predicted faster. :func:`candidate_plans` spans the layouts of one plan's stages: every split of the ranks, both
schedules, every micro-batch count the batch allows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_vescale.pipeline._runtime import (
    _meta_clone,
    _to_meta,
    _with_grad,
    check_batch,
    check_stage_shapes,
    run_chain,
)
from lightning_vescale.pipeline._spec import MPMDPlan
from lightning_vescale.plan import HardwareProfile, OpCounter, Workload, dry_run

__all__ = ["LayoutCost", "StageCost", "candidate_plans", "choose_layout", "predict_mpmd", "predict_uniform"]


@dataclass
class StageCost:
    """One stage of a predicted layout (uniform sharding is one stage over every rank)."""

    name: str
    ranks: int
    compute_seconds: float
    """Forward + backward of one micro-batch on one of the stage's ranks (FLOPs, per-op and per-micro-batch
    overheads)."""
    collective_seconds: float
    """The stage's AllGathers for one micro-batch (0 with ``gather_once``; uniform: all collectives of the step)."""
    transfer_seconds: float
    """Point-to-point to the next stage and back, plus the team's commands, scatters and gathers, per micro-batch."""
    microbatch_seconds: float
    """``max(compute, collectives) + transfers`` (shared compute: the sum)."""
    optimizer_seconds: float
    """The optimizer step (and the per-tensor overheads of the step) on one of the stage's ranks."""
    bubble_fraction: float = 0.0
    """Idle share of the pipeline's time on this stage's ranks."""
    reduce_seconds: float = 0.0
    """MPMD: the stage's ReduceScatters, once per step (gradients accumulate over the micro-batches)."""
    gather_seconds: float = 0.0
    """MPMD with ``gather_once``: the stage's AllGathers, once per step."""
    unsharded_bytes: float = 0.0
    """MPMD with ``gather_once``: the unsharded parameters each rank holds through the step (beyond its shard)."""
    busy_seconds: float = 0.0
    """Time one of the stage's ranks works per step (what it takes of a shared CPU)."""
    ops: int = 0
    """Operators one rank dispatches per micro-batch (forward and backward)."""


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


def _work(modules: Sequence[nn.Module], values: Sequence[Any], input_grads: bool) -> tuple[float, int]:
    """(FLOPs, operators) of forward and backward of ``modules`` on ``values``, run on the meta device."""
    values = tuple(_with_grad(_to_meta(v), input_grads) for v in values)
    with FlopCounterMode(display=False) as counter, OpCounter() as ops:
        out = [o for o in run_chain(modules, values) if isinstance(o, torch.Tensor) and o.requires_grad]
        params = [p for m in modules for p in m.parameters()]
        kept = [p.grad for p in params]
        if out:
            torch.autograd.backward(out, [torch.ones_like(o) for o in out])
    for p, g in zip(params, kept):  # the (possibly caller's) meta model keeps its own .grad
        p.grad = g
    return float(counter.get_total_flops()), ops.ops


def _bytes(values: Sequence[Any]) -> float:
    return float(sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor)))


def _head(values: Sequence[Any], n: int) -> tuple:
    return tuple(v[:n] if isinstance(v, torch.Tensor) else v for v in values)


def _collectives(modules: Mapping[str, nn.Module], plan: Any, ranks: int, hardware: HardwareProfile,
                 precision: str) -> tuple[float, float, float, float, float]:
    """Of ``modules`` sharded by ``plan`` over ``ranks`` ranks, from the dry run: (AllGather seconds per forward
    and backward, ReduceScatter seconds, optimizer seconds, AllGather seconds gathering each group once, the
    gathered bytes beyond the shard)."""
    from lightning_vescale.plan import resolve_for

    container = nn.Module()
    for name, module in modules.items():
        container.add_module(name, module)
    resolved = resolve_for(container, plan)
    est = dry_run(container, resolved, ranks, workload=Workload(batch_size=1, seq_len=1, precision=precision,
                                                               clip_grad=False),
                  hardware=hardware, activations={})
    reduce = sum(hardware.collective_seconds(g["reduce_scatter_bytes"], ranks) for g in est.groups)
    once = sum(hardware.collective_seconds(g["gathered_bytes"] * (ranks - 1) / ranks, ranks) for g in est.groups)
    held = sum(g["gathered_bytes"] for g in est.groups) * (ranks - 1) / ranks
    return est.vescale.comm_seconds - reduce, reduce, est.vescale.optimizer_seconds, once, held


def _link_seconds(nbytes: float, hardware: HardwareProfile, world_size: int, messages: int = 1) -> float:
    if nbytes == 0:
        return 0.0
    link = hardware.link(world_size)
    return messages * link.latency + nbytes / (link.bandwidth * hardware.link_efficiency)


def _rate(hardware: HardwareProfile, dtype: torch.dtype, world_size: int) -> float:
    """FLOP/s of one rank: on a shared CPU one core's (see [Note: shared compute])."""
    if hardware.shared_compute and hardware.cores:
        return hardware.flops_per_rank(dtype, hardware.cores)
    return hardware.flops_per_rank(dtype, world_size)


def _shared(hardware: HardwareProfile) -> bool:
    return bool(hardware.shared_compute and hardware.cores)


def predict_uniform(model: nn.Module, inputs: Sequence[torch.Tensor], world_size: int, hardware: HardwareProfile,
                    *, plan: Any = None, precision: str = "32-true") -> LayoutCost:
    """The whole model sharded over every rank by ``plan`` (data parallel: each rank takes ``1/N`` of the batch)."""
    shadow = model if all(p.is_meta for p in model.parameters()) else _meta_clone(model)
    batch = inputs[0].shape[0]
    if batch % world_size:
        raise ValueError(f"uniform sharding over {world_size} ranks needs a batch divisible by {world_size}, got {batch}")
    dtype = next(shadow.parameters()).dtype
    flops, ops = _work([shadow], _head(inputs, batch // world_size), input_grads=False)
    compute = flops / _rate(hardware, dtype, world_size) + ops * hardware.op_overhead
    gather, reduce, opt, _, _ = _collectives(dict(shadow.named_children()), plan, world_size, hardware, precision)
    opt += sum(1 for _ in shadow.parameters()) * hardware.tensor_overhead
    if _shared(hardware):
        busy = compute + gather + reduce + opt
        step = max(busy, world_size * busy / hardware.cores)
        stage = StageCost("all", world_size, compute, gather + reduce, 0.0, busy - opt, opt, busy_seconds=busy,
                          ops=ops)
        return LayoutCost("uniform", step, 0.0, [stage])
    step = max(compute, gather + reduce)
    stage = StageCost("all", world_size, compute, gather + reduce, 0.0, step, opt, busy_seconds=step + opt, ops=ops)
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
    rate = _rate(hardware, dtype, world)
    shared = _shared(hardware)
    stages = []
    for i, (spec, (stage_in, stage_out)) in enumerate(zip(plan.stages, boundaries)):
        team = spec.ranks // R
        modules = {m: shadow.get_submodule(m) for m in spec.modules}
        flops, ops = _work(list(modules.values()), _head(stage_in, micro // team), input_grads=i > 0)
        compute = flops / rate + ops * hardware.op_overhead + hardware.microbatch_overhead
        gather, reduce, opt, once, held = _collectives(modules, spec.plan, spec.ranks, hardware, precision)
        opt += sum(1 for m in modules.values() for _ in m.parameters()) * hardware.tensor_overhead
        if plan.gather_once:
            gather = 0.0
        else:
            once = held = 0.0
        # Forward: receive the inputs, send the outputs; backward: the reverse (the first stage's inputs and the
        # last stage's loss do not travel). Inside a team: a command (two broadcasts), the inputs scattered and
        # the outputs gathered, and again for the gradients.
        is_last = spec is plan.stages[-1]
        p2p = 2 * _link_seconds(0.0 if is_last else _bytes(stage_out), hardware, world)
        transfers = p2p
        if team > 1:
            n = sum(isinstance(v, torch.Tensor) for v in (*stage_in, *stage_out))
            team_bytes = 2 * (_bytes(stage_in) + _bytes(stage_out)) * (team - 1) / team
            transfers += _link_seconds(team_bytes, hardware, world, messages=2 * (2 + n))
        per_micro = compute + gather + transfers if shared else max(compute, gather) + transfers
        busy = M * per_micro + once + reduce + opt
        stages.append(StageCost(spec.name, spec.ranks, compute, gather, transfers, per_micro, opt,
                                reduce_seconds=reduce, gather_seconds=once, unsharded_bytes=held, busy_seconds=busy,
                                ops=ops))
    times = [s.microbatch_seconds for s in stages]
    # The ReduceScatters run once per step, in the last micro-batch's backward: the first stage's come last. The
    # once-per-step gathers run before each stage's first forward (the first stage's delay everything).
    pipeline = sum(times) + (M - 1) * max(times) + stages[0].gather_seconds + max(s.reduce_seconds for s in stages)
    for s in stages:
        s.bubble_fraction = max(0.0, 1.0 - M * s.microbatch_seconds / pipeline)
    bubble = sum(s.bubble_fraction * s.ranks for s in stages) / world
    step = pipeline + max(s.optimizer_seconds for s in stages)
    if shared:  # see [Note: shared compute]
        step = max(step, sum(s.busy_seconds * s.ranks for s in stages) / hardware.cores)
    return LayoutCost(f"mpmd:{plan.name or 'plan'}", step, bubble, stages)


def choose_layout(model: nn.Module, inputs: Sequence[torch.Tensor], world_size: int, hardware: HardwareProfile,
                  candidates: Sequence[Any], *, uniform_plan: Any = None,
                  precision: str = "32-true") -> tuple[Optional[MPMDPlan], list[LayoutCost]]:
    """Price uniform sharding and every MPMD plan in ``candidates`` (those that fit ``world_size``); return the
    fastest (None: uniform sharding) and every cost, fastest first."""
    costs: list[tuple[Optional[MPMDPlan], LayoutCost]] = [(None, predict_uniform(model, inputs, world_size, hardware, plan=uniform_plan, precision=precision))]
    for candidate in candidates:
        plan = MPMDPlan.from_dict(candidate)
        if plan.world_size == world_size:
            costs.append((plan, predict_mpmd(model, plan, inputs, hardware, precision=precision)))
    costs.sort(key=lambda c: c[1].step_seconds)
    return costs[0][0], [c for _, c in costs]


def _splits(total: int, parts: int) -> list[tuple[int, ...]]:
    """Every way to give ``parts`` stages at least one of ``total`` ranks, in order."""
    if parts == 1:
        return [(total,)]
    return [(first, *rest) for first in range(1, total - parts + 2) for rest in _splits(total - first, parts - 1)]


def candidate_plans(template: Any, world_size: int, batch: int, *, schedules: Sequence[str] = ("1f1b", "gpipe"),
                    max_microbatches: int = 8) -> list[MPMDPlan]:
    """The MPMD layouts of ``template``'s stages (their modules and sharding plans kept) over ``world_size`` ranks:
    every split of the ranks between the stages, each schedule, and every micro-batch count up to
    ``max_microbatches`` that the global ``batch`` splits into (:func:`check_batch`), gathered once per step."""
    base = MPMDPlan.from_dict(template)
    out = []
    for ranks in _splits(world_size, len(base.stages)):
        for schedule in schedules:
            for microbatches in range(1, max_microbatches + 1):
                if schedule == "1f1b" and microbatches < len(base.stages):
                    continue
                stages = tuple(dataclasses.replace(stage, ranks=r) for stage, r in zip(base.stages, ranks))
                name = f"{'+'.join(map(str, ranks))} {schedule} M={microbatches}"
                plan = dataclasses.replace(base, stages=stages, schedule=schedule, microbatches=microbatches,
                                           gather_once=True, name=name)
                try:
                    check_batch(plan, batch)
                except ValueError:
                    continue
                out.append(plan)
    return out

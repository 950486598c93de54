"""``parallelize_mpmd``: sub-models on disjoint groups of ranks, each sharded with its own plan, pipelined with
``torch.distributed.pipelining``.

[Note: how a step runs]
Every rank holds one stage: the stage's top-level sub-modules in an :class:`MPMDModel`, sharded by
:func:`lightning_vescale.parallelize` over the stage's own sub-mesh with the stage's own plan. ``R`` pipelines
(the gcd of the stages' rank counts) each take ``1/R`` of the batch; torch's schedule (GPipe or 1F1B) splits
it into micro-batches and moves activations and gradients between the stages' leaders; a stage of more than
``R`` ranks spreads each micro-batch over its team (see [Note: teams] in ``_team``).

Gradients: a micro-batch's loss is the mean over its samples, and the team's slices of it add up to its
gradient, so the gradient of the step's mean loss is the sum over the stage's ranks divided by
``R * microbatches``: that is the ``gradient_divide_factor`` of every stage's ReduceScatter (torch's
``scale_grads`` is off: it would scale only the leaders' pieces). The result equals one process training
the whole model on the whole batch.

[Note: stage chaining]
A stage calls its sub-modules in the order the plan lists them, the stages in plan order. A sub-module takes
as many leading values as its ``forward`` has positional parameters; its outputs replace them and the
remaining values are carried on. So a vision-language model written plainly as
``decoder(projector(encoder(images)), tokens)`` chains as ``(images, tokens) -> encoder -> (features, tokens)
-> projector -> (embeddings, tokens) -> decoder -> logits``, and the tokens ride along the pipeline.
:func:`check_stage_shapes` runs this chain on the meta device before anything is sharded.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_vescale.pipeline._spec import MPMDPlan, StageSpec
from lightning_vescale.pipeline._team import END, Team, TeamLeader, serve_team
from lightning_vescale.plan import PlanError

logger = logging.getLogger(__name__)

__all__ = ["MPMDModel", "check_batch", "check_stage_plans", "check_stage_shapes", "lm_loss", "parallelize_mpmd"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position (the default loss of :meth:`MPMDModel.step`)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


# --------------------------------------------------------------------------------------------------------
# Chaining sub-modules (pure)


def _arity(module: nn.Module) -> int:
    """How many leading values ``module`` takes: the positional parameters of its forward (no ``*args``)."""
    params = inspect.signature(module.forward).parameters.values()
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return -1  # takes everything
    return sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def run_chain(modules: Sequence[nn.Module], values: Sequence[Any]) -> tuple:
    """Call ``modules`` in turn; each takes its leading values and its outputs replace them (see the note)."""
    values = tuple(values)
    for module in modules:
        k = _arity(module)
        k = len(values) if k < 0 else min(k, len(values))
        out = module(*values[:k])
        values = (out if isinstance(out, tuple) else (out,)) + values[k:]
    return values


def _meta_clone(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers live on the meta device (no data is copied)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def _to_meta(x: Any) -> Any:
    return torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x


def _with_grad(x: Any, requires_grad: bool) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().requires_grad_(requires_grad)
    return x


def _describe(values: Sequence[Any]) -> str:
    return ", ".join(f"{tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}" if isinstance(v, torch.Tensor)
                     else repr(v) for v in values)


def check_stage_shapes(model: nn.Module, plan: MPMDPlan, inputs: Sequence[Any]) -> list[tuple]:
    """Run the stages' chain on the meta device (``model`` may be real or meta; nothing is computed or copied).

    Returns each stage's inputs and outputs as meta tensors (the activations that cross each boundary). A
    stage that cannot take what the previous one gives raises :class:`PlanError` naming both stages and the
    shapes, before any process group is touched.
    """
    shadow = model if all(p.is_meta for p in model.parameters()) else _meta_clone(model)
    values = tuple(_to_meta(x) for x in inputs)
    boundaries = []
    for i, stage in enumerate(plan.stages):
        modules = [shadow.get_submodule(m) for m in stage.modules]
        try:
            with torch.no_grad():
                out = run_chain(modules, values)
        except Exception as err:  # noqa: BLE001 - re-raised with the stage boundary named
            source = f"after stage {plan.stages[i - 1].name!r}" if i else "given as the model's inputs"
            raise PlanError(
                f"MPMD plan {plan.name!r}: stage {stage.name!r} ({', '.join(stage.modules)}) cannot take the "
                f"activations {source}: [{_describe(values)}] ({type(err).__name__}: {err}). Make the stages' "
                f"shapes match (e.g. the projector's output width and the decoder's width)") from None
        boundaries.append((values, out))
        values = out
    return boundaries


def check_stage_plans(model: nn.Module, plan: MPMDPlan) -> None:
    """Resolve every stage's sharding plan against the stage's modules (on the meta device, on every rank, so a
    bad plan of any stage stops every rank before a process group is created)."""
    from lightning_vescale.plan import resolve_for

    shadow = _meta_clone(model)
    for stage in plan.stages:
        container = nn.Module()
        for name in stage.modules:
            container.add_module(name, shadow.get_submodule(name))
        try:
            resolved = resolve_for(container, stage.plan)
        except PlanError as err:
            raise PlanError(f"MPMD plan {plan.name!r}, stage {stage.name!r}: {err}") from None
        off_device = sorted({t for p in resolved.params.values() for t in p.tier.values()} - {"device"})
        if off_device:  # MPMD stages do not run the memory manager yet: say so rather than train on the device
            raise PlanError(f"MPMD plan {plan.name!r}, stage {stage.name!r}: its plan places state on "
                            f"{off_device} tiers, which MPMD stages do not apply yet; keep stage plans on the "
                            f"device (tier: device)")


def check_batch(plan: MPMDPlan, batch: int) -> None:
    """A global batch of ``batch`` samples must split into the pipelines, their micro-batches, and every stage's
    team (equal slices everywhere, so the mean loss and its gradient are the whole batch's)."""
    R, M = plan.num_pipelines, plan.microbatches
    teams = [s.ranks // R for s in plan.stages]
    if batch % (R * M) or any((batch // (R * M)) % t for t in teams):
        need = R * M * math.lcm(*teams)
        raise ValueError(
            f"MPMD plan {plan.name!r}: a batch of {batch} does not split into {R} pipeline(s) x {M} micro-batches "
            f"with every micro-batch divisible by the stages' team sizes {teams}; use a multiple of {need} (or "
            f"change 'microbatches')")


# --------------------------------------------------------------------------------------------------------
# The model


class MPMDModel(nn.Module):
    """This rank's stage of a model trained as MPMD: the stage's sub-modules (under their full-model names, so
    ``state_dict`` keys are the model's), sharded over the stage's sub-mesh, and the pipeline around them.

    Build it with :func:`lightning_vescale.parallelize` and an MPMD plan (or :func:`parallelize_mpmd`).
    ``parameters()`` are this stage's: an optimizer built on them steps this group only.
    :meth:`step` runs one pipelined forward and backward of the whole model on the whole batch;
    :meth:`clip_grad_norm_` clips by the norm over all stages.
    """

    plan: MPMDPlan  # set with object.__setattr__ (not a submodule)
    _shadow: nn.Module

    def __init__(self, model: nn.Module, plan: MPMDPlan, stage_index: int) -> None:
        super().__init__()
        spec = plan.stages[stage_index]
        for name in spec.modules:
            self.add_module(name, model.get_submodule(name))
        object.__setattr__(self, "plan", plan)
        self.stage_index = stage_index
        self.num_stages = len(plan.stages)
        object.__setattr__(self, "_shadow", _meta_clone(model))
        # Activations cross stage boundaries in the model's own dtype, whatever a stage computes in (a stage
        # with param_dtype bf16 sends fp32): the pipeline's receive buffers are laid out from the model.
        self._boundary_dtype = next(self._shadow.parameters()).dtype
        self._runtime: _Runtime | None = None
        self._calls = 0
        self._sync_at: int | None = None  # the forward call whose backward reduces the step's gradients
        self._planned_reshard: list[bool] | None = None  # the groups' reshard_after_forward while kept gathered
        self._groups_cache: list | None = None

    @property
    def spec(self) -> StageSpec:
        return self.plan.stages[self.stage_index]

    def forward(self, *values: Any) -> Any:
        """This stage's chain (the pipeline calls it per micro-batch slice)."""
        out = run_chain([getattr(self, m) for m in self.spec.modules], values)
        # torch's pipeline sends outputs as they are: carried inputs may be views of the batch
        out = tuple(self._boundary(o) for o in out)
        call, self._calls = self._calls, self._calls + 1
        if call == self._sync_at:
            # [Note: one ReduceScatter per step] this micro-batch's backward comes last on this stage (GPipe and
            # 1F1B run backward in micro-batch order): the gradients of all micro-batches, accumulated unsharded,
            # are reduced as its backward starts. [Note: one AllGather per step] likewise, with gather_once the
            # parameters gathered by the first micro-batch stay unsharded until this backward, which frees them
            # group by group as it goes.
            needing = [o for o in out if isinstance(o, torch.Tensor) and o.requires_grad]
            if needing:
                torch.autograd.graph.register_multi_grad_hook(needing, lambda _: self._last_backward(), mode="any")
        return out if len(out) > 1 else out[0]

    def _last_backward(self) -> None:
        self._set_sync(True)
        self._keep_gathered(False)

    def _boundary(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.is_floating_point() and x.dtype != self._boundary_dtype:
            x = x.to(self._boundary_dtype)
        return x.contiguous()

    @property
    def _groups(self) -> list:
        """The stage's sharded groups (found once: walking the modules every micro-batch is measurable here)."""
        if self._groups_cache is None:
            from lightning_vescale.engine.fully_shard import sharded_groups

            self._groups_cache = sharded_groups(self)
        return self._groups_cache

    def _set_sync(self, enabled: bool) -> None:
        """``set_gradient_sync`` on every group of the stage."""
        for g in self._groups:
            g.requires_grad_sync = enabled

    def _keep_gathered(self, keep: bool) -> None:
        """Keep every group's parameters unsharded after forward and backward (True) or restore the plan's
        resharding (False). Freeing is left to the groups' own hooks and to :meth:`_reshard`."""
        groups = self._groups
        if keep and self._planned_reshard is None:
            self._planned_reshard = [g.reshard_after_forward for g in groups]
        elif not keep and self._planned_reshard is not None:
            for g, planned in zip(groups, self._planned_reshard):
                g.reshard_after_forward = planned
            self._planned_reshard = None
        for g in groups:
            if keep:
                g.reshard_after_forward = False
            g.reshard_after_backward = not keep

    def _reshard(self) -> None:
        for group in self._groups:
            group.reshard()

    # The runtime (set up by parallelize_mpmd)
    @property
    def mesh(self) -> DeviceMesh:
        """The stage's sub-mesh."""
        return self._rt.mesh

    @property
    def _rt(self) -> _Runtime:
        if self._runtime is None:
            raise RuntimeError("this MPMDModel was not set up by parallelize_mpmd")
        return self._runtime

    def step(self, *inputs: torch.Tensor, target: torch.Tensor, loss_fn: LossFn | None = None) -> torch.Tensor:
        """One forward and backward of the whole model on the whole batch (collective over every rank).

        Every rank passes the same global batch (``inputs`` of the first stage, ``target`` of the loss); each
        pipeline takes its part. Gradients accumulate into this stage's parameters (call the optimizer after).
        Returns the mean loss over the batch, on every rank.
        """
        return self._rt.step(inputs, target, loss_fn or lm_loss)

    @torch.no_grad()
    def evaluate(self, *inputs: torch.Tensor, target: torch.Tensor, loss_fn: LossFn | None = None) -> torch.Tensor:
        """The mean loss over the batch, forward only through the pipeline (collective over every rank)."""
        return self._rt.step(inputs, target, loss_fn or lm_loss, train=False)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every stage's gradients by the norm over all stages (collective over every rank); returns it."""
        rt = self._rt
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type, foreach=True) if grads else torch.zeros(())
        norm = norm.detach().to(rt.device, torch.float32).reshape(())
        # Every rank of a stage holds the stage's whole norm: count it once, from the stage's first rank.
        mine = norm ** norm_type if rt.is_stage_first else torch.zeros_like(norm)
        if norm_type == float("inf"):
            mine = norm if rt.is_stage_first else torch.zeros_like(norm)
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            total = mine
        else:
            dist.all_reduce(mine)
            total = mine ** (1.0 / norm_type)
        params = [p for p in self.parameters() if p.grad is not None]
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
        return total


# --------------------------------------------------------------------------------------------------------
# Building it


def _gradient_divide_factor(num_pipelines: int, microbatches: int) -> float:
    """See [Note: how a step runs]: the sum over a stage's ranks, divided by this, is the step's mean gradient."""
    return float(num_pipelines * microbatches)


class _Runtime:
    """Groups, team and schedules of one rank (built collectively by every rank, in the same order)."""

    def __init__(self, model: MPMDModel, plan: MPMDPlan, device: torch.device, timeout: Any) -> None:
        rank = dist.get_rank()
        self.plan = plan
        self.device = device
        self.model = model
        ranges = plan.rank_ranges()
        R = plan.num_pipelines
        self.num_pipelines = R
        kwargs = {} if timeout is None else {"timeout": timeout}
        # new_group is collective over the default group: every rank creates every group in the same order.
        stage_groups = [dist.new_group(list(r), **kwargs) for r in ranges]
        team_sizes = [len(r) // R for r in ranges]
        leaders = [[r.start + p * t for r, t in zip(ranges, team_sizes)] for p in range(R)]
        pipeline_groups = [dist.new_group(ls, **kwargs) for ls in leaders]
        teams = {}
        for g, (r, t) in enumerate(zip(ranges, team_sizes)):
            for p in range(R):
                members = list(range(r.start + p * t, r.start + (p + 1) * t))
                teams[(g, p)] = (members, dist.new_group(members, **kwargs) if t > 1 else None)
        g = model.stage_index
        self.stage_ranks = list(ranges[g])
        self.is_stage_first = rank == ranges[g].start
        self.pipeline = (rank - ranges[g].start) // team_sizes[g]
        self.team_sizes = team_sizes
        members, team_group = teams[(g, self.pipeline)]
        self.team = Team(team_group, device) if team_group is not None else None
        self.is_leader = rank == members[0]
        self.pipeline_group = pipeline_groups[self.pipeline]
        self.mesh = DeviceMesh.from_group(stage_groups[g], device.type)
        self._schedules: dict[tuple, Any] = {}
        self._loss_fn: LossFn = lm_loss

    def _schedule(self, inputs: Sequence[torch.Tensor]) -> tuple[Any, nn.Module]:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
        )

        M = self.plan.microbatches
        micro = tuple(x[: x.shape[0] // M] for x in inputs)
        key = tuple((tuple(x.shape), x.dtype) for x in micro)
        if key not in self._schedules:
            boundaries = check_stage_shapes(self.model._shadow, self.plan, micro)
            # Activations crossing a boundary carry gradients (floating ones); the first stage's inputs do not.
            stage_in, stage_out = (tuple(_with_grad(v, i > 0 or j > 0) for v in values)
                                   for j, values in enumerate(boundaries[self.model.stage_index])
                                   for i in [self.model.stage_index])
            submod = TeamLeader(self.model, self.team) if self.team is not None else self.model
            stage = PipelineStage(
                submod, self.model.stage_index, self.model.num_stages, self.device,
                input_args=tuple(stage_in), output_args=stage_out if len(stage_out) > 1 else stage_out[0],
                group=self.pipeline_group,
            )
            cls = ScheduleGPipe if self.plan.schedule == "gpipe" else Schedule1F1B
            schedule = cls(stage, n_microbatches=M, loss_fn=lambda out, tgt: self._loss_fn(out, tgt),
                           scale_grads=False)
            self._schedules[key] = (schedule, submod)
        return self._schedules[key]

    def step(self, inputs: Sequence[torch.Tensor], target: torch.Tensor, loss_fn: LossFn,
             train: bool = True) -> torch.Tensor:
        if not inputs:
            raise ValueError("MPMD step: give the first stage's inputs")
        batch = inputs[0].shape[0]
        check_batch(self.plan, batch)
        part = batch // self.num_pipelines
        mine = slice(self.pipeline * part, (self.pipeline + 1) * part)
        inputs = tuple(x[mine].to(self.device) for x in inputs)
        target = target[mine].to(self.device)
        self._loss_fn = loss_fn
        g, last = self.model.stage_index, self.model.num_stages - 1
        loss = torch.zeros((), device=self.device)
        if not train:
            self._run(inputs, target, g, last, loss, train=False)
            dist.all_reduce(loss)
            return loss
        # Gradients accumulate unsharded over the micro-batches and are reduced once, in the last one's backward;
        # with gather_once the parameters are gathered once and freed in that backward too.
        self.model._calls, self.model._sync_at = 0, self.plan.microbatches - 1
        self.model._set_sync(False)
        if self.plan.gather_once:
            self.model._keep_gathered(True)
        try:
            self._run(inputs, target, g, last, loss)
        finally:
            self.model._sync_at = None
            self.model._set_sync(True)
            if self.plan.gather_once:
                self.model._keep_gathered(False)
                self.model._reshard()  # (already done by the last backward; an interrupted step frees here)
        dist.all_reduce(loss)  # only the last stage's leaders contribute
        return loss

    def _run(self, inputs: tuple, target: torch.Tensor, g: int, last: int, loss: torch.Tensor,
             train: bool = True) -> None:
        if self.is_leader:
            schedule, submod = self._schedule(inputs)
            if isinstance(submod, TeamLeader):
                submod.start_step()
            run = schedule.step if train else schedule.eval
            losses: list[torch.Tensor] = []
            args = inputs if g == 0 else ()
            if g == last:
                run(*args, target=target, losses=losses, return_outputs=False)
                loss.copy_(torch.stack([x.detach().float() for x in losses]).mean() / self.num_pipelines)
            else:
                run(*args, return_outputs=False)
            if self.team is not None:
                self.team.command((END,))
        else:
            assert self.team is not None  # a rank that is not its team's leader is in a team
            serve_team(self.model, self.team, self.device)


def parallelize_mpmd(
    model: nn.Module,
    plan: MPMDPlan | Mapping[str, Any],
    *,
    example_inputs: Sequence[torch.Tensor] | None = None,
    device: torch.device | None = None,
    sync_module_states: bool = False,
    timeout: Any = None,
) -> MPMDModel:
    """Place ``model``'s top-level sub-modules on groups of ranks as ``plan`` says and shard each stage with its
    own plan over its own sub-mesh; returns this rank's :class:`MPMDModel`.

    Collective over every rank of the default process group (it creates the stages' sub-meshes, the
    pipelines' groups and the teams with ``torch.distributed.new_group``). Before any of that: the plan is
    checked against the world size (the stages' ranks must add up to it) and the model (every named module
    exists and is top-level, no module or parameter is in two stages, every parameter is in a stage), and with
    ``example_inputs`` (a global batch, or one like it) the activations are checked to fit from stage to stage
    (on the meta device). A bad plan raises :class:`~lightning_vescale.plan.PlanError` on every rank.

    The sub-modules of the other stages are moved to the meta device on this rank (their memory is freed);
    ``model`` is consumed, as :func:`lightning_vescale.parallelize` shards in place.

    Args:
        model: the whole model, unsharded, the same on every rank (same seed), or set
            ``sync_module_states`` to copy each stage's first rank's weights to the stage.
        plan: an :class:`MPMDPlan` or its dict form (see :mod:`lightning_vescale.pipeline`).
        example_inputs: the first stage's inputs for the shape check before anything is built.
        device: where this rank computes (default: CPU, or the current CUDA device when CUDA is available).
        sync_module_states: broadcast each stage's weights from the stage's first rank.
        timeout: timeout of the process groups created (default: torch's).
    """
    from lightning_vescale.parallel.spmd import parallelize_spmd as parallelize

    plan = MPMDPlan.from_dict(plan)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("parallelize with an MPMD plan needs an initialized process group (one rank per process)")
    plan.check_world_size(dist.get_world_size())
    plan.check_model(model)
    check_stage_plans(model, plan)
    if example_inputs is not None:
        check_stage_shapes(model, plan, example_inputs)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    rank = dist.get_rank()
    stage_index = next(i for i, r in enumerate(plan.rank_ranges()) if rank in r)
    stage = MPMDModel(model, plan, stage_index)
    for i, other in enumerate(plan.stages):
        if i != stage_index:
            for name in other.modules:
                model.get_submodule(name).to("meta")  # this rank never runs them
    runtime = _Runtime(stage, plan, device, timeout)
    parallelize(stage, stage.spec.plan, runtime.mesh, sync_module_states=sync_module_states,
                gradient_divide_factor=_gradient_divide_factor(plan.num_pipelines, plan.microbatches))
    stage._runtime = runtime
    logger.debug("lightning_vescale: rank %d runs MPMD stage %r (%d ranks, pipeline %d of %d)", rank,
                 stage.spec.name, len(runtime.stage_ranks), runtime.pipeline, runtime.num_pipelines)
    return stage

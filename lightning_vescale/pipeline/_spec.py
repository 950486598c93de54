"""What an MPMD plan says: which top-level sub-modules run on how many ranks, each group with its own sharding plan.

An MPMD plan is data (a dict / YAML file), checked here without any process group::

    version: 1
    name: vlm_mpmd
    schedule: 1f1b            # gpipe | 1f1b (torch.distributed.pipelining)
    microbatches: 4           # per pipeline and step
    gather_once: true         # a stage gathers its parameters once per step, not per micro-batch
    stages:                   # in the order the data flows
      - name: vision
        modules: [encoder, projector]
        ranks: 1
        plan: {rules: [{match: "**.blocks.*", group: true}]}
      - name: language
        modules: [decoder]
        ranks: 3
        plan: llama           # a plan name from configs/plan/, a plan file or a plan dict

Stages take consecutive ranks in their order (the first ``ranks`` ranks run the first stage). Every
``plan`` is an ordinary sharding plan (:mod:`lightning_vescale.plan`), resolved against the stage's modules
under their full-model names, so ``plan: llama`` matches ``decoder.layers.*``.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Union

from torch import nn

from lightning_vescale.plan import Plan, PlanError, is_mpmd_plan, load_plan

__all__ = ["SCHEDULES", "MPMDPlan", "StageSpec", "is_mpmd_plan"]

SCHEDULES = ("gpipe", "1f1b")
"""Schedules of ``torch.distributed.pipelining`` an MPMD plan can name."""

_PLAN_KEYS = ("version", "name", "description", "schedule", "microbatches", "gather_once", "stages")
_STAGE_KEYS = ("name", "modules", "ranks", "plan")


def _unknown(given: Mapping, allowed: tuple, what: str) -> None:
    bad = [k for k in given if k not in allowed]
    if bad:
        hints = [f"{k!r}" + (f" (did you mean {c[0]!r}?)" if (c := difflib.get_close_matches(str(k), allowed, n=1)) else "")
                 for k in bad]
        raise PlanError(f"{what}: unknown key(s) {', '.join(hints)}; allowed: {', '.join(allowed)}")


@dataclass(frozen=True)
class StageSpec:
    """One stage of an MPMD plan: top-level sub-modules, a number of ranks, a sharding plan."""

    name: str
    """A name for messages and checkpoint directories."""
    modules: tuple[str, ...]
    """Top-level sub-modules of the model this stage runs, in call order (see :class:`MPMDModel`)."""
    ranks: int
    """How many ranks run this stage (its sub-mesh); stages may differ."""
    plan: Plan | None = None
    """The stage's sharding plan (None: the default plan, every ModuleList of identical blocks a group)."""


@dataclass(frozen=True)
class MPMDPlan:
    """Stages of a model placed on disjoint groups of ranks and pipelined (see :mod:`lightning_vescale.pipeline`)."""

    stages: tuple[StageSpec, ...]
    """The stages, in the order the data flows; at least two."""
    schedule: str = "1f1b"
    """``gpipe`` or ``1f1b``."""
    microbatches: int = 4
    """Micro-batches per pipeline and step (each pipeline gets an equal part of the batch)."""
    gather_once: bool = True
    """A stage gathers its sharded parameters once per step and keeps them unsharded across its micro-batches
    (freed during the last one's backward): one AllGather per group and step instead of two per micro-batch,
    for holding the stage's unsharded parameters through the step. False: gather per micro-batch."""
    name: str = ""
    description: str = ""
    version: int = 1
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        what = f"MPMD plan {self.name!r}" if self.name else "MPMD plan"
        if self.version != 1:
            raise PlanError(f"{what}: version {self.version!r} is not supported (this library reads version 1)")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"{what}: schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise PlanError(f"{what}: microbatches must be a positive number, got {self.microbatches!r}")
        if not isinstance(self.gather_once, bool):
            raise PlanError(f"{what}: gather_once must be true or false, got {self.gather_once!r}")
        if len(self.stages) < 2:
            raise PlanError(f"{what}: an MPMD plan needs at least two stages, got {len(self.stages)}; for one group "
                            f"of ranks use an ordinary plan")
        seen: dict[str, str] = {}
        for stage in self.stages:
            for m in stage.modules:
                if m in seen:
                    raise PlanError(f"{what}: module {m!r} is assigned to stage {seen[m]!r} and to stage {stage.name!r}; "
                                    f"a sub-module runs in exactly one stage")
                seen[m] = stage.name
        if self.schedule == "1f1b" and self.microbatches < len(self.stages):
            raise PlanError(f"{what}: schedule 1f1b needs at least as many micro-batches as stages "
                            f"({len(self.stages)}), got microbatches={self.microbatches}")
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise PlanError(f"{what}: stage names must differ, got {names}")

    @property
    def world_size(self) -> int:
        """The number of ranks the plan needs (the sum of the stages' ranks)."""
        return sum(s.ranks for s in self.stages)

    @property
    def num_pipelines(self) -> int:
        """How many pipelines run side by side: the greatest common divisor of the stages' rank counts (each
        pipeline takes an equal team of every stage's ranks; see [Note: teams] in ``_runtime``)."""
        return math.gcd(*(s.ranks for s in self.stages))

    def rank_ranges(self) -> list[range]:
        """The global ranks of each stage: consecutive, in stage order."""
        out, start = [], 0
        for s in self.stages:
            out.append(range(start, start + s.ranks))
            start += s.ranks
        return out

    # -- checks against a world size and a model ---------------------------------------------------------------
    def check_world_size(self, world_size: int) -> None:
        if self.world_size != world_size:
            counts = " + ".join(f"{s.ranks} ({s.name})" for s in self.stages)
            raise PlanError(f"MPMD plan {self.name!r}: the stages' ranks add up to {counts} = {self.world_size}, but "
                            f"the world has {world_size} ranks; change the stages' 'ranks' so they add up to "
                            f"{world_size}")

    def check_model(self, model: nn.Module) -> None:
        """Every named module is a top-level sub-module, every parameter belongs to exactly one stage."""
        children = dict(model.named_children())
        for stage in self.stages:
            for m in stage.modules:
                if m not in children:
                    close = difflib.get_close_matches(m, list(children), n=1)
                    raise PlanError(
                        f"MPMD plan {self.name!r}, stage {stage.name!r}: {type(model).__name__} has no top-level "
                        f"sub-module {m!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                        + f"; its top-level sub-modules are {', '.join(children)}")
        placed = {m for s in self.stages for m in s.modules}
        owner: dict[int, str] = {}
        for stage in self.stages:
            for m in stage.modules:
                for name, p in children[m].named_parameters(prefix=m):
                    if id(p) in owner and owner[id(p)] != stage.name:
                        raise PlanError(
                            f"MPMD plan {self.name!r}: parameter {name} is shared by stages {owner[id(p)]!r} and "
                            f"{stage.name!r} (tied weights); a parameter lives in one stage: untie it or put both "
                            f"modules in one stage")
                    owner[id(p)] = stage.name
        loose = [n for n, c in children.items() if n not in placed and any(True for _ in c.parameters(recurse=True))]
        direct = [n for n, _ in model.named_parameters(recurse=False)]
        if loose or direct:
            raise PlanError(f"MPMD plan {self.name!r}: {', '.join(loose + direct)} hold(s) parameters but no stage runs "
                            f"them; add them to a stage's 'modules'")

    # -- (de)serialization ----------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Union[MPMDPlan, Mapping[str, Any]]) -> MPMDPlan:
        if isinstance(data, MPMDPlan):
            return data
        if not isinstance(data, Mapping):
            raise PlanError(f"an MPMD plan must be a mapping with 'stages', got {data!r}")
        _unknown(data, _PLAN_KEYS, "MPMD plan")
        stages_data = data.get("stages")
        if not isinstance(stages_data, (list, tuple)) or not stages_data:
            raise PlanError(f"MPMD plan: 'stages' must be a list of stages ({', '.join(_STAGE_KEYS)}), "
                            f"got {stages_data!r}")
        return cls(
            stages=tuple(_stage_from_dict(s, i) for i, s in enumerate(stages_data)),
            schedule=str(data.get("schedule", "1f1b")).lower(), microbatches=data.get("microbatches", 4),
            gather_once=data.get("gather_once", True),
            name=str(data.get("name") or ""), description=str(data.get("description") or ""),
            version=data.get("version", 1),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.version}
        if self.name:
            out["name"] = self.name
        out.update(schedule=self.schedule, microbatches=self.microbatches, gather_once=self.gather_once)
        out["stages"] = [
            {"name": s.name, "modules": list(s.modules), "ranks": s.ranks,
             **({"plan": s.plan.to_dict()} if s.plan is not None else {})}
            for s in self.stages
        ]
        return out


def _stage_from_dict(data: Any, index: int) -> StageSpec:
    what = f"MPMD plan, stage #{index + 1}"
    if not isinstance(data, Mapping):
        raise PlanError(f"{what}: a stage must be a mapping with {', '.join(_STAGE_KEYS)}, got {data!r}")
    _unknown(data, _STAGE_KEYS, what)
    name = str(data.get("name") or f"stage{index}")
    modules = data.get("modules")
    if isinstance(modules, str):
        modules = [modules]
    if not modules or not all(isinstance(m, str) for m in modules):
        raise PlanError(f"{what} ({name!r}): 'modules' must list the top-level sub-modules it runs, got {modules!r}")
    ranks = data.get("ranks")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise PlanError(f"{what} ({name!r}): 'ranks' must be a positive number of ranks, got {ranks!r}")
    plan = data.get("plan")
    try:
        plan = None if plan is None else load_plan(dict(plan) if isinstance(plan, Mapping) else plan)
    except PlanError as err:
        raise PlanError(f"{what} ({name!r}): {err}") from None
    return StageSpec(name=name, modules=tuple(modules), ranks=ranks, plan=plan)


def load_mpmd_plan(source: MPMDPlan | Mapping[str, Any]) -> MPMDPlan:
    return MPMDPlan.from_dict(source)

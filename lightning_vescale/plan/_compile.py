"""Compile what the integrations take besides a plan (an auto-wrap policy, a granularity, a precision policy, the
strategies' ``reshard_after_forward``) into a resolved plan: one function decides, for the applier
(:func:`lightning_vescale.parallelize`), the strategies, the MPMD stages' cost model and the dry run alike.

Pure: no process group. Also the module selection those defaults use (:func:`select_blocks`, :func:`top_level_roots`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable, Optional, TypeGuard, Union

import torch.nn as nn

from lightning_vescale.engine.fully_shard import GranularityArg, _granularity_fn, get_state, granularity_by_pattern
from lightning_vescale.engine.policies import MixedPrecisionPolicy
from lightning_vescale.plan._files import load_plan
from lightning_vescale.plan._resolve import ResolvedPlan, default_plan, plan_from_modules, resolve_plan
from lightning_vescale.plan._spec import Plan, PlanError, dtype_name

__all__ = [
    "AutoWrapPolicy", "PlanLike", "check_expert_parallel_ready", "expert_modules", "has_experts", "is_sharded", "resolve_for",
    "select_blocks", "top_level_roots",
]

PlanLike = Union[None, Plan, ResolvedPlan, Mapping[str, Any], str, os.PathLike]
"""A :class:`~lightning_vescale.plan.Plan`, its dict form, a plan file or the name of a plan in ``configs/plan/``, a
resolved plan, or None (the default plan: every element of a ``ModuleList`` of identical blocks is a group)."""

AutoWrapPolicy = Union[None, Iterable[type], Callable[[nn.Module], bool]]
"""Which submodules become their own group: ``None`` (default: every element of an ``nn.ModuleList`` whose
elements share one class, e.g. transformer blocks), a set of module classes, or a callable ``module -> bool``."""


def _is_block_list(module: nn.Module) -> TypeGuard[nn.ModuleList]:
    if not isinstance(module, nn.ModuleList) or len(module) == 0:
        return False
    if len({type(m) for m in module}) != 1:
        return False
    return any(True for _ in module[0].parameters())


def _import_class(path: str) -> type:
    """``"torch.nn.TransformerEncoderLayer"`` -> the class (so Hydra configs can name block classes)."""
    module_name, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        raise ValueError(f"auto_wrap_policy names {path!r}, which is not an importable class path") from None


def select_blocks(root: nn.Module, policy: AutoWrapPolicy = None) -> list[nn.Module]:
    """The submodules of ``root`` that get their own group, descendants before ancestors (the order
    ``fully_shard`` must be applied in)."""
    if policy is None:
        blocks: list[nn.Module] = []

        def visit(module: nn.Module) -> None:
            for child in module.children():
                if _is_block_list(child):
                    blocks.extend(child)  # the blocks' insides stay in the block's group
                else:
                    visit(child)

        visit(root)
        return blocks
    if callable(policy) and not isinstance(policy, type):
        predicate = policy
    else:
        if isinstance(policy, (str, type)):
            policy = [policy]
        classes = tuple(_import_class(c) if isinstance(c, str) else c for c in policy)
        if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError(
                f"auto_wrap_policy must be a set of nn.Module classes or a callable module -> bool, got {policy!r}"
            )
        predicate = lambda m: isinstance(m, classes)  # noqa: E731
    chosen = [m for m in root.modules() if m is not root and predicate(m)]
    # modules() is pre-order: reversing it puts every descendant before its ancestors.
    return [m for m in reversed(chosen) if any(True for _ in m.parameters())]


def top_level_roots(module: nn.Module) -> list[nn.Module]:
    """The roots for a LightningModule: each child that holds parameters (containers are looked through).

    A LightningModule's ``training_step`` calls its submodules directly (``self.model(x)``), so its
    children — not the LightningModule itself — are the modules whose forward the engine can hook.
    Parameters the LightningModule registers directly (a learned position embedding, a CLS token) belong to
    no child: :func:`parallelize` puts them in the LightningModule's own group, as FSDP2 puts every
    parameter no group claims into the root's.
    """
    roots: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if not any(True for _ in child.parameters()):
                continue
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                visit(child)  # containers are never called; their elements are
            else:
                roots.append(child)

    visit(module)
    return roots


def is_sharded(module: nn.Module) -> bool:
    return any(get_state(m) is not None for m in module.modules())


def has_experts(module: nn.Module) -> bool:
    from lightning_vescale.models.moe import GroupedExperts

    return any(isinstance(m, GroupedExperts) for m in module.modules())


def check_expert_parallel_ready(module: nn.Module) -> None:
    """Expert parallelism splits real experts of an unsharded MoE: say what is wrong before anything changes."""
    if is_sharded(module):
        raise ValueError(
            "expert_parallel_size > 1 shards the model itself; a model sharded in configure_model() is not "
            "supported with it. Leave the sharding to the strategy, or call fully_shard_expert_parallel yourself "
            "and keep expert_parallel_size=1."
        )
    if not has_experts(module):
        raise ValueError(
            f"expert_parallel_size > 1 but {type(module).__name__} has no expert modules (GroupedExperts, e.g. "
            f"lightning_vescale.models.MoE): set expert_parallel_size=1 for a model without experts"
        )
    if any(p.is_meta for p in module.parameters()):
        raise ValueError(
            "expert_parallel_size > 1 needs the model's real weights before sharding (experts identical on every "
            "rank, then split): don't build it on the meta device (trainer.init_module(empty_init=True))"
        )


# --------------------------------------------------------------------------------------------------------
# Plans


def expert_modules(model: nn.Module) -> list[nn.Module]:
    from lightning_vescale.models.moe import GroupedExperts

    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def resolve_for(
    model: nn.Module,
    plan: PlanLike = None,
    *,
    roots: Optional[Sequence[nn.Module]] = None,
    mp_policy: Optional[MixedPrecisionPolicy] = None,
    defaults: Optional[Mapping[str, Any]] = None,
    granularity: GranularityArg = None,
    auto_wrap_policy: AutoWrapPolicy = None,
    expert_parallel: bool = False,
    tensor_parallel: bool = False,
) -> ResolvedPlan:
    """The plan :func:`parallelize` applies, resolved (pure: no process group). Takes the integrations'
    older arguments too and turns them into the plan's terms: ``auto_wrap_policy`` selects the groups (instead
    of a plan), ``granularity`` (as ``fully_shard`` takes it, or ``"muon"``), ``mp_policy``'s dtypes and
    ``defaults`` (e.g. ``{"reshard_after_forward": False}``) apply where the plan sets nothing.

    With ``tensor_parallel`` (a mesh with a tp dimension) every module the plan gives ``tp: split_tokens`` is a
    group of its own (its whole parameters are sharded over every rank, see [Note: experts on ep, attention on tp]
    in :mod:`lightning_vescale.parallel.tensor_parallel`); at tp 1 the plan's groups are as written."""
    if isinstance(plan, ResolvedPlan):
        return plan
    if plan is not None and auto_wrap_policy is not None:
        raise PlanError(
            "both a plan and an auto_wrap_policy were given; the plan's group rules decide the groups: drop "
            "auto_wrap_policy (or drop the plan)"
        )
    if isinstance(plan, (str, os.PathLike)):
        plan = load_plan(plan)
    if plan is None:
        if auto_wrap_policy is not None:
            plan = plan_from_modules(model, select_blocks(model, auto_wrap_policy))
        else:
            plan = _default_plan_of_remainder(model)
        if expert_parallel:
            # Expert parallelism shards each expert module over the "dp" ranks, in a group of its own.
            extra = plan_from_modules(model, expert_modules(model), name="experts")
            plan = Plan(rules=plan.rules + extra.rules, fallback=plan.fallback, name=plan.name or "default")
    caller: dict[str, Any] = dict(defaults or {})
    if mp_policy is not None:
        caller.setdefault("param_dtype", dtype_name(mp_policy.param_dtype))
        caller.setdefault("reduce_dtype", dtype_name(mp_policy.reduce_dtype))
    fallback = None
    if isinstance(granularity, (str, int)) and not isinstance(granularity, bool):
        caller.setdefault("granularity", granularity)
    elif granularity is not None:
        if isinstance(granularity, Mapping):
            granularity = granularity_by_pattern(model, granularity)  # the model's names; a miss is an error now
        fn = _granularity_fn(granularity)
        fallback = lambda full, inner, p: fn(inner, p)  # noqa: E731 - names inside the group, as fully_shard gives
    resolved = resolve_plan(model, plan, roots=roots, defaults=caller, granularity_fallback=fallback)
    if tensor_parallel:
        from lightning_vescale.plan._tp_rules import token_split_modules

        grouped = {g.name for g in resolved.groups}
        loose = [n for n in token_split_modules(resolved.tensor_parallel) if n not in grouped]
        if loose:
            modules = dict(model.named_modules())
            extra = plan_from_modules(model, [modules[n] for n in loose], name="split_tokens")
            plan = dataclasses.replace(resolved.plan, rules=resolved.plan.rules + extra.rules)
            resolved = resolve_plan(model, plan, roots=roots, defaults=caller, granularity_fallback=fallback)
    return resolved


def _default_plan_of_remainder(model: nn.Module) -> Plan:
    """:func:`~lightning_vescale.plan.default_plan` for the modules not sharded yet (a model partly sharded by
    the user in ``configure_model`` keeps those groups)."""
    if not is_sharded(model):
        return default_plan(model)
    unsharded = [m for m in select_blocks(model) if not is_sharded(m)]
    return plan_from_modules(model, unsharded, name="default")



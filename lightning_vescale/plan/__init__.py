"""Declarative sharding plans: one file decides groups, granularity, precision, prefetch, optimizer routing,
quantization and memory tiers.

A plan is ordered rules keyed by globs on full-model names (``layers.*``, ``**.experts``, ``**.weight``)::

    version: 1
    name: llama
    fallback: {reshard_after_forward: true, prefetch: 1}
    rules:
      - {match: "**.layers.*", group: true}                    # each transformer block is a group
      - {match: "**.tok_embeddings.weight", optimizer: adamw}
      - {match: "**.layers.*.attention.w*.weight", granularity: row}

:func:`resolve_plan` applies it to a model and returns a :class:`ResolvedPlan` with exactly one
:class:`ParamPolicy` per parameter (printable as a table, serializable to YAML); rules that match nothing,
conflicting rules and uncovered parameters are :class:`PlanError` s naming the rule.
:func:`lightning_vescale.parallelize` applies it. ``python -m lightning_vescale.plan`` sizes a run on the
meta device (bytes per rank, collectives, padding, predicted step time) without any device.
"""

from lightning_vescale.plan._compile import (
    AutoWrapPolicy,
    PlanLike,
    check_expert_parallel_ready,
    expert_modules,
    has_experts,
    is_sharded,
    resolve_for,
    select_blocks,
    top_level_roots,
)
from lightning_vescale.plan._dry_run import Workload, dry_run
from lightning_vescale.plan._files import load_plan, plan_names
from lightning_vescale.plan._hardware import HardwareProfile, OpCounter, load_profile
from lightning_vescale.plan._registry import mark_tiers_applied, policy_of, register_policy
from lightning_vescale.plan._resolve import (
    GroupPolicy,
    ParamPolicy,
    ResolvedPlan,
    default_plan,
    embedding_groups,
    plan_from_modules,
    resolve_plan,
)
from lightning_vescale.plan._spec import (
    GRANULARITY_WORDS,
    Plan,
    PlanError,
    Rule,
    is_mpmd_plan,
    parse_dtype,
    tp_style_name,
)
from lightning_vescale.plan._tp_rules import check_tensor_parallel, token_split_modules

__all__ = [
    "AutoWrapPolicy",
    "GRANULARITY_WORDS",
    "GroupPolicy",
    "HardwareProfile",
    "OpCounter",
    "ParamPolicy",
    "Plan",
    "PlanError",
    "PlanLike",
    "ResolvedPlan",
    "Rule",
    "Workload",
    "check_expert_parallel_ready",
    "check_tensor_parallel",
    "default_plan",
    "dry_run",
    "embedding_groups",
    "expert_modules",
    "has_experts",
    "is_mpmd_plan",
    "is_sharded",
    "load_plan",
    "load_profile",
    "mark_tiers_applied",
    "parse_dtype",
    "plan_from_modules",
    "plan_names",
    "policy_of",
    "register_policy",
    "resolve_for",
    "resolve_plan",
    "select_blocks",
    "token_split_modules",
    "top_level_roots",
    "tp_style_name",
]

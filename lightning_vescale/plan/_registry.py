"""Which policy each sharded parameter was given: :func:`~lightning_vescale.parallelize` stores it on the parameter,
the optimizer routing and the memory manager read it (the plan decides, nothing re-derives it).

The policy lives on the parameter (``param._vescale_policy``), so it goes with it, and the engine reads the one
thing it needs of it (``policy.tier``: which states the plan puts off the device) as an attribute, without knowing
plans: see ``fully_shard``'s check that a plan's tiers were applied.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from lightning_vescale.plan._resolve import ParamPolicy

__all__ = ["mark_tiers_applied", "policy_of", "register_policy"]


def register_policy(param: torch.Tensor, policy: ParamPolicy) -> None:
    param._vescale_policy = policy  # type: ignore[attr-defined]


def policy_of(param: torch.Tensor) -> Optional[ParamPolicy]:
    """The :class:`~lightning_vescale.plan.ParamPolicy` :func:`~lightning_vescale.parallelize` gave ``param``
    (a sharded parameter), or None for a parameter no plan placed."""
    return getattr(param, "_vescale_policy", None)


def mark_tiers_applied(params: Iterable[torch.Tensor]) -> None:
    """Record that :func:`~lightning_vescale.memory.apply_memory_policy` placed ``params`` (their plan tiers)."""
    for param in params:
        param._vescale_tiers_applied = True  # type: ignore[attr-defined]

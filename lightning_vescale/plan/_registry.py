"""Which policy each sharded parameter was given: :func:`~lightning_vescale.parallelize` records it, the
optimizer routing reads it (the plan decides, nothing re-derives it)."""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from lightning_vescale.plan._resolve import ParamPolicy

__all__ = ["policy_of", "register_policy"]

_POLICIES: "weakref.WeakKeyDictionary[torch.Tensor, ParamPolicy]" = weakref.WeakKeyDictionary()


def register_policy(param: torch.Tensor, policy: ParamPolicy) -> None:
    _POLICIES[param] = policy


def policy_of(param: torch.Tensor) -> Optional[ParamPolicy]:
    """The :class:`~lightning_vescale.plan.ParamPolicy` :func:`~lightning_vescale.parallelize` gave ``param``
    (a sharded parameter), or None for a parameter no plan placed."""
    return _POLICIES.get(param)

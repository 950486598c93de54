"""Which policy each sharded parameter was given: :func:`~lightning_vescale.parallelize` records it, the
optimizer routing reads it (the plan decides, nothing re-derives it)."""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from lightning_vescale.plan._resolve import ParamPolicy

__all__ = ["policy_of", "register_policy"]

# Keyed by identity (a tensor's == is elementwise, so a WeakKeyDictionary cannot hold tensors); an entry goes
# with its parameter.
_POLICIES: dict[int, tuple[weakref.ref, ParamPolicy]] = {}


def register_policy(param: torch.Tensor, policy: ParamPolicy) -> None:
    key = id(param)
    _POLICIES[key] = (weakref.ref(param, lambda _: _POLICIES.pop(key, None)), policy)


def policy_of(param: torch.Tensor) -> Optional[ParamPolicy]:
    """The :class:`~lightning_vescale.plan.ParamPolicy` :func:`~lightning_vescale.parallelize` gave ``param``
    (a sharded parameter), or None for a parameter no plan placed."""
    entry = _POLICIES.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None

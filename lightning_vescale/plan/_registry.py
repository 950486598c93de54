"""Which policy each sharded parameter was given: :func:`~lightning_vescale.parallelize` records it, the
optimizer routing reads it (the plan decides, nothing re-derives it)."""

from __future__ import annotations

import weakref
from typing import Iterable, Optional

import torch

from lightning_vescale.plan._resolve import ParamPolicy

__all__ = ["mark_tiers_applied", "policy_of", "register_policy", "unapplied_tiers"]

# Keyed by identity (a tensor's == is elementwise, so a WeakKeyDictionary cannot hold tensors); an entry goes
# with its parameter.
_POLICIES: dict[int, tuple[weakref.ref, ParamPolicy]] = {}
# Parameters whose plan tiers the memory manager placed (apply_memory_policy), by identity as above.
_TIERS_APPLIED: dict[int, weakref.ref] = {}


def register_policy(param: torch.Tensor, policy: ParamPolicy) -> None:
    key = id(param)
    _POLICIES[key] = (weakref.ref(param, lambda _: _POLICIES.pop(key, None)), policy)


def policy_of(param: torch.Tensor) -> Optional[ParamPolicy]:
    """The :class:`~lightning_vescale.plan.ParamPolicy` :func:`~lightning_vescale.parallelize` gave ``param``
    (a sharded parameter), or None for a parameter no plan placed."""
    entry = _POLICIES.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None


def mark_tiers_applied(params: Iterable[torch.Tensor]) -> None:
    """Record that :func:`~lightning_vescale.memory.apply_memory_policy` placed ``params`` (their plan tiers)."""
    for param in params:
        key = id(param)
        _TIERS_APPLIED[key] = weakref.ref(param, lambda _, key=key: _TIERS_APPLIED.pop(key, None))


def unapplied_tiers(params: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the ``(name, param)`` whose plan puts some state off the device but which no memory manager
    placed: with plain torch, the plan's tiers take effect only through ``apply_memory_policy``."""
    out = []
    for name, param in params:
        policy = policy_of(param)
        if policy is None or all(t == "device" for t in policy.tier.values()):
            continue
        entry = _TIERS_APPLIED.get(id(param))
        if entry is None or entry() is not param:
            out.append(name)
    return out

"""Gradient clipping by the true global norm of sharded gradients."""

from __future__ import annotations

import weakref
from typing import Iterable, Union

import torch

__all__ = ["GRADIENT_TIERS", "clip_grad_norm_"]

GRADIENT_TIERS: "weakref.WeakSet" = weakref.WeakSet()
"""What keeps some parameters' gradient pieces off the device (the memory manager's offloads register here): each has
``owns(param) -> bool`` and ``clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)``, which brings the
pieces in one buffer at a time."""


def clip_grad_norm_(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip gradients of sharded (and ordinary) parameters by their global norm, like
    ``torch.nn.utils.clip_grad_norm_`` on the unsharded model.

    Sharded gradients are :class:`~lightning_vescale.tensor.RaggedTensor` s, whose ``_foreach_norm`` is the
    global norm (one all-reduce per process group for the whole list), so this is
    ``torch.nn.utils.clip_grad_norm_`` with ``foreach=True``; calling torch's directly gives the same result.
    Expert stacks of expert parallelism are laid out over all dp x ep ranks, so each element counts once.
    Returns the total norm (the same on every rank). Gradient pieces offloaded by the memory manager
    (``MemoryPolicy(grads=...)``) are brought in one buffer at a time, with bitwise the same result.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    offload = next((tier for tier in list(GRADIENT_TIERS) if any(tier.owns(p) for p in params)), None)
    if offload is not None:
        return offload.clip_grad_norm_(params, max_norm, float(norm_type), error_if_nonfinite)
    return torch.nn.utils.clip_grad_norm_(
        params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite, foreach=True
    )

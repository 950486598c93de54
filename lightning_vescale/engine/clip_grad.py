"""Gradient clipping by the true global norm of sharded gradients."""

from __future__ import annotations

import weakref
from typing import Iterable, Union, cast

import torch

__all__ = ["GRADIENT_TIERS", "clip_grad_norm_", "local_grads_finite"]

GRADIENT_TIERS: weakref.WeakSet = weakref.WeakSet()
"""What keeps some parameters' gradient pieces off the device (the memory manager's offloads register here): each has
``owns(param) -> bool``, ``clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)`` and
``each_resident(params, fn) -> list`` (``fn`` on chunks of ``params`` whose pieces are brought in, one buffer at a
time)."""


def _tier_of(params: list[torch.Tensor]):  # noqa: ANN202 - a GRADIENT_TIERS member or None
    return next((tier for tier in list(GRADIENT_TIERS) if any(tier.owns(p) for p in params)), None)


def clip_grad_norm_(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip gradients of sharded (and ordinary) parameters by their global norm, like
    ``torch.nn.utils.clip_grad_norm_`` on the unsharded model.

    Sharded gradients are :class:`~lightning_vescale.engine.tensor.RaggedTensor` s, whose ``_foreach_norm`` is the
    global norm (one all-reduce per process group for the whole list), so this is
    ``torch.nn.utils.clip_grad_norm_`` with ``foreach=True``; calling torch's directly gives the same result.
    Expert stacks of expert parallelism are laid out over all dp x ep ranks, so each element counts once.
    Returns the total norm (the same on every rank). Gradient pieces offloaded by the memory manager
    (``MemoryPolicy(grads=...)``) are brought in one buffer at a time, with bitwise the same result.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    offload = _tier_of(params)
    if offload is not None:
        return offload.clip_grad_norm_(params, max_norm, float(norm_type), error_if_nonfinite)
    return torch.nn.utils.clip_grad_norm_(
        params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite, foreach=True
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # RaggedTensor and DTensor: this rank's piece
    return to_local() if callable(to_local) else t


def local_grads_finite(parameters: Iterable[torch.Tensor]) -> bool:
    """Whether every element of this rank's pieces of the parameters' gradients is finite. No collective: each
    rank looks at its own pieces (a ReduceScatter has already spread any rank's NaN to the piece's owner).
    Offloaded gradient pieces are brought in one buffer at a time, as :func:`clip_grad_norm_` does."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return True

    def finite(chunk: list[torch.Tensor]) -> torch.Tensor:
        local = [g.float() if g.element_size() == 1 else g  # float8: no norm kernel
                 for g in (_local(cast(torch.Tensor, p.grad)) for p in chunk)  # params with grads (above)
                 if g.numel() and g.is_floating_point()]
        if not local:
            return torch.tensor(True)
        return torch.stack([n.to(local[0].device) for n in torch._foreach_norm(local, float("inf"))]).isfinite().all()

    offload = _tier_of(params)
    if offload is None:
        return bool(finite(params))
    flags = offload.each_resident(params, finite)
    return bool(torch.stack([f.cpu() for f in flags]).all())

"""Gradient clipping by the true global norm of sharded gradients."""

from __future__ import annotations

from typing import Iterable, Union

import torch
import torch.distributed as dist

from lightning_vescale import collectives

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip gradients of sharded (and ordinary) parameters by their global norm, like
    ``torch.nn.utils.clip_grad_norm_`` on the unsharded model.

    Every element of a sharded gradient lives on exactly one rank of its shard group, so the local
    ``sum |g|^p`` (or max) is all-reduced over that group; ordinary replicated parameters count once.
    A group sharded with ``fully_shard(..., norm_group=g)`` is reduced over ``g`` instead: expert-parallel
    experts sharded over dp hold distinct values on every dp x ep rank (``param._vescale.norm_group``).
    Returns the total norm (the same on every rank).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    if not params:
        return torch.tensor(0.0)
    device = params[0].grad.device
    by_group: dict = {}
    replicated: list[torch.Tensor] = []
    for p in params:
        info = getattr(p, "_vescale", None)
        if info is None:
            replicated.append(p.grad)
        else:
            by_group.setdefault(info.norm_group, []).append(p.grad)

    def local_norm(grads: list[torch.Tensor]) -> torch.Tensor:
        grads = [g for g in grads if g.numel() > 0]
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        norms = torch._foreach_norm(grads, norm_type)
        stacked = torch.stack([n.float() for n in norms])
        return stacked.max() if norm_type == float("inf") else (stacked**norm_type).sum()

    is_inf = norm_type == float("inf")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for group, grads in by_group.items():
        part = local_norm(grads)
        op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
        collectives.all_reduce(part, group, op=op, kind="all_reduce_grad_norm")
        total = torch.maximum(total, part) if is_inf else total + part
    if replicated:
        part = local_norm(replicated)
        total = torch.maximum(total, part) if is_inf else total + part
    total_norm = total if is_inf else total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total_norm):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite; set error_if_nonfinite=False "
            f"to clip anyway"
        )
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    torch._foreach_mul_([p.grad for p in params], coef.to(device))
    return total_norm

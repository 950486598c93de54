"""Optimizer states loaded from elsewhere take their parameter's layout.

``torch.optim.Optimizer.load_state_dict`` keeps the tensors it is given. For a sharded parameter those can be laid
out otherwise: torch's ``set_optimizer_state_dict(..., full_state_dict=True)`` distributes a full state with
``distribute_tensor`` (torch's even ``Shard(0)``, not the parameter's RaggedShard), and a state dict written by DDP
or one process holds full tensors. An elementwise step on such a state beside its RaggedTensor parameter would be
refused (or, for a full tensor, wrong). So every optimizer whose parameters are sharded lays such states out like
their parameter (each rank keeps its piece; a collective for a DTensor, and every rank loads) right after
``load_state_dict``, and before its first step for a load that happened before this module saw the optimizer.

One global optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``) meets each
optimizer at its first step; after that it is one set lookup per step.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lightning_vescale.engine.tensor import RaggedTensor, is_ragged

__all__ = ["lay_out_like_params"]

_SEEN: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def _foreign(value: Any, p: RaggedTensor, full_tensors: bool) -> bool:
    """Whether ``value``, a state of ``p``, is laid out otherwise than ``p`` (and must be converted)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or tuple(value.shape) != tuple(p.shape):
        return False
    if isinstance(value, RaggedTensor):
        return value.layout_info != p.layout_info
    if isinstance(value, DTensor):
        return True
    # A full tensor: only torch.optim's states are known to be elementwise (Muon keeps whole owned matrices).
    return full_tensors


@torch.no_grad()
def lay_out_like_params(optimizer: torch.optim.Optimizer) -> None:
    """Replace every state of a sharded parameter that is laid out otherwise (another DTensor placement, a
    RaggedTensor of another layout, a full tensor for ``torch.optim`` optimizers) by a RaggedTensor of the
    parameter's layout holding this rank's piece. Every rank must call it (gathering a DTensor is a collective)."""
    full_tensors = type(optimizer).__module__.startswith("torch.optim")
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not is_ragged(p):
                continue
            state = optimizer.state.get(p)
            if not state:
                continue
            for key, value in list(state.items()):
                if _foreign(value, p, full_tensors):
                    laid_out = torch.empty_like(p, dtype=value.dtype)
                    laid_out.copy_(value)
                    state[key] = laid_out


def _first_step_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _SEEN:
        return
    _SEEN.add(optimizer)
    if any(is_ragged(p) for group in optimizer.param_groups for p in group["params"]):
        optimizer.register_load_state_dict_post_hook(lay_out_like_params)
        lay_out_like_params(optimizer)


_HOOK = register_optimizer_step_pre_hook(_first_step_hook)

"""Apply a :class:`MemoryPolicy` to a sharded model and its optimizers (framework-free; the strategies call it)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
import torch.nn as nn

from lightning_vescale.memory.activations import ActivationOffload, checkpoint_blocks, offload_activations
from lightning_vescale.memory.disk import check_disk_space
from lightning_vescale.memory.optimizer_states import StateOffload, offload_optimizer_states
from lightning_vescale.memory.pieces import PieceOffload, offload_pieces
from lightning_vescale.memory.policy import MemoryPolicy

logger = logging.getLogger(__name__)

__all__ = ["MemoryHandles", "apply_memory_policy"]


@dataclass
class MemoryHandles:
    """What :func:`apply_memory_policy` installed; ``close()`` undoes the offloads (states come back)."""

    policy: Optional[MemoryPolicy] = None
    """This rank's policy (its ``disk_dir`` is the rank's own directory)."""
    states: list[StateOffload] = field(default_factory=list)
    pieces: Optional[PieceOffload] = None
    activations: Optional[ActivationOffload] = None
    checkpointed: list[str] = field(default_factory=list)

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Step ``optimizer`` (built on the model's sharded parameters after the policy was applied) as the policy
        says: its states on their tier, the model's offloaded pieces brought in bucket by bucket."""
        policy = self.policy
        if policy is None or any(s.optimizer is optimizer for s in self.states):
            return
        if policy.optimizer_states != "device" or self.pieces is not None:
            self.states.append(offload_optimizer_states(optimizer, policy, pieces=self.pieces))

    def close(self) -> None:
        for offload in self.states:
            offload.close()
        self.states.clear()
        if self.pieces is not None:
            self.pieces.close()
            self.pieces = None
        if self.activations is not None:
            self.activations.close()
            self.activations = None


def _check_room(model: nn.Module, policy: MemoryPolicy, disk_dir: Optional[str]) -> None:
    """The disk tier must hold this rank's weights, gradients and optimizer states placed there (the states
    estimated as two per element, Adam's), before anything moves."""
    from lightning_vescale.dbuffer import DBuffer
    from lightning_vescale.fully_shard import sharded_groups

    if disk_dir is None:
        return
    piece = sum(b.local.numel() * b.local.element_size() for g in sharded_groups(model) for b in g.buffers.values()
                if type(b) is DBuffer and b.dtype.is_floating_point)
    need = {"master weights": piece * (policy.params == "disk"), "gradients": piece * (policy.grads == "disk"),
            "optimizer states": 2 * piece * (policy.optimizer_states == "disk")}
    need = {k: v for k, v in need.items() if v}
    if need:
        os.makedirs(disk_dir, exist_ok=True)
        check_disk_space(disk_dir, sum(need.values()), " + ".join(need))


def apply_memory_policy(
    model: nn.Module, optimizers: Iterable[torch.optim.Optimizer], policy: Optional[MemoryPolicy], *, rank: int = 0,
) -> MemoryHandles:
    """Put ``model``'s weights and gradient pieces, activations and ``optimizers``' states where ``policy`` says (a
    no-op for ``None`` or the all-device policy). Disk files go under ``policy.disk_dir/rank<rank>``. Call it once
    the model is sharded and its weights initialized (or loaded)."""
    handles = MemoryHandles()
    if policy is None:
        return handles
    disk_dir = os.path.join(policy.disk_dir, f"rank{rank}") if policy.disk_dir else None
    if policy.activations == "checkpoint":
        handles.checkpointed = checkpoint_blocks(model, policy.activation_blocks)
    elif policy.activations != "device":
        handles.activations = offload_activations(model, policy.activation_blocks, policy.activations,
                                                  disk_dir=disk_dir, prefetch=policy.prefetch)
    _check_room(model, policy, disk_dir)
    local = MemoryPolicy(optimizer_states=policy.optimizer_states, params=policy.params, grads=policy.grads,
                         disk_dir=disk_dir, prefetch=policy.prefetch, bucket_bytes=policy.bucket_bytes)
    handles.policy = local
    if policy.params != "device" or policy.grads != "device":
        handles.pieces = offload_pieces(model, local)
    for opt in optimizers:
        handles.add_optimizer(opt)
    logger.info("lightning_vescale memory: master weights on %s, gradients on %s, optimizer states on %s, "
                "activations %s%s", policy.params, policy.grads, policy.optimizer_states, policy.activations,
                f" ({len(handles.checkpointed)} blocks recomputed)" if handles.checkpointed else "")
    return handles



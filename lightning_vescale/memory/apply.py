"""Apply a :class:`MemoryPolicy` to a sharded model and its optimizers (framework-free; the strategies call it).

A plan's per-parameter ``tier`` (see [Note: tiers in a plan] in :mod:`lightning_vescale.plan._spec`), recorded by
:func:`~lightning_vescale.parallelize` with each sharded parameter's policy, wins over the policy's class
placement for the parameters it covers: :func:`tier_placement` resolves both into one tier per buffer (weights,
gradients) and per parameter (optimizer states), and :func:`apply_memory_policy` moves exactly that.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Iterable, Optional, cast

import torch
import torch.nn as nn

from lightning_vescale.memory.activations import ActivationOffload, checkpoint_blocks, offload_activations
from lightning_vescale.memory.disk import DiskStore, check_disk_space
from lightning_vescale.memory.gathered import GatheredOffload
from lightning_vescale.memory.optimizer_states import StateOffload, offload_optimizer_states
from lightning_vescale.memory.pieces import PieceOffload, offload_pieces
from lightning_vescale.memory.policy import MemoryPolicy, Tier
from lightning_vescale.plan import mark_tiers_applied

logger = logging.getLogger(__name__)

__all__ = ["MemoryHandles", "TierPlacement", "apply_memory_policy", "tier_placement"]


@dataclass
class TierPlacement:
    """Where one sharded model's state lives: the plan's tiers where it sets them, the policy's elsewhere."""

    buffers: dict[int, tuple[str, str]] = field(default_factory=dict)
    """``id(DBuffer) -> (weights tier, gradients tier)`` for every floating-point DBuffer."""
    states: dict[int, str] = field(default_factory=dict)
    """``id(sharded parameter) -> optimizer-states tier`` for the model's parameters."""
    default_states: str = "device"
    """The policy's optimizer-states tier (parameters of other models)."""
    bytes: dict[tuple[str, str], int] = field(default_factory=dict)
    """``(class, tier) -> bytes`` this rank keeps there (optimizer states estimated as two per element, Adam's)."""
    from_plan: bool = False
    """Whether the plan placed anything."""

    def state_tier(self, p: torch.Tensor) -> str:
        return self.states.get(id(p), self.default_states)

    def states_tier_of(self, optimizer: torch.optim.Optimizer, device: torch.device) -> str:
        """The one tier ``optimizer``'s moved states go to ("device": none move). A CPU-only machine's host memory
        is its device memory, so there ``host`` states stay where they are (as ``StateOffload`` does anyway)."""
        used = {self.state_tier(p) for g in optimizer.param_groups for p in g["params"]} - {"device"}
        if device.type == "cpu" and len(used) > 1:
            used.discard("host")
        if len(used) > 1:
            raise ValueError(
                f"this optimizer's states would live on both {' and '.join(sorted(used))}: one optimizer moves its "
                f"states to one tier. Put the plan's optimizer_states and the MemoryPolicy's on the same tier, or "
                f"build one optimizer per tier"
            )
        return used.pop() if used else "device"


def tier_placement(model: nn.Module, policy: Optional[MemoryPolicy]) -> TierPlacement:
    """The tier of each buffer's weights and gradient pieces and of each parameter's optimizer states: the plan's
    (:func:`~lightning_vescale.plan.policy_of`) for the classes it places, ``policy``'s for the rest."""
    from lightning_vescale.engine.dbuffer import DBuffer
    from lightning_vescale.engine.fully_shard import sharded_groups
    from lightning_vescale.plan import policy_of

    policy = policy or MemoryPolicy()
    out = TierPlacement(default_states=policy.optimizer_states)

    def tier(p: torch.Tensor, cls: str) -> str:
        planned = policy_of(p)
        chosen = planned.tier_of(cls) if planned is not None else None
        out.from_plan |= chosen is not None
        return chosen if chosen is not None else getattr(policy, cls)

    def count(cls: str, where: str, nbytes: int) -> None:
        out.bytes[(cls, where)] = out.bytes.get((cls, where), 0) + nbytes

    for group in sharded_groups(model):
        for buf in group.buffers.values():
            members = [mp for mp in group.managed if group.buffers[mp.key] is buf]
            for mp in members:
                out.states[id(mp.sharded)] = tier(mp.sharded, "optimizer_states")
                if mp.sharded.requires_grad:
                    local = mp.sharded._local_tensor  # type: ignore[attr-defined]  # a RaggedTensor (DTensor) parameter
                    count("optimizer_states", out.states[id(mp.sharded)], 2 * local.numel() *
                          mp.sharded.element_size())
            if type(buf) is not DBuffer or not buf.dtype.is_floating_point:
                continue  # quantized or integer storage stays where it is (the plan refuses to move it)
            piece = buf.local.numel() * buf.local.element_size()
            tiers = []
            for cls in ("params", "grads"):
                if cls == "grads" and not buf.requires_grad:
                    tiers.append("device")
                    continue
                found = {mp.fqn: tier(mp.sharded, cls) for mp in members}
                if len(set(found.values())) > 1:  # resolve_plan refuses such plans; policies registered otherwise
                    raise ValueError(f"the parameters of one buffer of {type(group.module).__name__} get different "
                                     f"{cls} tiers {found}: a buffer's pieces move together")
                tiers.append(next(iter(found.values()), getattr(policy, cls)))
                count(cls, tiers[-1], piece)
            out.buffers[id(buf)] = (tiers[0], tiers[1])
    return out


@dataclass
class MemoryHandles:
    """What :func:`apply_memory_policy` installed; ``close()`` undoes the offloads (states come back)."""

    policy: Optional[MemoryPolicy] = None
    """This rank's policy (its ``disk_dir`` is the rank's own directory)."""
    placement: Optional[TierPlacement] = None
    """The plan's tiers and the policy's, per buffer and parameter."""
    model: Optional[nn.Module] = None
    """The sharded model the policy was applied to."""
    states: list[StateOffload] = field(default_factory=list)
    pieces: Optional[PieceOffload] = None
    activations: Optional[ActivationOffload] = None
    gathered: Optional[GatheredOffload] = None
    gathered_buffers: list = field(default_factory=list)
    checkpointed: list[str] = field(default_factory=list)

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Step ``optimizer`` (built on the model's sharded parameters after the policy was applied) as the policy
        says: its states on their tier, the model's offloaded pieces brought in bucket by bucket."""
        policy, placement = self.policy, self.placement
        if policy is None or placement is None or any(s.optimizer is optimizer for s in self.states):
            return
        device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
        tier = placement.states_tier_of(optimizer, device)
        if tier != "device" or self.pieces is not None:
            select = None if not placement.from_plan else (lambda p: placement.state_tier(p) == tier)
            self.states.append(offload_optimizer_states(
                optimizer, dataclasses.replace(policy, optimizer_states=cast(Tier, tier)), pieces=self.pieces, select=select,
                model=self.model))

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
        if self.gathered is not None:
            for buf in self.gathered_buffers:
                buf.gathered_offload = None
            self.gathered.close()
            self.gathered, self.gathered_buffers = None, []


def _check_room(placement: TierPlacement, disk_dir: Optional[str], gathered: int = 0) -> None:
    """The disk tier must hold this rank's weights, gradients and optimizer states placed there (the states
    estimated as two per element, Adam's), and ``gathered`` bytes of gathered parameters, before anything moves."""
    if disk_dir is None:
        return
    names = {"params": "master weights", "grads": "gradients", "optimizer_states": "optimizer states"}
    need = {names[c]: placement.bytes.get((c, "disk"), 0) for c in names}
    need["gathered parameters"] = gathered
    need = {k: v for k, v in need.items() if v}
    if need:
        os.makedirs(disk_dir, exist_ok=True)
        check_disk_space(disk_dir, sum(need.values()), " + ".join(need))


def _gathered_buffers(model: nn.Module) -> list:
    """The plain floating-point DBuffers of groups that reshard after forward (gathered again for backward)."""
    from lightning_vescale.engine.dbuffer import DBuffer

    return [b for g in _sharded_groups(model) if g.reshard_after_forward and g.backward_reads_params
            for b in g.buffers.values() if type(b) is DBuffer and b.dtype.is_floating_point]


def _sharded_groups(model: nn.Module) -> list:
    from lightning_vescale.engine.fully_shard import sharded_groups

    return sharded_groups(model)


def apply_memory_policy(
    model: nn.Module, optimizers: Iterable[torch.optim.Optimizer], policy: Optional[MemoryPolicy], *, rank: int = 0,
) -> MemoryHandles:
    """Put ``model``'s weights and gradient pieces, activations and ``optimizers``' states where ``policy`` says (a
    no-op for ``None`` or the all-device policy). Disk files go under ``policy.disk_dir/rank<rank>``. Call it once
    the model is sharded and its weights initialized (or loaded).

    A plan's ``tier`` settings (recorded by :func:`~lightning_vescale.parallelize`) win over ``policy`` for the
    parameters they cover (``policy=None``: they alone move); the disk tier's directory is always the policy's."""
    handles = MemoryHandles()
    placement = tier_placement(model, policy)
    if policy is None and not placement.from_plan:
        return handles
    on_disk = [c for c in ("params", "grads", "optimizer_states") if (c, "disk") in placement.bytes]
    if on_disk and (policy is None or not policy.disk_dir):
        raise ValueError(f"the plan puts {', '.join(on_disk)} of {type(model).__name__} on disk, but "
                         f"{'no MemoryPolicy' if policy is None else 'the MemoryPolicy'} names a directory for it: "
                         f"pass MemoryPolicy(disk_dir=<a directory on a local disk>)")
    policy = policy or MemoryPolicy()
    disk_dir = os.path.join(policy.disk_dir, f"rank{rank}") if policy.disk_dir else None
    if policy.activations == "checkpoint":
        handles.checkpointed = checkpoint_blocks(model, policy.activation_blocks)
    elif policy.activations != "device":
        handles.activations = offload_activations(model, policy.activation_blocks, policy.activations,
                                                  disk_dir=disk_dir, prefetch=policy.prefetch)
    gathered = _gathered_buffers(model) if policy.gathered_params != "device" else []
    if policy.gathered_params == "host" and any(b.device.type != "cpu" for b in gathered):
        raise ValueError("MemoryPolicy(gathered_params='host') is not available on accelerators yet: use 'disk' "
                         "or 'device'")
    _check_room(placement, disk_dir, sum(b.unsharded.numel() * b.unsharded.element_size() for b in gathered)
                if policy.gathered_params == "disk" else 0)
    if policy.gathered_params == "disk" and gathered:
        assert disk_dir is not None  # MemoryPolicy checks a disk tier has one
        handles.gathered = GatheredOffload(DiskStore(disk_dir, tag="-gathered"))
        handles.gathered_buffers = gathered
        for buf in gathered:
            buf.gathered_offload = handles.gathered
    local = MemoryPolicy(optimizer_states=policy.optimizer_states, params=policy.params, grads=policy.grads,
                         gathered_params=policy.gathered_params, disk_dir=disk_dir, prefetch=policy.prefetch,
                         bucket_bytes=policy.bucket_bytes, prefetch_buckets=policy.prefetch_buckets)
    handles.policy, handles.placement, handles.model = local, placement, model
    mark_tiers_applied(mp.sharded for group in _sharded_groups(model) for mp in group.managed)
    if any(t != ("device", "device") for t in placement.buffers.values()):
        handles.pieces = offload_pieces(model, local, tiers=placement.buffers)
    for opt in optimizers:
        handles.add_optimizer(opt)
    logger.info("lightning_vescale memory: master weights on %s, gradients on %s, optimizer states on %s, "
                "gathered parameters on %s, activations %s%s%s", policy.params, policy.grads, policy.optimizer_states,
                policy.gathered_params, policy.activations,
                f" ({len(handles.checkpointed)} blocks recomputed)" if handles.checkpointed else "",
                "; the plan's tiers for its parameters: " + ", ".join(
                    f"{c} {t} {n / 2**20:.1f} MiB" for (c, t), n in sorted(placement.bytes.items()) if t != "device")
                if placement.from_plan else "")
    return handles



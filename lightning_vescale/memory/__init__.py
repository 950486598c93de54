"""The memory manager: tiers (device, host, disk), a ledger of bytes per state class and tier, and offload.

Today: sharded master weights and gradient pieces on the host or disk tier between uses (:func:`offload_pieces`);
optimizer states on the host or disk tier between steps, swapped bucket by bucket with prefetch
(:func:`offload_optimizer_states`); activations saved for backward on the host or disk tier
(:func:`offload_activations`) and selective activation checkpointing (:func:`checkpoint_blocks`); gathered
parameters on disk between forward and backward instead of a second AllGather (:class:`GatheredOffload`); the ledger
(:data:`memory_stats`). A plan's per-parameter ``tier`` wins over the policy's class placement for the parameters
it covers (:func:`tier_placement`).
"""

from lightning_vescale.memory.activations import ActivationOffload, checkpoint_blocks, offload_activations
from lightning_vescale.memory.apply import MemoryHandles, TierPlacement, apply_memory_policy, tier_placement
from lightning_vescale.memory.budget import MemoryEstimate, Placement, choose_placement, measure_disk_bandwidth
from lightning_vescale.memory.disk import DiskStore, DiskTierError
from lightning_vescale.memory.gathered import GatheredOffload
from lightning_vescale.memory.ledger import MemoryLedger, memory_stats
from lightning_vescale.memory.optimizer_states import StateOffload, offload_optimizer_states, resident_states
from lightning_vescale.memory.pieces import PieceOffload, offload_pieces, resident_pieces
from lightning_vescale.memory.policy import TIERS, MemoryPolicy, check_explicit_policy, check_plan_tiers, parse_bytes

__all__ = [
    "check_explicit_policy",
    "check_plan_tiers",
    "TIERS",
    "MemoryEstimate",
    "MemoryHandles",
    "Placement",
    "apply_memory_policy",
    "choose_placement",
    "measure_disk_bandwidth",
    "ActivationOffload",
    "checkpoint_blocks",
    "offload_activations",
    "DiskStore",
    "DiskTierError",
    "GatheredOffload",
    "MemoryLedger",
    "MemoryPolicy",
    "PieceOffload",
    "StateOffload",
    "TierPlacement",
    "memory_stats",
    "offload_optimizer_states",
    "offload_pieces",
    "parse_bytes",
    "resident_pieces",
    "resident_states",
    "tier_placement",
]

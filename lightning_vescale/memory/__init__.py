"""The memory manager: tiers (device, host, disk), a ledger of bytes per state class and tier, and offload.

Today: optimizer states on the host or disk tier between steps, swapped bucket by bucket with prefetch
(:func:`offload_optimizer_states`); activations saved for backward on the host or disk tier
(:func:`offload_activations`) and selective activation checkpointing (:func:`checkpoint_blocks`); the ledger
(:data:`memory_stats`).
"""

from lightning_vescale.memory.activations import ActivationOffload, checkpoint_blocks, offload_activations
from lightning_vescale.memory.apply import MemoryHandles, apply_memory_policy
from lightning_vescale.memory.budget import MemoryEstimate, Placement, choose_placement, measure_disk_bandwidth
from lightning_vescale.memory.disk import DiskStore, DiskTierError
from lightning_vescale.memory.ledger import MemoryLedger, memory_stats
from lightning_vescale.memory.optimizer_states import StateOffload, offload_optimizer_states, resident_states
from lightning_vescale.memory.policy import TIERS, MemoryPolicy, parse_bytes

__all__ = [
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
    "MemoryLedger",
    "MemoryPolicy",
    "StateOffload",
    "memory_stats",
    "offload_optimizer_states",
    "parse_bytes",
    "resident_states",
]

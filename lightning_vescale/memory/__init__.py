"""The memory manager: tiers (device, host, disk), a ledger of bytes per state class and tier, and offload.

Today: optimizer states on the host or disk tier between steps, swapped bucket by bucket with prefetch
(:func:`offload_optimizer_states`); activations saved for backward on the host or disk tier
(:func:`offload_activations`) and selective activation checkpointing (:func:`checkpoint_blocks`); the ledger
(:data:`memory_stats`).
"""

from lightning_vescale.memory.activations import ActivationOffload, checkpoint_blocks, offload_activations
from lightning_vescale.memory.disk import DiskStore, DiskTierError
from lightning_vescale.memory.ledger import MemoryLedger, memory_stats
from lightning_vescale.memory.optimizer_states import StateOffload, offload_optimizer_states, resident_states
from lightning_vescale.memory.policy import TIERS, MemoryPolicy, parse_bytes

__all__ = [
    "TIERS",
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

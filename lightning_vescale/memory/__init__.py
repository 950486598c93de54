"""The memory manager: tiers (device, host, disk), a ledger of bytes per state class and tier, and offload.

Today: optimizer states on the host or disk tier between steps, swapped bucket by bucket with prefetch
(:func:`offload_optimizer_states`), and the ledger (:data:`memory_stats`).
"""

from lightning_vescale.memory.disk import DiskStore, DiskTierError
from lightning_vescale.memory.ledger import MemoryLedger, memory_stats
from lightning_vescale.memory.optimizer_states import StateOffload, offload_optimizer_states, resident_states
from lightning_vescale.memory.policy import TIERS, MemoryPolicy, parse_bytes

__all__ = [
    "TIERS",
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

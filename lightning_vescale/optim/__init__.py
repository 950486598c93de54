"""Optimizers for sharded parameters: Muon with owner-compute, Muon/AdamW routing, and AdamW with block-wise
8-bit states.

``Muon`` orthogonalizes every matrix whole on one owner rank (no communication when the planner
already put it there, see ``muon_granularity``); ``build_optimizer`` returns one optimizer that sends
hidden matrices to Muon and the rest to AdamW. ``AdamW8bit`` keeps both moments as 8-bit codes plus one scale
per block of elements, each rank quantizing its own blocks (shard with ``adamw8bit_granularity``).
"""

from lightning_vescale.optim.adamw8bit import AdamW8bit, adamw8bit_granularity, optimizer_state_bytes
from lightning_vescale.optim.muon import Muon, MuonCostModel
from lightning_vescale.optim.owner import (
    OwnerAssignment,
    assign_owners,
    newton_schulz_cost,
)
from lightning_vescale.optim.routing import (
    DEFAULT_ADAMW_PATTERNS,
    DEFAULT_EXPERT_PATTERNS,
    MuonWithAuxAdamW,
    build_optimizer,
    muon_granularity,
    route_parameters,
)

__all__ = [
    "AdamW8bit",
    "DEFAULT_ADAMW_PATTERNS",
    "DEFAULT_EXPERT_PATTERNS",
    "Muon",
    "MuonCostModel",
    "MuonWithAuxAdamW",
    "OwnerAssignment",
    "adamw8bit_granularity",
    "assign_owners",
    "build_optimizer",
    "muon_granularity",
    "newton_schulz_cost",
    "optimizer_state_bytes",
    "route_parameters",
]

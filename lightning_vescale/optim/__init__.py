"""Optimizers for sharded parameters: Muon with owner-compute, and Muon/AdamW routing.

``Muon`` orthogonalizes every matrix whole on one owner rank (no communication when the planner
already put it there, see ``muon_granularity``); ``build_optimizer`` returns one optimizer that sends
hidden matrices to Muon and the rest to AdamW.
"""

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
    "DEFAULT_ADAMW_PATTERNS",
    "DEFAULT_EXPERT_PATTERNS",
    "Muon",
    "MuonCostModel",
    "MuonWithAuxAdamW",
    "OwnerAssignment",
    "assign_owners",
    "build_optimizer",
    "muon_granularity",
    "newton_schulz_cost",
    "route_parameters",
]

"""Owners: which rank orthogonalizes which whole matrix (pure, no process group).

Newton–Schulz on an ``s x l`` matrix (``s`` the short side, ``l`` the long side) costs, per step, one
Gram matrix ``X Xᵀ`` (``s²l`` multiply-adds), its square (``s³``) and the product with ``X`` (``s²l``):
``s²(2l + s)`` multiply-adds, so ``steps · s²(2l + s)`` per matrix (DESIGN.md, "Owner").

Owners are chosen by longest-processing-time-first (LPT): matrices in decreasing cost, ties broken by
name, each to the rank with the least load so far, ties to the lowest rank. The result is a pure
function of names, costs and the number of ranks, so every rank computes the same assignment without
communication. LPT's worst case is ``4/3 - 1/(3N)`` of the optimal makespan; with many matrices per
rank it is close to perfect balance.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

__all__ = ["OwnerAssignment", "assign_owners", "newton_schulz_cost"]


def newton_schulz_cost(shape: Sequence[int], ns_steps: int = 5) -> float:
    """Multiply-adds of ``ns_steps`` Newton–Schulz iterations on a matrix of ``shape``: ``steps·s²(2l+s)``."""
    if len(shape) != 2:
        raise ValueError(f"Newton–Schulz orthogonalizes matrices; got shape {tuple(shape)} (expected 2 dims)")
    if ns_steps < 0:
        raise ValueError(f"ns_steps must be >= 0, got {ns_steps}")
    short, long = sorted(int(d) for d in shape)
    return float(ns_steps * short * short * (2 * long + short))


@dataclass(frozen=True)
class OwnerAssignment:
    """Matrix name -> owner rank, and the cost each rank carries."""

    owners: dict
    """``{name: rank}``."""
    loads: tuple
    """Total cost per rank (including any initial load)."""

    @property
    def num_ranks(self) -> int:
        return len(self.loads)

    @property
    def balance(self) -> float:
        """``max(loads) / mean(loads)``: 1.0 is perfect; 1.0 as well when there is no work at all."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean > 0 else 1.0

    def owned_by(self, rank: int) -> list[str]:
        return sorted(name for name, r in self.owners.items() if r == rank)


def assign_owners(
    costs: Mapping[str, float],
    num_ranks: int,
    *,
    initial_loads: Optional[Sequence[float]] = None,
    candidates: Optional[Mapping[str, Sequence[int]]] = None,
) -> OwnerAssignment:
    """Assign each named matrix to a rank by longest-processing-time-first on ``costs``.

    Args:
        costs: ``{name: cost}`` (e.g. :func:`newton_schulz_cost`); names must be unique.
        num_ranks: number of ranks to spread the matrices over.
        initial_loads: cost each rank already carries (e.g. matrices it orthogonalizes in place); LPT
            fills the least loaded ranks first. Default: zeros.
        candidates: ``{name: ranks}`` restricting where a matrix may go (e.g. the ranks already holding a
            piece of it, so that piece need not travel); a matrix not named may go to any rank. Among its
            candidates a matrix goes to the least loaded, ties to the lowest rank.

    Returns:
        The assignment; identical on every rank for identical inputs (ties: name, then lowest rank).
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    loads = [0.0] * num_ranks if initial_loads is None else [float(x) for x in initial_loads]
    if len(loads) != num_ranks:
        raise ValueError(f"initial_loads has {len(loads)} entries but num_ranks is {num_ranks}; give one per rank")
    for name, cost in costs.items():
        if not (cost >= 0 and math.isfinite(cost)):
            raise ValueError(f"cost of {name!r} must be a finite non-negative number, got {cost}")
    candidates = dict(candidates or {})
    for name, ranks in candidates.items():
        if name not in costs:
            raise ValueError(f"candidates name {name!r}, which is not in costs; give candidates only for matrices assigned")
        if not ranks or any(not 0 <= r < num_ranks for r in ranks):
            raise ValueError(f"candidates of {name!r} must be a non-empty list of ranks in [0, {num_ranks}), got {ranks}")
    heap = [(load, r) for r, load in enumerate(loads)]
    heapq.heapify(heap)
    owners = {}
    for name, cost in sorted(costs.items(), key=lambda item: (-item[1], item[0])):
        allowed = candidates.get(name)
        if allowed is None:
            load, r = heapq.heappop(heap)
            while load != loads[r]:  # a stale entry: the rank took a matrix through its candidates since
                load, r = heapq.heappop(heap)
        else:  # the least loaded allowed rank; its heap entry goes stale and is dropped when popped
            r = min(allowed, key=lambda q: (loads[q], q))
            load = loads[r]
        owners[name] = r
        loads[r] = load + cost
        heapq.heappush(heap, (loads[r], r))
    return OwnerAssignment(owners, tuple(loads))

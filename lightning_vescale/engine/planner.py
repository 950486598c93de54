"""Structure-aware planner: lay a group's tensors into one flat buffer and choose the rank cuts.

The problem (DESIGN.md, "Planner problem"): place each tensor ``t`` (``e_t`` elements, granularity
``g_t``) at ``[l_t, l_t + e_t)`` of a buffer of ``N * S`` elements, rank ``k`` owning
``[k*S, (k+1)*S)``, and minimize ``S`` subject to: no rank boundary falls strictly inside a granule of
a tensor, tensors are contiguous (padding only between tensors), every rank's piece has size ``S``.

Granules (:func:`granule`) are runs of ``g`` elements that restart every ``period`` elements: a block of
``k`` rows of each matrix of an ``(E, rows, cols)`` expert stack restarts at every expert, and when ``k`` does
not divide ``rows`` the last block of each matrix is shorter. A cut may fall only where a granule starts.

The planner is pure and deterministic: every rank computes the same plan from the same inputs with no
communication, and :meth:`BufferPlan.fingerprint` lets ranks check that they agree.

[Note: how plan_buffer searches]
Four facts make the search cheap:

1. For a fixed order and ``S``, placing every tensor at its *earliest feasible offset* is optimal for
   that order (a later start never helps the tensors after it), and that offset is a closed formula
   (:func:`_earliest_offset`): a tensor either fits before the next boundary, or crosses boundaries at
   granule edges. If ``g | S`` a crossing tensor needs ``l = 0 (mod g)``; if not, it can hold only
   one boundary ``b`` and needs ``l = b (mod g)``. Granules that restart with a shorter last one
   (``g`` not dividing the period) take a short walk over the granule edges instead
   (:func:`_earliest_periodic_offset`).
2. A lower bound (:func:`shard_size_lower_bound`): ``S >= ceil(total / N)``, ``S >= g_t``, whole
   tensors need ``ceil(n / N)`` slots of their size per shard, and a tensor longer than ``2S`` holds
   two consecutive boundaries, so ``g_t`` must divide ``S`` (restarting granules: ``S`` must be close to a
   multiple of the period, :func:`_periodic_size_ok`). Only such ``S`` are ever tried
   (:class:`_ValidSizes`); realistic groups often sit exactly on this bound.
3. Phase 1 starts at the bound. When a try at ``S`` ends at ``E > N*S``, the padding it needed says
   where to look next: ``ceil(E / N)``. Phase 2 then tries, within a work budget, sizes the jump
   stepped over: multiples of the big classes' granularities (their crossings become free), sizes
   where a shard holds one more of their tensors, and every aligned size when the range is small.
4. At each ``S`` a few orders are tried, cheapest first: module order, granularity-descending order,
   then boundary-aware greedy fills over classes of identical (size, granularity) tensors. A greedy
   fill takes, at each step, the class needing the least padding (ties: granularity or size
   descending), or, in its *budgeted* form, the first class whose padding fits the slack left per
   remaining boundary, which keeps flexible tensors (fine granularity) for the boundaries that need
   them; an unavoidable gap before a crossing is filled with the largest small tensors that fit.
   Groups of at most ``_EXHAUSTIVE_MAX_TENSORS`` tensors also try every distinct order.
5. Small groups (at most ``_EXACT_MAX_STATES`` subsets of their classes) that phases 1 and 2 leave above the
   bound get an exact stage: every valid ``S`` upward from the bound, each decided by a dynamic program over the
   subsets placed so far (fact 1 makes the earliest end of a subset the only thing its orders differ in, so
   ``prod(count + 1)`` states replace ``n!`` orders), pruned where the tensors left cannot fit behind the end, until
   one fits or ``_EXACT_WORK_BUDGET`` evaluations are spent. Within the budget the result is the optimum (the
   brute force's on the quant_tiles groups: 1.16% instead of 4.0% on 2 ranks); large groups never pay for it.

The first order that fits wins; with costs, every order that fits at the chosen ``S`` (the padding is
the same for all of them) competes with a longest-processing-time assignment of whole tensors to
ranks, and the lowest maximum rank cost wins. Ties are broken by name or module order, never by hash
order, so every rank computes the same plan.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

__all__ = [
    "GRANULARITY_NAMES",
    "BufferPlan",
    "Granularity",
    "TensorSpec",
    "element_blocks",
    "granularity_numel",
    "granule",
    "parse_element_blocks",
    "plan_buffer",
    "shard_size_lower_bound",
]

# "element" | "row" | "matrix" | "tensor" | "elements:<n>" | int (a block of that many rows)
Granularity = Union[str, int]
GRANULARITY_NAMES = ("element", "row", "matrix", "tensor")
"""The named granularities; an int ``k`` is a block of ``k`` rows; ``"elements:<n>"`` blocks of ``n`` elements."""
ELEMENT_BLOCKS_PREFIX = "elements:"


def element_blocks(n: int) -> str:
    """The granularity ``"elements:<n>"``: runs of ``n`` consecutive elements of the flattened tensor, counted from
    its first element (the last run holding what remains), stay on one rank. Block-wise optimizer states
    (:class:`~lightning_vescale.optim.AdamW8bit`) use it so no block of ``n`` straddles a cut."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"element_blocks needs a positive int number of elements, got {n!r}")
    return f"{ELEMENT_BLOCKS_PREFIX}{n}"


def parse_element_blocks(granularity: object) -> Optional[int]:
    """``n`` of an ``"elements:<n>"`` granularity; None for any other value. Raises ``ValueError`` for a malformed
    ``"elements:..."`` string."""
    if not isinstance(granularity, str) or not granularity.startswith(ELEMENT_BLOCKS_PREFIX):
        return None
    text = granularity[len(ELEMENT_BLOCKS_PREFIX):]
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"granularity {granularity!r}: expected 'elements:<n>' with n a positive int, e.g. 'elements:256'")
    return int(text)


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """``(num_matrices, rows, cols)`` of the matrices a tensor holds, or ``None`` for a vector.

    A 3-D tensor ``(E, rows, cols)`` is a stack of ``E`` matrices (fused expert weights); any other tensor of
    two or more dimensions is one matrix of ``shape[0]`` rows of ``prod(shape[1:])`` elements.
    """
    if len(shape) < 2:
        return None
    if len(shape) == 3:
        return shape[0], shape[1], shape[2]
    return 1, shape[0], math.prod(shape[1:])


def granule(shape: Sequence[int], granularity: Granularity) -> tuple[int, int]:
    """``(granularity_numel, period)``: the elements that must stay on one rank, and how often the granules restart.

    Granules are consecutive runs of ``granularity_numel`` elements that start again at every multiple of
    ``period``, the last run of each period being shorter when ``granularity_numel`` does not divide it:
    a cut may fall only where a granule starts. Meanings, per matrix (see :func:`granularity_numel`):

    * ``"element"``: ``(1, numel)``; ``"tensor"``: ``(numel, numel)``, the whole tensor on one rank;
    * ``"row"``: one row of each matrix; ``k`` (int): blocks of ``k`` rows of each matrix, the last block of a
      matrix holding the rows that remain (128 keeps every 128x128 quantization block whole); ``"matrix"``: a
      whole matrix (one expert of a 3-D stack, what Muon orthogonalizes);
    * ``"elements:<n>"``: runs of ``n`` elements of the flattened tensor from its first element, the last run
      shorter when ``n`` does not divide ``numel`` (1-D tensors too): cuts fall on multiples of ``n``;
    * a 1-D tensor has no rows: ``"row"``, ``k`` and ``"matrix"`` leave it element-granular.
    """
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if granularity == "element" or granularity == "tensor":
        return (max(numel, 1) if granularity == "tensor" else 1), numel
    blocks = parse_element_blocks(granularity)
    if blocks is not None:
        return max(min(blocks, numel), 1), numel
    is_rows = isinstance(granularity, int) and not isinstance(granularity, bool) and granularity > 0
    if not (granularity in ("row", "matrix") or is_rows):
        raise ValueError(
            f"unknown granularity {granularity!r}: expected one of {', '.join(map(repr, GRANULARITY_NAMES))}, "
            f"'elements:<n>' or a positive int number of rows"
        )
    matrices = _matrix_shape(shape)
    if matrices is None or numel == 0:
        return 1, numel
    _, rows, cols = matrices
    block_rows = {"row": 1, "matrix": rows}.get(granularity, granularity)  # type: ignore[arg-type]
    return min(block_rows, rows) * cols, rows * cols


def granularity_numel(shape: Sequence[int], granularity: Granularity) -> int:
    """Number of contiguous elements that must stay on one rank for ``granularity`` on ``shape``.

    ``"element"`` -> 1; ``"row"`` -> one row of a matrix (``prod(shape[1:])``; ``cols`` of an ``(E, rows,
    cols)`` expert stack); ``k`` (int) -> ``k`` rows of a matrix, at most all of them (the last block of
    each matrix may be shorter, see :func:`granule`); ``"matrix"`` -> a whole matrix (one expert of a
    stack); ``"tensor"`` -> ``numel``. 1-D tensors are element-granular except for ``"tensor"``.
    """
    return granule(shape, granularity)[0]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to place in a buffer."""

    name: str
    """Unique name within the group (the parameter's FQN)."""
    shape: tuple[int, ...]
    """Global (unsharded) shape."""
    granularity: int = 1
    """Contiguous elements that must stay on one rank (a granule; see :func:`granule`). Clamped to ``period``."""
    cost: float = 0.0
    """Optional optimizer cost of the tensor (e.g. Newton-Schulz flops); used only to break ties."""
    period: int = 0
    """Granules restart every ``period`` elements (one matrix of a stack); must divide ``numel``. ``0``: the
    whole tensor. Normalized to ``numel`` whenever ``granularity`` divides it (the granules are then uniform)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if any(s < 0 for s in self.shape):
            raise ValueError(f"{self.name}: shape {self.shape} has a negative dimension")
        if self.granularity < 1:
            raise ValueError(f"{self.name}: granularity must be >= 1, got {self.granularity}")
        numel = self.numel
        period = self.period or numel
        if self.period < 0 or (numel and numel % period):
            raise ValueError(
                f"{self.name}: period {self.period} does not divide numel {numel} of shape {self.shape}; the period "
                f"is the size of one matrix of a stack (or 0 for the whole tensor)"
            )
        if numel:
            object.__setattr__(self, "granularity", min(self.granularity, period))
            if period % self.granularity == 0:
                period = numel
        object.__setattr__(self, "period", period)

    @classmethod
    def from_granularity(cls, name: str, shape: Sequence[int], granularity: Granularity,
                         cost: float = 0.0) -> TensorSpec:
        """The spec of a tensor of ``shape`` under a named or block-of-rows ``granularity`` (see :func:`granule`)."""
        g, period = granule(shape, granularity)
        return cls(name, tuple(shape), g, cost, period)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_granule_edge(self, offset: int) -> bool:
        """Whether a cut ``offset`` elements into the tensor falls between two granules."""
        return offset % self.period % self.granularity == 0 if self.period else True


@dataclass(frozen=True)
class BufferPlan:
    """The layout of one flat buffer sharded over ``world_size`` ranks.

    ``specs`` are in buffer order and ``offsets[i]`` is where ``specs[i]`` starts. Rank ``k`` owns
    ``[k * shard_size, (k + 1) * shard_size)``.
    """

    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]
    world_size: int
    shard_size: int
    alignment: int = 1
    strategy: str = field(default="", compare=False)
    """Which order produced the plan (informational; not part of :meth:`fingerprint`)."""
    _index: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {s.name: i for i, s in enumerate(self.specs)})
        self.validate()

    # -- sizes --------------------------------------------------------------------------------------
    @property
    def total_numel(self) -> int:
        return sum(s.numel for s in self.specs)

    @property
    def buffer_numel(self) -> int:
        return self.world_size * self.shard_size

    @property
    def padding(self) -> int:
        return self.buffer_numel - self.total_numel

    @property
    def padding_ratio(self) -> float:
        return self.padding / max(self.total_numel, 1)

    # -- lookups ------------------------------------------------------------------------------------
    def index_of(self, name: str) -> int:
        return self._index[name]

    def piece(self, index: int, rank: int) -> tuple[int, int]:
        """Element range ``[start, end)`` *within tensor* ``index`` that ``rank`` owns (may be empty)."""
        off, numel = self.offsets[index], self.specs[index].numel
        lo = max(off, rank * self.shard_size)
        hi = min(off + numel, (rank + 1) * self.shard_size)
        if hi <= lo:
            return (0, 0)
        return (lo - off, hi - off)

    def local_offset(self, index: int, rank: int) -> int:
        """Where ``piece(index, rank)`` starts inside rank ``rank``'s local shard (0 if empty)."""
        start, end = self.piece(index, rank)
        if start == end:
            return 0
        return self.offsets[index] + start - rank * self.shard_size

    def pieces(self, index: int) -> list[tuple[int, int]]:
        return [self.piece(index, r) for r in range(self.world_size)]

    def rank_costs(self) -> list[float]:
        """Each rank's share of ``cost``: a tensor's cost split in proportion to the elements owned."""
        costs = [0.0] * self.world_size
        S = self.shard_size
        for off, spec in zip(self.offsets, self.specs):
            if not spec.cost or not spec.numel:
                continue
            end = off + spec.numel
            for r in range(off // S, (end - 1) // S + 1):
                costs[r] += spec.cost * (min(end, (r + 1) * S) - max(off, r * S)) / spec.numel
        return costs

    def fingerprint(self) -> str:
        """A short hash of the whole layout, equal on ranks that computed the same plan."""
        text = repr((self.world_size, self.shard_size, self.alignment, self.offsets,
                     [(s.name, s.shape, s.granularity, s.period) for s in self.specs]))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def summary(self) -> dict:
        costs = self.rank_costs()
        mean_cost = sum(costs) / len(costs)
        return {
            "num_tensors": len(self.specs),
            "world_size": self.world_size,
            "shard_size": self.shard_size,
            "total_numel": self.total_numel,
            "padding": self.padding,
            "padding_ratio": self.padding_ratio,
            "max_rank_cost": max(costs),
            "cost_imbalance": max(costs) / mean_cost if mean_cost else 1.0,
            "strategy": self.strategy,
        }

    # -- invariants ---------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ``AssertionError`` if the layout breaks an invariant (planner bug, never user input)."""
        S, N = self.shard_size, self.world_size
        assert N >= 1 and S >= 0
        assert len(self.specs) == len(self.offsets)
        assert S % self.alignment == 0, (S, self.alignment)
        spans = sorted(((off, off + s.numel, s) for off, s in zip(self.offsets, self.specs)),
                       key=lambda span: span[:2])
        prev_end = 0
        for lo, hi, spec in spans:
            assert lo >= 0, f"{spec.name} starts at a negative offset {lo}"
            assert lo % self.alignment == 0 or spec.numel == 0, f"{spec.name} misaligned at {lo}"
            assert lo >= prev_end or spec.numel == 0, f"{spec.name} overlaps the previous tensor"
            assert hi <= N * S, f"{spec.name} ends at {hi} past the buffer {N * S}"
            first = lo // S + 1 if S else 0
            for k in range(first, N):
                b = k * S
                if b >= hi:
                    break
                assert spec.is_granule_edge(b - lo), (
                    f"rank boundary {b} cuts {spec.name} inside a granule of {spec.granularity}"
                    + (f" (granules restart every {spec.period})" if spec.period != spec.numel else "")
                )
            prev_end = max(prev_end, hi)


# ---------------------------------------------------------------------------------------------------
# Search
# ---------------------------------------------------------------------------------------------------

_INF = float("inf")
# Earliest-offset evaluations after which the search stops refining below its first feasible size
# (about 0.05 s of CPython). Phase 1 always runs to a feasible size.
_WORK_BUDGET = 40_000
# Refinement candidates: every aligned size if the range holds at most this many; otherwise multiples
# (this many each) of the granularity of the classes holding the most elements.
_LINEAR_STEPS = 64
_MULTIPLES_PER_MODULUS = 8
_BIG_CLASSES = 6
# Phase 2 is skipped when phase 1 ends within 1 / _CLOSE_ENOUGH of the lower bound.
_CLOSE_ENOUGH = 10_000
# Groups of at most this many tensors also try every distinct order (5! = 120 at most).
_EXHAUSTIVE_MAX_TENSORS = 5
# Small groups (at most this many subsets of their classes: prod(count + 1)) get an exact search when the heuristic
# ends above the lower bound: every valid S upward from the bound, each decided exactly by a dynamic program over the
# subsets placed so far, within this many earliest-offset evaluations (about 0.1-0.3 s of CPython).
_EXACT_MAX_STATES = 4096
_EXACT_WORK_BUDGET = 100_000


def _align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def _lcm(x: int, y: int) -> int:
    return x // math.gcd(x, y) * y


def _earliest_offset(c: int, e: int, g: int, L: int, S: int, a: int, P: int = 0) -> int | None:
    """Earliest ``l >= c`` (a multiple of ``a``) where ``e`` elements of granularity ``g`` can start.

    ``L = lcm(g, a)``; ``S`` is a positive multiple of ``a``. Boundaries are all multiples of ``S``
    (the caller checks the end against ``N * S``). Returns ``None`` if no offset works for this ``S``.
    ``P``: the period of granules that restart every ``P`` elements with ``g`` not dividing ``P`` (0: uniform
    granules, at every multiple of ``g``).
    """
    c0 = -(-c // a) * a
    nb = (c0 // S + 1) * S  # first boundary strictly after c0
    if c0 + e <= nb:  # fits before the boundary
        return c0
    if P:
        return _earliest_periodic_offset(c0, e, g, P, S, a)
    if S % g == 0:  # every boundary is a granule edge once l = 0 (mod g)
        r = c0 % L
        return c0 if r == 0 else c0 + L - r
    # g does not divide S: the tensor may hold at most one boundary b, with l = b (mod g).
    l = nb - (nb - c0) // L * L
    if l < nb and l + e <= nb + S:
        return l
    if e <= S:
        return nb
    # Start in the next shard and cross the one after it; the phase repeats shard after shard.
    l = nb + S % L
    return l if l + e <= nb + 2 * S else None


def _earliest_periodic_offset(c0: int, e: int, g: int, P: int, S: int, a: int) -> int | None:
    """:func:`_earliest_offset` for granules of ``g`` that restart every ``P`` elements (``g`` not dividing
    ``P``), for an aligned ``c0`` the tensor cannot start at without crossing a boundary.

    Whether a start works depends only on its position ``u`` inside its shard (every boundary inside the
    tensor must be a granule edge, and they sit at ``S - u``, ``2S - u``, ... into it), so the earliest start
    is the first feasible ``u`` at or after ``c0``'s, else the first one in the next shard.
    """
    base = c0 // S * S
    u0 = c0 - base
    u = _first_feasible_start(u0, S, e, g, P, S, a)
    if u is not None:
        return base + u
    if e <= S:
        return base + S
    u = _first_feasible_start(0, u0, e, g, P, S, a)
    return None if u is None else base + S + u


def _first_feasible_start(u_lo: int, u_hi: int, e: int, g: int, P: int, S: int, a: int) -> int | None:
    """The smallest aligned ``u`` in ``[u_lo, u_hi)`` where a tensor starting ``u`` into a shard holds a
    boundary and has every boundary inside it on a granule edge.

    The first boundary lies ``x = S - u`` into the tensor: walk the granule edges ``x`` downward. An ``x`` with
    one boundary inside works. With ``K`` more boundaries, their phases ``x mod P`` step by ``s = S mod P``:
    either no step wraps past ``P`` (needs ``g | s`` and ``x mod P + K*s < P``) or every step does (needs
    ``g | s - P mod g`` and ``x mod P >= K * (P - s)``), see :func:`_periodic_size_ok`; the walk jumps to the
    next edge that can satisfy it. Two ``x`` that differ by ``lcm(P, a)`` have the same phase and the smaller
    holds more boundaries, so after one such window of multi-boundary candidates nothing further down works.
    """
    x_hi, x_lo = S - u_lo, S - u_hi  # x in (x_lo, x_hi]
    m, rem = divmod(x_hi, P)
    x = m * P + rem // g * g  # the largest granule edge <= x_hi
    last_gap = P - (P - 1) // g * g  # the short last granule of a period
    s = S % P
    no_wrap, all_wrap = s % g == 0, (s - P % g) % g == 0
    stop = None
    while x > x_lo and x > 0:
        if x + S >= e:  # one boundary inside
            if x % a == 0:
                return S - x
        else:
            if stop is None:
                if not (no_wrap or all_wrap):
                    return None  # the step to the next boundary shifts the phase off the granule edges
                stop = x - _lcm(P, a)
            elif x <= stop:
                return None
            K = -(-(e - x) // S) - 1  # boundaries after the first
            phase = x % P
            if no_wrap and phase + K * s >= P:
                top = P - 1 - K * s  # the highest phase whose run of K steps stays below P
                x = x - phase + top // g * g if top >= 0 else x - phase - last_gap
                continue
            if all_wrap and not no_wrap and phase < K * (P - s):
                x = x - phase - last_gap  # no lower phase of this period works: the previous period's top
                continue
            if x % a == 0:
                return S - x
        x -= g if x % P else last_gap
    return None


def _periodic_size_ok(S: int, e: int, g: int, P: int) -> bool:
    """Whether a shard size ``S`` passes the necessary condition for a tensor of ``e`` elements whose granules
    of ``g`` restart every ``P`` (``g`` not dividing ``P``).

    Consecutive boundaries inside the tensor sit at phases ``p, p + s, p + 2s, ... (mod P)`` with
    ``s = S mod P``, each a multiple of ``g``. A step that wraps past ``P`` shifts the phase by ``P mod g``
    (not a multiple of ``g``), so either no step wraps (``g | s``, ``K * s < P``) or every step does
    (``g | P - s``, ``K * (P - s) < P``), over the ``K >= ceil(e / S) - 2`` steps any placement holds; or
    ``s = 0``.
    """
    K = -(-e // S) - 2
    if K < 1:
        return True
    s = S % P
    if s == 0:
        return True
    if s % g == 0 and K * s < P:
        return True
    return (P - s) % g == 0 and K * (P - s) < P


def _next_periodic_size(S: int, e: int, g: int, P: int) -> int:
    """A size ``> S`` below which no size passes :func:`_periodic_size_ok` (a safe jump, not always to a
    passing size)."""
    base, s = S - S % P, S % P
    K_min = -(-e // (base + P)) - 2  # the fewest steps at any size of this period
    if K_min >= 1 and s * K_min >= P:  # past the sizes that never wrap: jump to those that always do
        s = max(s, P - (P - 1) // K_min - 1)
    up = _align_up(s + 1, g)  # the next size that never wraps ...
    down = P - (P - s - 1) // g * g  # ... or always wraps
    return base + min(up, down, P)


class _Item:
    """A non-empty tensor in the search: input index, size, granularity, lcm(g, alignment), the period of
    granules that restart (0 when uniform) and the modulus that makes every crossing free (``M``)."""

    __slots__ = ("L", "M", "P", "cost", "e", "g", "index", "name")

    def __init__(self, index: int, spec: TensorSpec, alignment: int) -> None:
        self.index, self.name = index, spec.name
        self.e, self.g, self.cost = spec.numel, spec.granularity, spec.cost
        self.L = _lcm(spec.granularity, alignment)
        self.P = spec.period if spec.period != spec.numel else 0
        self.M = _lcm(self.P, alignment) if self.P else self.L


class _Search:
    def __init__(self, items: list[_Item], N: int, a: int) -> None:
        self.items, self.N, self.a = items, N, a
        self.work = 0
        self.exact: dict[int, list] = {}  # placements the exact search found, by S
        self.has_cost = any(it.cost for it in items)
        # Fixed orders.
        by_gran = sorted(items, key=lambda it: (-it.g, -it.e, it.name))
        self.fixed = [("module", items), ("granularity", by_gran)]
        # Classes of identical (size, granularity); members keep module order.
        groups: dict[tuple[int, int, int], list[_Item]] = {}
        for it in items:
            groups.setdefault((it.e, it.g, it.P), []).append(it)
        self.classes = classes = list(groups.values())

        def by(key):  # class indices sorted by key(first member)
            return sorted(range(len(classes)), key=lambda k: key(classes[k][0]))

        self.total = sum(it.e for it in items)
        self.greedy = [
            ("greedy-granularity", by(lambda it: (-it.g, -it.e, it.name)), False),
            ("greedy-size", by(lambda it: (-it.e, -it.g, it.name)), False),
            ("budgeted-granularity", by(lambda it: (-it.g, -it.e, it.name)), True),
            ("budgeted-size", by(lambda it: (-it.e, -it.g, it.name)), True),
        ]
        self.fill_order = by(lambda it: (-it.e, it.name))
        # Tiny groups (a root group: embedding, norm, head): every distinct order is cheap to try.
        self.exhaustive: list[tuple[str, list[_Item]]] = []
        if len(items) <= _EXHAUSTIVE_MAX_TENSORS:
            cls = {id(it): k for k, m in enumerate(classes) for it in m}
            seen: set[tuple[int, ...]] = set()
            for perm in itertools.permutations(items):
                key = tuple(cls[id(it)] for it in perm)
                if key not in seen:
                    seen.add(key)
                    self.exhaustive.append(("exhaustive", list(perm)))

    # -- one order at one S -------------------------------------------------------------------------
    def place_fixed(self, order: list[_Item], S: int, stop: float) -> tuple[Optional[list], float]:
        a, c = self.a, 0
        out: list[tuple[_Item, int]] = []
        for it in order:
            l = _earliest_offset(c, it.e, it.g, it.L, S, a, it.P)
            if l is None or l > stop:
                self.work += len(out) + 1
                return None, _INF
            out.append((it, l))
            c = l + it.e
        self.work += len(order)
        return out, c

    def place_greedy(self, order: list[int], S: int, stop: float, budgeted: bool) -> tuple[Optional[list], float]:
        """Boundary-aware fill: at each step take the class needing the least padding (ties: class
        ``order``), and before an unavoidable gap, fill it with the largest remaining tensors that fit."""
        a, classes, N = self.a, self.classes, self.N
        ptr = [0] * len(classes)
        active, fill_active = list(order), list(self.fill_order)
        c, out, work, left = 0, [], 0, self.total
        while active:
            # Padding the rest of the buffer can afford per remaining boundary: a class whose padding
            # fits in it is taken in class order (keeping flexible tensors for harder boundaries).
            allow = max(0, (N * S - c - left) // max(1, N - c // S)) if budgeted else 0
            best, best_l = -1, None
            for k in active:
                it = classes[k][ptr[k]]
                l = _earliest_offset(c, it.e, it.g, it.L, S, a, it.P)
                work += 1
                if l is not None and (best_l is None or l < best_l):
                    best, best_l = k, l
                    if l - c < a or l - c <= allow:  # cannot do better, or good enough
                        break
            if best_l is None or best_l > stop:
                self.work += work
                return None, _INF
            if best_l - c >= a:
                # Gap before the chosen tensor: fill it with the largest remaining tensors that fit.
                exhausted = False
                for k in fill_active:
                    members = classes[k]
                    if k == best or members[0].e > best_l - c:
                        continue
                    while ptr[k] < len(members):
                        it = members[ptr[k]]
                        l = _earliest_offset(c, it.e, it.g, it.L, S, a, it.P)
                        work += 1
                        if l is None or l + it.e > best_l:
                            break
                        out.append((it, l))
                        c = l + it.e
                        left -= it.e
                        ptr[k] += 1
                    exhausted |= ptr[k] == len(members)
                    if best_l - c < a:
                        break
                if exhausted:
                    fill_active = [k for k in fill_active if ptr[k] < len(classes[k])]
                    active = [k for k in active if ptr[k] < len(classes[k])]
            members = classes[best]
            out.append((members[ptr[best]], best_l))
            c = best_l + members[ptr[best]].e
            left -= members[ptr[best]].e
            ptr[best] += 1
            if ptr[best] == len(members):
                active.remove(best)
                fill_active.remove(best)
        self.work += work
        return out, c

    def place_lpt(self, S: int) -> tuple[Optional[list], float]:
        """Whole tensors to ranks by longest processing time first (cost, then size, then name)."""
        a, N = self.a, self.N
        if any(it.e > S for it in self.items):
            return None, _INF
        used = [0] * N
        heap = [(0.0, r) for r in range(N)]
        per_rank: list[list[_Item]] = [[] for _ in range(N)]
        for it in sorted(self.items, key=lambda it: (-it.cost, -it.e, it.name)):
            skipped = []
            while heap:
                cost, r = heapq.heappop(heap)
                if _align_up(used[r], a) + it.e <= S:
                    used[r] = _align_up(used[r], a) + it.e
                    per_rank[r].append(it)
                    heapq.heappush(heap, (cost + it.cost, r))
                    break
                skipped.append((cost, r))
            else:
                self.work += len(self.items)
                return None, _INF
            for entry in skipped:
                heapq.heappush(heap, entry)
        self.work += len(self.items)
        out, end = [], 0
        for r in range(N):
            c = r * S
            for it in sorted(per_rank[r], key=lambda it: it.index):
                c = _align_up(c, a)
                out.append((it, c))
                c += it.e
                end = c
        return out, end

    # -- all orders at one S ------------------------------------------------------------------------
    def evaluate(self, S: int, need_end: bool) -> tuple[Optional[tuple[str, list]], float]:
        """The first feasible placement at ``S`` in strategy order (or None), and the smallest end
        reached (only when ``need_end``; otherwise a try stops as soon as it cannot fit)."""
        limit = self.N * S
        stop = _INF if need_end else limit
        best_end = _INF
        for name, order in self.fixed:
            out, end = self.place_fixed(order, S, stop)
            if out is not None and end <= limit:
                return (name, out), end
            best_end = min(best_end, end)
        for name, order, budgeted in self.greedy:
            out, end = self.place_greedy(order, S, stop, budgeted)
            if out is not None and end <= limit:
                return (name, out), end
            best_end = min(best_end, end)
        for name, order in self.exhaustive:
            out, end = self.place_fixed(order, S, stop)
            if out is not None and end <= limit:
                return (name, out), end
            best_end = min(best_end, end)
        return None, best_end

    def exact_states(self) -> int:
        """Subsets of the classes the exact search walks (``prod(count + 1)``)."""
        return math.prod(len(members) + 1 for members in self.classes)

    def place_exact(self, S: int, budget: int) -> tuple[Optional[list], bool]:
        """Whether some order of the tensors fits at ``S``, decided exactly: the earliest feasible offset is monotone
        in where the previous tensor ended, so among the orders of one subset of tensors only the one ending first
        matters, and a dynamic program over subsets (as counts per class of identical tensors) finds the earliest
        end of every subset. Returns the placement (or None) and whether it finished within ``budget``
        earliest-offset evaluations."""
        a, N, classes = self.a, self.N, self.classes
        limit = N * S
        start = (0,) * len(classes)
        layer: dict[tuple[int, ...], int] = {start: 0}
        back: dict[tuple[int, ...], tuple[tuple[int, ...], int, int]] = {}
        sizes = [[0] + list(itertools.accumulate(it.e for it in members)) for members in classes]  # of the first u
        for _ in range(len(self.items)):
            nxt: dict[tuple[int, ...], int] = {}
            for state, c in layer.items():
                if c + self.total - sum(sizes[k][u] for k, u in enumerate(state)) > limit:
                    continue  # the tensors left do not fit behind this end, whatever their order
                for k, members in enumerate(classes):
                    used = state[k]
                    if used == len(members):
                        continue
                    it = members[used]
                    self.work += 1
                    budget -= 1
                    l = _earliest_offset(c, it.e, it.g, it.L, S, a, it.P)
                    if l is None or l + it.e > limit:
                        continue
                    to = state[:k] + (used + 1,) + state[k + 1:]
                    if to not in nxt or l + it.e < nxt[to]:
                        nxt[to] = l + it.e
                        back[to] = (state, k, l)
            if budget < 0:
                return None, False
            if not nxt:
                return None, True
            layer = nxt
        (state,) = layer
        out = []
        while state != start:
            prev, k, l = back[state]
            out.append((classes[k][prev[k]], l))
            state = prev
        return out[::-1], True

    def most_balanced(self, S: int) -> tuple[str, list]:
        """Among every strategy feasible at ``S`` (plus LPT on cost), the lowest maximum rank cost."""
        limit = self.N * S
        feasible: list[tuple[float, int, str, list]] = []
        runs = [(name, self.place_fixed(order, S, limit)) for name, order in self.fixed]
        if S in self.exact:
            runs.append(("exact", (self.exact[S], 0)))
        runs += [(name, self.place_greedy(order, S, limit, budgeted)) for name, order, budgeted in self.greedy]
        runs += [(name, self.place_fixed(order, S, limit)) for name, order in self.exhaustive]
        runs.append(("lpt-cost", self.place_lpt(S)))
        for name, (out, end) in runs:
            if out is not None and end <= limit:
                feasible.append((self._max_rank_cost(out, S), len(feasible), name, out))
        _, _, name, out = min(feasible, key=lambda f: f[:2])
        return name, out

    def _max_rank_cost(self, out: list, S: int) -> float:
        costs = [0.0] * self.N
        for it, l in out:
            if it.cost:
                end = l + it.e
                for r in range(l // S, (end - 1) // S + 1):
                    costs[r] += it.cost * (min(end, (r + 1) * S) - max(l, r * S)) / it.e
        return max(costs)


class _ValidSizes:
    """Shard sizes a plan can use (``N > 1``): multiples of ``a`` and of the granularity of each tensor
    longer than ``2S`` (it holds two consecutive boundaries, so both must be granule edges); and a
    tensor with ``S < e <= 2S`` whose granularity does not divide ``S`` holds exactly one boundary
    ``b`` and starts at ``l = b (mod L)``, ``l >= b - S``, so it needs ``e <= 2S - (S mod L)``. Granules
    that restart every ``P`` (``g`` not dividing ``P``) need :func:`_periodic_size_ok` instead of ``g | S``."""

    def __init__(self, items: Sequence[_Item], a: int) -> None:
        self.by_size = sorted(items, key=lambda it: it.e)
        self.sizes = [it.e for it in self.by_size]
        by_threshold = sorted(items, key=lambda it: (it.e + 1) // 2)
        # A tensor is forced while S < ceil(e / 2).
        self.thresholds = [(it.e + 1) // 2 for it in by_threshold]
        self.suffix_lcm = [a] * (len(by_threshold) + 1)
        for k in range(len(by_threshold) - 1, -1, -1):
            self.suffix_lcm[k] = _lcm(self.suffix_lcm[k + 1], 1 if by_threshold[k].P else by_threshold[k].g)
        self.periodic = [it for it in items if it.P]
        self.a = a

    def next(self, S: int) -> int:
        """The smallest valid size ``>= S``."""
        while True:
            S = _align_up(S, self.a)
            k = bisect.bisect_right(self.thresholds, S)  # tensors k.. are forced at S
            S2 = _align_up(S, self.suffix_lcm[k])
            if k < len(self.thresholds) and self.thresholds[k] <= S2:
                S = self.thresholds[k]  # the forced set shrinks there
                continue
            S = S2
            bump = S
            lo, hi = bisect.bisect_right(self.sizes, S), bisect.bisect_right(self.sizes, 2 * S)
            for it in self.by_size[lo:hi]:
                short = it.e + S % it.L - 2 * S
                if short > 0 and S % it.g and not it.P:
                    # Each step of a (within one period of L) gains a: step until it fits, or to the
                    # next multiple of L, whichever comes first.
                    bump = max(bump, min(S + _align_up(short, self.a), _align_up(S + 1, it.L)))
            for it in self.periodic:
                if it.e > 2 * S and not _periodic_size_ok(S, it.e, it.g, it.P):
                    bump = max(bump, _next_periodic_size(S, it.e, it.g, it.P))
            if bump == S:
                return S
            S = bump


def shard_size_lower_bound(specs: Sequence[TensorSpec], world_size: int, *, alignment: int = 1) -> int:
    """A lower bound on the shard size ``S`` of any valid plan (what :func:`plan_buffer` starts from).

    With ``N > 1``: ``S >= ceil(total / N)`` (each tensor starting aligned); ``S >= g_t`` (a granule
    longer than a shard holds a boundary); ``S >= e * ceil(n / N)`` for ``n`` whole tensors (``g = e``)
    of size ``e``; ``g_t`` divides ``S`` for every tensor longer than ``2S`` (it holds two consecutive
    boundaries); and a tensor with ``S < e_t <= 2S`` whose granularity does not divide ``S`` needs
    ``e_t <= 2S - (S mod lcm(g_t, alignment))`` (it holds exactly one boundary, at a granule edge).
    Padding at this bound is unavoidable; ``plan_buffer`` often reaches it exactly.
    """
    _check_args(specs, world_size, alignment)
    items = [_Item(i, s, alignment) for i, s in enumerate(specs) if s.numel]
    return _lower_bound(items, world_size, alignment)


def _lower_bound(items: Sequence[_Item], N: int, a: int) -> int:
    if not items:
        return 0
    sizes = [_align_up(it.e, a) for it in items]
    need = sum(sizes) - max(s - it.e for s, it in zip(sizes, items))
    if N == 1:
        return _align_up(need, a)
    S = max(-(-need // N), max(it.g for it in items))
    # Whole tensors (g = e) never straddle a boundary, so a shard holds at most floor(S / e) of size e.
    whole: dict[int, int] = {}
    for it in items:
        if it.g == it.e:
            whole[it.e] = whole.get(it.e, 0) + 1
    for e, count in whole.items():
        S = max(S, e * -(-count // N))
    return _ValidSizes(items, a).next(S)


def _check_args(specs: Sequence[TensorSpec], world_size: int, alignment: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"alignment must be an int >= 1 (elements), got {alignment!r}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"tensor names in a group must be unique, got duplicates {dup}")


def plan_buffer(specs: Sequence[TensorSpec], world_size: int, *, alignment: int = 1) -> BufferPlan:
    """Choose an order, offsets and the shard size ``S`` for ``specs`` on ``world_size`` ranks.

    Minimizes ``S`` (so the padding ``N*S - total``) with cuts only at granule edges, then, among the
    orders that reach that ``S``, balances ``cost`` across ranks. See [Note: how plan_buffer searches].

    Args:
        specs: the group's tensors, in module order (names must be unique). Zero-size tensors are
            allowed and placed first, at offset 0.
        world_size: the number of ranks ``N`` the buffer is sharded over.
        alignment: offsets and ``S`` are multiples of this many elements (e.g. 16 bytes for NCCL).

    Returns:
        A validated :class:`BufferPlan`, identical for identical inputs (same list, same order).

    .. note::
        Every input has a plan (``S`` can grow until each tensor fits whole on one rank), but it can be
        a poor one: whole-tensor granularity with fewer tensors than ranks leaves ranks empty, and a
        granularity that does not divide ``ceil(total / N)`` forces ``S`` up for tensors longer than
        ``2S``. ``shard_size_lower_bound`` tells how much is unavoidable.
    """
    _check_args(specs, world_size, alignment)
    specs = tuple(specs)
    N, a = world_size, alignment
    empty = [s for s in specs if s.numel == 0]
    items = [_Item(i, s, a) for i, s in enumerate(specs) if s.numel]

    def build(name: str, out: list, S: int) -> BufferPlan:
        out = sorted(out, key=lambda p: p[1])
        order = tuple(empty) + tuple(specs[it.index] for it, _ in out)
        offsets = (0,) * len(empty) + tuple(l for _, l in out)
        return BufferPlan(order, offsets, N, S, a, strategy=name)

    if not items:
        return BufferPlan(tuple(empty), (0,) * len(empty), N, 0, a, strategy="empty")
    search = _Search(items, N, a)
    if N == 1:
        out, end = search.place_fixed(items, _align_up(sum(it.e for it in items) + len(items) * a, a), _INF)
        assert out is not None, "one rank holds every tensor: module order always fits"
        return build("module", out, _align_up(int(end), a))

    S, (name, out) = _search_shard_size(search, items, N, a)
    if search.has_cost:
        name, out = search.most_balanced(S)
    return build(name, out, S)


def _search_shard_size(search: _Search, items: list[_Item], N: int, a: int) -> tuple[int, tuple[str, list]]:
    """The smallest shard size found feasible, and the preferred placement there."""
    lb = _lower_bound(items, N, a)
    valid = _ValidSizes(items, a)
    tried: set[int] = set()

    # Phase 1: from the lower bound, jump to where the padding the last try needed would fit; the
    # step at least doubles from one failed jump to the next, so the search ends in a few tries even
    # when the padding needed grows with S (phase 2 then looks below).
    S, step = lb, 0
    while True:
        tried.add(S)
        found, end = search.evaluate(S, need_end=True)
        if found is not None:
            break
        needed = a if end == _INF else max(a, -(-int(end) // N) - S)
        step = max(needed, 2 * step)
        S = valid.next(S + step)
    best_S, best = S, found
    if (best_S - lb) * _CLOSE_ENOUGH <= lb:  # on the bound, or within 0.01% of it
        return best_S, best

    # Phase 2: a jump may step over feasible sizes. Within the work budget, try the sizes below it
    # that make the big classes' granularity divide S (their crossings become padding-free) or let a
    # shard hold one more of their tensors, then the other multiples, and every aligned size when the
    # range is small.
    volume: dict[tuple[int, int], int] = {}
    for it in items:
        volume[(it.e, it.M)] = volume.get((it.e, it.M), 0) + it.e
    big = sorted(volume, key=lambda k: (-volume[k], k))[:_BIG_CLASSES]
    total_lcm = a
    for it in items:
        total_lcm = _lcm(total_lcm, it.M)
    structural = {valid.next(_align_up(lb, total_lcm))}
    for e, _ in big:
        structural.add(valid.next(_align_up(max(lb, _align_up(e, a)), _align_up(e, a))))
    # Other candidates round-robin over the moduli (the first multiple of each, then the second, ...),
    # so that a small modulus cannot use up the budget just above the bound.
    others: dict[int, tuple[int, int]] = {}
    moduli = sorted({L for _, L in big if a < L} | {total_lcm})
    if (best_S - lb) // a <= _LINEAR_STEPS:
        moduli = [a] + moduli
    for m in moduli:
        S = lb
        for rank in range(_LINEAR_STEPS if m == a else _MULTIPLES_PER_MODULUS):
            S = valid.next(_align_up(S + 1, m))
            if best_S <= S:
                break
            others[S] = min(others.get(S, (rank, S)), (rank, S))
    queue = sorted(structural - tried) + sorted(set(others) - structural - tried, key=lambda S: others[S])
    for S in queue:
        if best_S <= S or search.work >= _WORK_BUDGET:
            continue
        found, _ = search.evaluate(S, need_end=False)
        if found is not None:
            best_S, best = S, found

    # Phase 3, small groups: every valid size from the bound up, each decided exactly (place_exact), until one
    # fits or the budget is spent; the first that fits is the optimum.
    if best_S > lb and search.exact_states() <= _EXACT_MAX_STATES:
        budget, S = _EXACT_WORK_BUDGET, lb
        while best_S > S and budget > 0:
            before = search.work
            out, complete = search.place_exact(S, budget)
            budget -= search.work - before
            if out is not None:
                search.exact[S] = out
                return S, ("exact", out)
            if not complete:
                break
            S = valid.next(S + a)
    return best_S, best

"""Structure-aware planner: lay a group's tensors into one flat buffer and choose the rank cuts.

The problem (DESIGN.md, "Planner problem"): place each tensor ``t`` (``e_t`` elements, granularity
``g_t``) at ``[l_t, l_t + e_t)`` of a buffer of ``N * S`` elements, rank ``k`` owning
``[k*S, (k+1)*S)``, and minimize ``S`` subject to: no rank boundary falls strictly inside a granule of
a tensor, tensors are contiguous (padding only between tensors), every rank's piece has size ``S``.

The planner is pure and deterministic: every rank computes the same plan from the same inputs with no
communication, and :meth:`BufferPlan.fingerprint` lets ranks check that they agree.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Sequence, Union

__all__ = ["Granularity", "TensorSpec", "BufferPlan", "granularity_numel", "plan_buffer"]

# "element" | "row" | "tensor" | int (a block of that many rows)
Granularity = Union[str, int]


def granularity_numel(shape: Sequence[int], granularity: Granularity) -> int:
    """Number of contiguous elements that must stay on one rank for ``granularity`` on ``shape``.

    ``"element"`` -> 1, ``"row"`` -> ``prod(shape[1:])``, ``k`` (int) -> ``k * prod(shape[1:])`` (a block
    of ``k`` rows, e.g. 128 for 128x128 quantization blocks), ``"tensor"`` -> ``numel``.
    """
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    if granularity == "element":
        return 1
    if granularity == "row":
        return max(row, 1) if numel else 1
    if granularity == "tensor":
        return max(numel, 1)
    if isinstance(granularity, int) and not isinstance(granularity, bool) and granularity > 0:
        if len(shape) == 0 or shape[0] % granularity != 0:
            raise ValueError(
                f"granularity of {granularity} rows does not divide the {shape[0] if shape else 0} rows of a "
                f"tensor of shape {shape}. Use a block size that divides the first dimension, "
                f"or 'row' / 'tensor'."
            )
        return max(granularity * row, 1)
    raise ValueError(
        f"unknown granularity {granularity!r}: expected 'element', 'row', 'tensor' or a positive int "
        f"number of rows"
    )


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to place in a buffer."""

    name: str
    """Unique name within the group (the parameter's FQN)."""
    shape: tuple[int, ...]
    """Global (unsharded) shape."""
    granularity: int = 1
    """Contiguous elements that must stay on one rank; must divide ``numel`` (see granularity_numel)."""
    cost: float = 0.0
    """Optional optimizer cost of the tensor (e.g. Newton-Schulz flops); used only to break ties."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if self.granularity < 1:
            raise ValueError(f"{self.name}: granularity must be >= 1, got {self.granularity}")
        if self.numel % self.granularity != 0:
            raise ValueError(
                f"{self.name}: granularity {self.granularity} does not divide numel {self.numel} of shape "
                f"{self.shape}. Choose a granularity that divides the tensor (element, row, a block of rows "
                f"dividing dim 0, or the whole tensor)."
            )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


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
    _index: dict = field(default=None, init=False, repr=False, compare=False)  # type: ignore[assignment]

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

    def fingerprint(self) -> str:
        """A short hash of the whole layout, equal on ranks that computed the same plan."""
        text = repr((self.world_size, self.shard_size, self.alignment, self.offsets,
                     [(s.name, s.shape, s.granularity) for s in self.specs]))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def summary(self) -> dict:
        return {
            "num_tensors": len(self.specs),
            "world_size": self.world_size,
            "shard_size": self.shard_size,
            "total_numel": self.total_numel,
            "padding": self.padding,
            "padding_ratio": self.padding_ratio,
        }

    # -- invariants ---------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ``AssertionError`` if the layout breaks an invariant (planner bug, never user input)."""
        S, N = self.shard_size, self.world_size
        assert N >= 1 and S >= 0
        assert len(self.specs) == len(self.offsets)
        assert S % self.alignment == 0, (S, self.alignment)
        spans = sorted((off, off + s.numel, s) for off, s in zip(self.offsets, self.specs))
        prev_end = 0
        for lo, hi, spec in spans:
            assert lo % self.alignment == 0 or spec.numel == 0, f"{spec.name} misaligned at {lo}"
            assert lo >= prev_end or spec.numel == 0, f"{spec.name} overlaps the previous tensor"
            assert hi <= N * S, f"{spec.name} ends at {hi} past the buffer {N * S}"
            first = lo // S + 1 if S else 0
            for k in range(first, N):
                b = k * S
                if b >= hi:
                    break
                assert (b - lo) % spec.granularity == 0, (
                    f"rank boundary {b} cuts {spec.name} inside a granule of {spec.granularity}"
                )
            prev_end = max(prev_end, hi)


def _align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def _earliest_offset(cursor: int, numel: int, g: int, S: int, limit: int, align: int) -> int | None:
    """Earliest aligned offset >= cursor where a tensor of (numel, g) has no boundary inside a granule."""
    l = _align_up(cursor, align)
    while l + numel <= limit:
        first_b = (l // S + 1) * S
        if first_b >= l + numel:
            return l
        # Every boundary inside must be a multiple of g away from l.
        bad = None
        b = first_b
        while b < l + numel:
            if (b - l) % g:
                bad = b
                break
            b += S
        if bad is None:
            return l
        # Shift so that the offending boundary lands on a granule edge, or start at the boundary.
        shift = (bad - l) % g
        cand = l + shift
        if cand % align:
            cand = _align_up(cand, align)
        l = cand if cand > l else _align_up(l + 1, align)
    return None


def _place(order: Sequence[TensorSpec], S: int, N: int, align: int) -> list[int] | None:
    cursor, offsets = 0, []
    for spec in order:
        if spec.numel == 0:
            offsets.append(cursor)
            continue
        l = _earliest_offset(cursor, spec.numel, spec.granularity, S, N * S, align)
        if l is None:
            return None
        offsets.append(l)
        cursor = l + spec.numel
    return offsets


def plan_buffer(specs: Sequence[TensorSpec], world_size: int, *, alignment: int = 1) -> BufferPlan:
    """Choose an order, offsets and the shard size ``S`` for ``specs`` on ``world_size`` ranks.

    Args:
        specs: the group's tensors, in module order (names must be unique).
        world_size: the number of ranks ``N`` the buffer is sharded over.
        alignment: offsets and ``S`` are multiples of this many elements (e.g. 16 bytes for NCCL).

    Returns:
        A :class:`BufferPlan`; deterministic for the same inputs.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"tensor names in a group must be unique, got duplicates in {names}")
    specs = tuple(specs)
    total = sum(s.numel for s in specs)
    if total == 0:
        return BufferPlan(specs, tuple(0 for _ in specs), world_size, 0, alignment)
    orders = [specs, tuple(sorted(specs, key=lambda s: (-s.granularity, -s.numel, s.name)))]
    S = _align_up(-(-total // world_size), alignment)
    step = alignment
    while True:
        for order in orders:
            offsets = _place(order, S, world_size, alignment)
            if offsets is not None:
                return BufferPlan(tuple(order), tuple(offsets), world_size, S, alignment)
        S += step
        # Grow the step geometrically far from the bound so the search ends quickly.
        if S > 2 * total // world_size + 1:
            step = max(step, _align_up(S // 64, alignment))

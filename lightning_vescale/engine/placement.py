"""RaggedShard: a placement over a tensor's flat row-major storage, and the chunk math around it.

The math
--------
A tensor of shape ``(d_0, ..., d_{n-1})`` is seen as its flat row-major storage of
``numel = d_0 * ... * d_{n-1}`` elements. ``RaggedShard(dims=(0, ..., k-1), local_units)`` cuts that
storage into ``world_size`` consecutive pieces, each a whole number of *units* of
``u = d_k * ... * d_{n-1}`` elements (the uncut trailing dims). Rank ``r`` owns::

    [U_r * u, (U_r + local_units[r]) * u),    U_r = local_units[0] + ... + local_units[r-1],

and ``sum(local_units) == d_0 * ... * d_{k-1}``. ``k = 1`` cuts only between rows (FSDP2's
``Shard(0)`` is the case of equal row shares), ``k = n`` cuts anywhere (element granularity). A
granularity ``g`` (DESIGN.md) is honoured iff every cut is a multiple of ``g``.

A flat range ``[a, b)`` is, in N-D, a union of at most ``2n - 1`` boxes (hyper-rectangles, each a
contiguous flat range itself): a partial innermost row at the start, whole blocks in the middle, a
partial row at the end, recursively (:func:`flat_range_to_boxes`). These boxes are the chunk
metadata (offsets, sizes) that a ``torch.distributed.checkpoint`` save writes for a local piece.

Changing placement is one ``all_to_all_single``: with source ranges ``S_i`` and destination ranges
``D_j`` over the same flat index space, rank ``i`` sends rank ``j`` the intersection ``S_i ∩ D_j``.
Every rank knows every range, so the split sizes need no communication and nothing is gathered.

Collectives here never assume a device or backend: buffers are made on the input's device. Float8
tensors travel as ``uint8`` views (gloo rejects float8 dtypes; bytes move the same everywhere).
"""

from __future__ import annotations

import bisect
import math
import operator
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

__all__ = [
    "RaggedShard",
    "ReorderedRaggedShard",
    "flat_range_to_boxes",
    "shard_tensor",
    "gather_full",
    "redistribute",
    "redistribute_flat",
]

Shape = tuple[int, ...]
FlatRange = tuple[int, int]
Box = tuple[tuple[int, ...], tuple[int, ...]]
"""``(offsets, sizes)`` of an N-D hyper-rectangle."""


def _as_shape(shape: Sequence[int]) -> Shape:
    return tuple(operator.index(s) for s in shape)


def _unravel(index: int, shape: Shape) -> tuple[int, ...]:
    """Row-major N-D index of flat ``index``; dim 0 is unbounded, so ``numel`` maps to ``(d_0, 0, ...)``."""
    out = []
    for d in reversed(shape[1:]):
        index, rem = divmod(index, d) if d else (index, 0)
        out.append(rem)
    out.append(index)
    return tuple(reversed(out))


def flat_range_to_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """Decompose the row-major flat range ``[start, end)`` of ``shape`` into N-D boxes.

    Returns ``(offsets, sizes)`` pairs in flat order; each box is itself a contiguous flat range and
    together they cover ``[start, end)`` exactly. A range of whole rows of dim 0 is one box; any range
    takes at most ``2 * ndim - 1`` boxes (a partial row at the start and one at the end, split
    recursively over the inner dims, and one block of whole rows between them). An empty range gives
    ``[]``.
    """
    shape = _as_shape(shape)
    numel = math.prod(shape)
    if not 0 <= start <= end <= numel:
        raise ValueError(
            f"flat range [{start}, {end}) is not inside [0, {numel}) of shape {shape}; "
            f"expected 0 <= start <= end <= numel."
        )
    return _boxes(shape, start, end)


def _boxes(shape: Shape, start: int, end: int) -> list[Box]:
    if start == end:
        return []
    if not shape:
        return [((), ())]
    rest = shape[1:]
    inner = math.prod(rest)  # > 0: the range is non-empty, so no dim is 0
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(end, inner)
    if r0 == r1:
        return [((r0, *o), (1, *s)) for o, s in _boxes(rest, c0, c1)]
    out = []
    if c0:
        out += [((r0, *o), (1, *s)) for o, s in _boxes(rest, c0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0, *(0,) * len(rest)), (r1 - r0, *rest)))
    if c1:
        out += [((r1, *o), (1, *s)) for o, s in _boxes(rest, 0, c1)]
    return out


@dataclass(frozen=True)
class RaggedShard(Shard):
    """A placement of a tensor over ranks as consecutive pieces of its flat row-major storage.

    ``dims = (0, 1, ..., k-1)`` are the leading dims that may be cut, so every piece is a whole number
    of units of ``prod(shape[k:])`` contiguous elements; rank ``r`` holds ``local_units[r]`` units
    (uneven, possibly zero), ranks in order. ``Shard(0)`` of FSDP2 is the special case ``dims=(0,)``
    with equal row shares (:meth:`even`). :meth:`from_flat_ranges` builds the placement from the
    per-rank flat ranges a :class:`~lightning_vescale.engine.planner.BufferPlan` gives.

    The placement does not store the tensor's shape: every method takes the global ``shape``.
    """

    dims: tuple[int, ...]
    """The leading dims that may be cut: ``(0, 1, ..., k-1)`` with ``k >= 1``."""
    local_units: tuple[int, ...]
    """Units per rank, in rank order; non-negative and summing to ``prod(shape[:k])``."""

    # [Note: RaggedShard as a DTensor placement]
    # It is a ``torch.distributed.tensor.Shard`` on dim 0 (the dim its cuts start from), so DTensor-aware code sees
    # a sharded tensor: ``torch.distributed.checkpoint.state_dict`` gathers it, ``distribute_tensor(full, mesh,
    # placements)`` accepts it (and makes torch's even ``Shard(0)``, which a sharded parameter copies from), and
    # ``compute_local_shape_and_global_offset`` asks it for its rows (:meth:`_local_shard_size_and_offset`). Its
    # pieces are not ``torch.chunk`` slices, so every transform DTensor would run with ``Shard``'s even-chunk
    # arithmetic raises instead (``_split_tensor`` and the redistribute steps below); a RaggedTensor redistributes
    # itself. Shard is a pybind11 class whose own __init__ must run first: the dataclass keeps this __init__.
    def __init__(self, dims: Sequence[int], local_units: Sequence[int]) -> None:
        Shard.__init__(self, 0)
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "local_units", local_units)
        self.__post_init__()

    def __reduce__(self) -> tuple:
        return (type(self), (self.dims, self.local_units))

    def __eq__(self, other: object) -> bool:
        # Never equal to a plain Shard(0) (whose C++ equality would otherwise answer for a mixed comparison), nor
        # to a subclass's placement with the same pieces (its storage order differs): the same type only.
        return type(other) is type(self) and (self.dims, self.local_units) == (other.dims, other.local_units)

    def __hash__(self) -> int:
        return hash((type(self), self.dims, self.local_units))

    def __str__(self) -> str:
        return f"RS{self.local_units}"

    # torch's private hook takes a symbolic rank too; a RaggedShard's rank is always a plain int.
    def _local_shard_size_and_offset(  # type: ignore[override]
        self, curr_local_size: int, num_chunks: int, rank: int
    ) -> tuple[int, int]:
        """Rows of dim 0 that hold ``rank``'s piece: ``(count, first)``; for a piece cut inside rows (element
        granularity), the rows that cover it (``to_local()`` is then the flat piece, not those rows)."""
        if num_chunks != self.world_size:
            raise ValueError(f"{self} spreads a tensor over {self.world_size} ranks, not {num_chunks}")
        units_per_row, rest = divmod(sum(self.local_units), max(curr_local_size, 1))
        if rest or units_per_row == 0:
            raise ValueError(f"{self} does not fit a tensor with {curr_local_size} rows")
        start = sum(self.local_units[:rank])
        end = start + self.local_units[rank]
        first, last = start // units_per_row, -(-end // units_per_row)
        return (last - first if end > start else 0), first

    def _refuse(self, *args: object, **kwargs: object) -> object:
        raise NotImplementedError(
            f"{self} cuts a tensor's flat storage unevenly; DTensor's even Shard(0) arithmetic does not apply to it. "
            f"Redistribute a lightning_vescale RaggedTensor itself (its .redistribute / .full_tensor()), or "
            f"distribute a full tensor with RaggedTensor.from_full."
        )

    _split_tensor = _shard_tensor = _reduce_shard_tensor = _to_replicate_tensor = _refuse  # type: ignore[assignment]
    _replicate_to_shard = _to_new_shard_dim = _select_split_tensor = _refuse  # type: ignore[assignment]

    def __post_init__(self) -> None:
        dims = tuple(operator.index(d) for d in self.dims)
        units = tuple(operator.index(u) for u in self.local_units)
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "local_units", units)
        if not dims or dims != tuple(range(len(dims))):
            raise ValueError(
                f"RaggedShard dims must be the leading dims (0, 1, ..., k-1) with k >= 1, got {dims}. "
                f"Use dims=(0,) to cut only between rows, or dims=tuple(range(ndim)) to cut anywhere."
            )
        if not units:
            raise ValueError("RaggedShard local_units must have one entry per rank, got an empty tuple.")
        negative = {r: u for r, u in enumerate(units) if u < 0}
        if negative:
            raise ValueError(
                f"RaggedShard local_units must be non-negative, got negative units {negative} "
                f"(rank: units) in {units}. A rank that holds nothing has 0 units."
            )

    # -- constructors -------------------------------------------------------------------------------
    @classmethod
    def even(cls, shape: Sequence[int], world_size: int, dims: Sequence[int] = (0,)) -> RaggedShard:
        """Equal shares where possible, split like ``torch.chunk`` (FSDP2's ``Shard(0)`` for ``dims=(0,)``).

        With ``n = prod(shape[:len(dims)])`` units, every rank gets ``ceil(n / world_size)`` units
        until they run out, then the rest and zeros: 10 rows on 4 ranks give ``(3, 3, 3, 1)``, 5 rows
        on 4 ranks ``(2, 2, 1, 0)``; shares are equal whenever ``world_size`` divides ``n``.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        shape = _as_shape(shape)
        dims = tuple(dims)
        _check_ndim(shape, len(dims))
        n = math.prod(shape[: len(dims)])
        chunk = -(-n // world_size)
        return cls(dims, tuple(min(chunk, max(0, n - r * chunk)) for r in range(world_size)))

    @classmethod
    def from_flat_ranges(cls, shape: Sequence[int], ranges: Sequence[tuple[int, int]]) -> RaggedShard:
        """The placement whose rank ``r`` owns the flat element range ``ranges[r]`` of ``shape``.

        ``ranges`` has one ``(start, end)`` per rank; the non-empty ones must tile ``[0, numel)`` in
        rank order, and empty ones may be given as ``(0, 0)`` (as ``BufferPlan.piece`` does). The
        coarsest unit is chosen, i.e. the fewest cut dims ``k`` such that every cut falls on a
        multiple of ``prod(shape[k:])``. A tensor with no elements has no cuts to read; it gets
        :meth:`even` over dim 0.
        """
        shape = _as_shape(shape)
        _check_ndim(shape, 1)
        numel = math.prod(shape)
        if not ranges:
            raise ValueError("from_flat_ranges needs one (start, end) per rank, got no ranges.")
        lengths, cursor = [], 0
        for r, (start, end) in enumerate(ranges):
            if not 0 <= start <= end <= numel:
                raise ValueError(
                    f"rank {r}'s flat range ({start}, {end}) is not inside [0, {numel}) of shape {shape}."
                )
            if start == end:
                lengths.append(0)
                continue
            if start != cursor:
                raise ValueError(
                    f"flat ranges must tile [0, {numel}) in rank order; rank {r} starts at {start} but the "
                    f"ranks before it end at {cursor}. Ranges: {list(ranges)}"
                )
            lengths.append(end - start)
            cursor = end
        if cursor != numel:
            raise ValueError(
                f"flat ranges end at {cursor} but shape {shape} has {numel} elements; they must tile "
                f"[0, {numel}). Ranges: {list(ranges)}"
            )
        if numel == 0:
            return cls.even(shape, len(lengths))
        for k in range(1, len(shape) + 1):
            unit = math.prod(shape[k:])
            if all(n % unit == 0 for n in lengths):
                return cls(tuple(range(k)), tuple(n // unit for n in lengths))
        raise AssertionError("unreachable: a unit of one element divides every length")

    # -- sizes --------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Number of ranks (``len(local_units)``)."""
        return len(self.local_units)

    def unit_numel(self, shape: Sequence[int]) -> int:
        """Elements per unit: ``prod(shape[len(dims):])``."""
        shape = _as_shape(shape)
        _check_ndim(shape, len(self.dims))
        return math.prod(shape[len(self.dims) :])

    def validate(self, shape: Sequence[int]) -> None:
        """Raise ``ValueError`` unless this placement fits a tensor of ``shape``."""
        shape = _as_shape(shape)
        _check_ndim(shape, len(self.dims))
        expected = math.prod(shape[: len(self.dims)])
        total = sum(self.local_units)
        if total != expected:
            raise ValueError(
                f"RaggedShard local_units {self.local_units} sum to {total}, but shape {shape} with "
                f"dims {self.dims} has {expected} units (prod(shape[:{len(self.dims)}])). "
                f"Give the ranks' units so that they sum to {expected}."
            )

    def _unit_range(self, shape: Shape, rank: int) -> tuple[int, int]:
        self.validate(shape)
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the placement's {self.world_size} ranks")
        start = sum(self.local_units[:rank])
        return start, start + self.local_units[rank]

    def flat_range(self, shape: Sequence[int], rank: int) -> FlatRange:
        """Flat element range ``[start, end)`` that ``rank`` owns (``start == end`` when it owns nothing)."""
        shape = _as_shape(shape)
        u0, u1 = self._unit_range(shape, rank)
        unit = self.unit_numel(shape)
        return u0 * unit, u1 * unit

    def flat_ranges(self, shape: Sequence[int]) -> list[FlatRange]:
        """:meth:`flat_range` of every rank, in rank order; together they tile ``[0, numel)``."""
        shape = _as_shape(shape)
        self.validate(shape)
        unit = self.unit_numel(shape)
        out, start = [], 0
        for units in self.local_units:
            out.append((start * unit, (start + units) * unit))
            start += units
        return out

    def local_numel(self, shape: Sequence[int], rank: int) -> int:
        """Number of elements ``rank`` holds."""
        start, end = self.flat_range(shape, rank)
        return end - start

    def local_shape(self, shape: Sequence[int], rank: int) -> Shape:
        """Shape of ``rank``'s piece: ``(units, *shape[1:])`` for whole rows (``dims == (0,)``), else flat."""
        shape = _as_shape(shape)
        if self.dims == (0,):
            u0, u1 = self._unit_range(shape, rank)
            return (u1 - u0, *shape[1:])
        return (self.local_numel(shape, rank),)

    def global_offset(self, shape: Sequence[int], rank: int) -> tuple[int, ...]:
        """N-D index of the first element of ``rank``'s piece (the unravelled start of its flat range).

        An empty piece at the end of the tensor gets ``(d_0, 0, ..., 0)``, one past the last row.
        """
        shape = _as_shape(shape)
        u0, _ = self._unit_range(shape, rank)
        k = len(self.dims)
        return (*_unravel(u0, shape[:k]), *(0,) * (len(shape) - k))

    def boxes(self, shape: Sequence[int], rank: int) -> list[Box]:
        """N-D boxes ``(offsets, sizes)`` that exactly cover ``rank``'s piece (see :func:`flat_range_to_boxes`)."""
        start, end = self.flat_range(shape, rank)
        return flat_range_to_boxes(shape, start, end)


class ReorderedRaggedShard(RaggedShard):
    """A :class:`RaggedShard` whose flat ranges index a storage order other than row-major (a
    :class:`~lightning_vescale.engine.tensor.ElementOrder`: block-quantized weights kept tile-major). A piece is then no
    run of rows, so the rows that cover a non-empty piece, as DTensor code asks for them, are all rows (torch's
    ``set_model_state_dict(..., broadcast_from_rank0=True)`` then copies the whole tensor into ``to_local()``, which
    takes the piece in storage order)."""

    def __str__(self) -> str:
        return f"RS*{self.local_units}"

    def _local_shard_size_and_offset(  # type: ignore[override]
        self, curr_local_size: int, num_chunks: int, rank: int
    ) -> tuple[int, int]:
        count, _ = super()._local_shard_size_and_offset(curr_local_size, num_chunks, rank)
        return (curr_local_size, 0) if count else (0, 0)


def _check_ndim(shape: Shape, num_dims: int) -> None:
    if len(shape) < max(num_dims, 1):
        raise ValueError(
            f"a RaggedShard cutting {num_dims} leading dim(s) needs a tensor with at least "
            f"{max(num_dims, 1)} dim(s), got shape {shape}. Reshape 0-d tensors to (1,)."
        )


# -- tensors and collectives ------------------------------------------------------------------------
def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the collectives see it: float8 as ``uint8`` bytes, everything else unchanged."""
    if t.dtype.is_floating_point and t.dtype.itemsize == 1:
        return t.view(torch.uint8)
    return t


def _group_rank(group: Optional[dist.ProcessGroup], world_size: int, what: str) -> int:
    group_size = dist.get_world_size(group)
    if group_size != world_size:
        raise ValueError(
            f"{what} has {world_size} ranks but the process group has {group_size}; give one entry "
            f"per rank of the group (ranks that hold nothing get 0 units or an empty range)."
        )
    return dist.get_rank(group)


def shard_tensor(full: torch.Tensor, placement: RaggedShard, rank: int) -> torch.Tensor:
    """``rank``'s piece of ``full`` under ``placement``: a view of its flat storage, shaped ``local_shape``."""
    shape = _as_shape(full.shape)
    placement.validate(shape)
    if not full.is_contiguous():
        raise ValueError(
            f"shard_tensor returns a view of the flat storage, so it needs a contiguous tensor; got shape "
            f"{shape} with strides {tuple(full.stride())}. Call .contiguous() first."
        )
    start, end = placement.flat_range(shape, rank)
    return full.view(-1)[start:end].view(placement.local_shape(shape, rank))


def gather_full(
    local: torch.Tensor,
    shape: Sequence[int],
    placement: RaggedShard,
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """All-gather every rank's piece into the full tensor of ``shape`` on every rank.

    Pieces are padded to the largest one and moved with one ``all_gather_into_tensor`` (gloo rejects
    uneven ``all_gather`` lists), then the padding is stripped.
    """
    shape = _as_shape(shape)
    placement.validate(shape)
    rank = _group_rank(group, placement.world_size, f"placement {placement}")
    sizes = [end - start for start, end in placement.flat_ranges(shape)]
    if local.numel() != sizes[rank]:
        raise ValueError(
            f"rank {rank}'s local tensor has {local.numel()} elements but placement {placement} gives it "
            f"{sizes[rank]} of shape {shape}."
        )
    padded = max(sizes)
    if padded == 0:
        return torch.empty(shape, dtype=local.dtype, device=local.device)
    flat = local.reshape(-1)
    if sizes[rank] < padded:
        send = local.new_empty(padded)
        _wire(send)[: sizes[rank]].copy_(_wire(flat))
    else:
        send = flat
    recv = local.new_empty(placement.world_size * padded)
    dist.all_gather_into_tensor(_wire(recv), _wire(send), group=group)
    if all(n == padded for n in sizes):
        return recv.view(shape)
    full = torch.empty(shape, dtype=local.dtype, device=local.device)
    wire = _wire(recv)
    torch.cat([wire[r * padded : r * padded + n] for r, n in enumerate(sizes)], out=_wire(full.view(-1)))
    return full


def redistribute(
    local: torch.Tensor,
    shape: Sequence[int],
    src: RaggedShard,
    dst: RaggedShard,
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Move this rank's piece of a tensor of ``shape`` from placement ``src`` to placement ``dst``.

    One ``all_to_all_single`` moves exactly the elements whose owner changes (see
    :func:`redistribute_flat`); the result is shaped ``dst.local_shape(shape, rank)``.
    """
    shape = _as_shape(shape)
    src.validate(shape)
    dst.validate(shape)
    if src.world_size != dst.world_size:
        raise ValueError(
            f"src has {src.world_size} ranks and dst has {dst.world_size}; both placements need one "
            f"entry per rank of the group (give ranks that hold nothing 0 units)."
        )
    rank = _group_rank(group, src.world_size, f"placement {src}")
    out = redistribute_flat(local.reshape(-1), src.flat_ranges(shape), dst.flat_ranges(shape), group)
    return out.view(dst.local_shape(shape, rank))


def redistribute_flat(
    local_flat: torch.Tensor,
    src_ranges: Sequence[tuple[int, int]],
    dst_ranges: Sequence[tuple[int, int]],
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Move flat pieces of one index space from per-rank ``src_ranges`` to per-rank ``dst_ranges``.

    Rank ``r`` holds elements ``src_ranges[r]`` (as ``local_flat``) and returns a new 1-D tensor with
    elements ``dst_ranges[r]``. Rank ``i`` sends rank ``j`` the intersection of ``src_ranges[i]`` and
    ``dst_ranges[j]``, in one ``all_to_all_single`` with split sizes every rank computes alike.

    Args:
        local_flat: this rank's elements of ``src_ranges[rank]``, in order.
        src_ranges: one ``(start, end)`` per rank of ``group``; non-empty ones must be disjoint.
            Empty ones may be any ``(s, s)``, e.g. ``(0, 0)`` from ``BufferPlan.piece``.
        dst_ranges: one ``(start, end)`` per rank of ``group``, each covered by the source ranges.
            They may overlap (overlapping elements are sent to each rank that wants them).
        group: the process group (default: the world).

    .. note::
        For an N -> M reshard of a ``BufferPlan`` layout, run on a group of ``max(N, M)`` ranks and
        pad the shorter range list with ``(0, 0)``; call once per tensor with ``plan.pieces(i)``.
    """
    world_size = dist.get_world_size(group)
    src = _normalize_ranges(src_ranges, world_size, "src_ranges")
    dst = _normalize_ranges(dst_ranges, world_size, "dst_ranges")
    _check_cover(src, dst)
    rank = dist.get_rank(group)
    s0, s1 = src[rank]
    d0, d1 = dst[rank]
    if local_flat.numel() != s1 - s0:
        raise ValueError(
            f"rank {rank}'s local_flat has {local_flat.numel()} elements but src_ranges[{rank}] = "
            f"({s0}, {s1}) has {s1 - s0}."
        )
    flat = local_flat.reshape(-1)
    out = local_flat.new_empty(d1 - d0)
    if src == dst:
        _wire(out).copy_(_wire(flat))
        return out

    send = [_intersect(src[rank], dst[j]) for j in range(world_size)]
    recv = [_intersect(src[i], dst[rank]) for i in range(world_size)]
    in_splits = [hi - lo for lo, hi in send]
    out_splits = [hi - lo for lo, hi in recv]

    wire_flat = _wire(flat)
    sent = [(lo - s0, hi - s0) for lo, hi in send if hi > lo]
    if _tiles(sent, s1 - s0):
        send_buf = wire_flat
    else:  # some elements go nowhere, or destinations are not in source order
        send_buf = torch.cat([wire_flat[lo:hi] for lo, hi in sent]) if sent else wire_flat[:0]

    got = [(lo - d0, hi - d0) for lo, hi in recv if hi > lo]
    direct = _tiles(got, d1 - d0)
    recv_buf = _wire(out) if direct else _wire(local_flat.new_empty(d1 - d0))
    dist.all_to_all_single(
        recv_buf, send_buf, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group
    )
    if not direct:  # sources are not in destination order: place each received run
        wire_out, pos = _wire(out), 0
        for lo, hi in got:
            wire_out[lo:hi].copy_(recv_buf[pos : pos + hi - lo])
            pos += hi - lo
    return out


def _normalize_ranges(ranges: Sequence[tuple[int, int]], world_size: int, what: str) -> list[FlatRange]:
    if len(ranges) != world_size:
        raise ValueError(
            f"{what} has {len(ranges)} entries but the process group has {world_size} ranks; give one "
            f"(start, end) per rank, (0, 0) for ranks that hold nothing."
        )
    out = []
    for r, (start, end) in enumerate(ranges):
        start, end = operator.index(start), operator.index(end)
        if not 0 <= start <= end:
            raise ValueError(f"{what}[{r}] = ({start}, {end}) is not a range: expected 0 <= start <= end.")
        out.append((start, end) if end > start else (0, 0))
    return out


def _check_cover(src: list[FlatRange], dst: list[FlatRange]) -> None:
    """Source ranges must be disjoint and cover every destination range (checked alike on every rank)."""
    spans = sorted((lo, hi, r) for r, (lo, hi) in enumerate(src) if hi > lo)
    merged: list[list[int]] = []
    for (lo, hi, r), prev in zip(spans, [None, *spans[:-1]]):
        if prev is not None and lo < prev[1]:
            raise ValueError(
                f"src_ranges overlap: rank {prev[2]} holds ({prev[0]}, {prev[1]}) and rank {r} holds "
                f"({lo}, {hi}); every element must have one source."
            )
        if merged and merged[-1][1] == lo:
            merged[-1][1] = hi
        else:
            merged.append([lo, hi])
    starts = [lo for lo, _ in merged]
    for r, (lo, hi) in enumerate(dst):
        if hi == lo:
            continue
        i = bisect.bisect_right(starts, lo) - 1
        if i < 0 or merged[i][1] < hi:
            raise ValueError(
                f"dst_ranges[{r}] = ({lo}, {hi}) is not covered by the source ranges (covered: "
                f"{[tuple(m) for m in merged]}); every destination element needs a source."
            )


def _intersect(a: FlatRange, b: FlatRange) -> FlatRange:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if hi > lo else (0, 0)


def _tiles(runs: list[FlatRange], length: int) -> bool:
    """Whether ``runs`` are ``[0, length)`` cut in order."""
    pos = 0
    for lo, hi in runs:
        if lo != pos:
            return False
        pos = hi
    return pos == length

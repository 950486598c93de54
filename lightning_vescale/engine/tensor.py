"""RaggedTensor: a sharded parameter that looks like the full parameter.

[Note: what a RaggedTensor is]
``fully_shard`` leaves each rank a contiguous flat range of every parameter (a view into the group's
DBuffer). A :class:`RaggedTensor` wraps that piece (``to_local()``, zero-copy) and reports the *global*
``shape``, ``ndim``, ``numel()``, ``dtype``, ``device`` and ``requires_grad``, like FSDP2's DTensor
parameters, so user code that reads shapes (weight decay on ``p.dim() >= 2``, parameter counts,
``p.shape``-based init or freezing rules) sees the model it wrote. Its :class:`RaggedLayout` says which
flat range of the global tensor every rank of its group holds.

Operations run on the pieces, chosen so that the result equals the same operation on the full tensor:

* elementwise ops (everything aten tags ``pointwise``, the ``_foreach_*`` and ``_fused_*`` optimizer
  kernels, ``copy_``/``zero_``/``fill_``/``clone``/``*_like``/dtype casts) between RaggedTensors of one
  layout and Python or 0-d scalars run on the local pieces; the result has the same layout. This is
  every elementwise ``torch.optim`` optimizer, with ``foreach`` and ``fused`` on or off;
* full reductions (``sum``, ``mean``, ``norm`` / ``linalg.vector_norm`` / ``_foreach_norm``, ``max``,
  ``min``, ``amax``, ``amin``, ``any``, ``all``, ``equal``) reduce the local piece and all-reduce once over
  the layout's group: the global value, as a plain tensor, on every rank;
* in-place random fills (``uniform_``, ``normal_``, ``bernoulli_`` ...) draw the full tensor from the
  generator and keep this rank's piece, so ``nn.init`` on a sharded parameter gives exactly the values of
  the unsharded model with the same seed (every rank must call it, as for any collective).

Anything else (matmuls, indexing, reshapes, reductions over a dim, ``item()``) raises
:class:`UnsupportedRaggedOp`, naming the op, instead of computing a silently local result: call
``full_tensor()`` for the whole value, or ``to_local()`` for this rank's piece. Mixing a RaggedTensor with
a plain tensor that is not a scalar, or two RaggedTensors of different layouts, raises too; the one exception
is ``copy_`` into a RaggedTensor from a tensor of its global shape laid out otherwise (a full tensor, another
DTensor, another layout), which takes this rank's piece of it (``load_state_dict`` copies so).

[Note: RaggedTensor as a DTensor]
A RaggedTensor *is* a :class:`torch.distributed.tensor.DTensor` (veScale's design): ``isinstance(p, DTensor)``,
``p.device_mesh`` (the ``fully_shard`` mesh; a 2-D (replicate, shard) mesh for HSDP), ``p.placements``
(:class:`~lightning_vescale.engine.placement.RaggedShard` on the shard dim, ``Replicate()`` on the others),
``full_tensor()``, ``to_local()`` and ``redistribute(...)``, so DTensor-aware code works unchanged:
``torch.distributed.checkpoint.state_dict``'s helpers (full and sharded, ``broadcast_from_rank0``), ``dcp.save`` /
``dcp.load``, ``clip_grad_norm_``, the FSDP2 tutorial's ``full_tensor()`` export and ``distribute_tensor`` +
``load_state_dict(assign=True)`` reload. It keeps its own ``__torch_dispatch__`` (the rules above), never
DTensor's sharding propagation: a RaggedShard piece is a flat range, not a ``torch.chunk`` slice, so DTensor's
even-``Shard`` arithmetic would be wrong for it, and :class:`RaggedShard` refuses it. Where DTensor code only
asks which rows a shard holds (``compute_local_shape_and_global_offset``), RaggedShard answers with the rows
covering the piece, and a piece cut inside rows comes from ``to_local()`` as a :class:`RaggedPiece`, whose
``copy_`` takes its elements from those rows. Measured (``benchmarks/results/optim_dtensor.md``, 2 ranks, load
average ~5): the AdamW step on RaggedTensors over the same step on plain pieces, median of 4 paired ratios, was
1.078 (single-tensor) / 1.045 (foreach) before they were DTensors and 1.085 / 1.060 after, within the run-to-run
spread (1.05-1.17).

Reductions and ``full_tensor()`` are collectives over ``layout.group``: every rank of it must call them.

Elementwise methods called under no_grad (what a single-tensor optimizer step does, ~8 per parameter) take a
direct path in ``__torch_function__`` that runs them on the pieces before the dispatcher, whose round trip
through ``__torch_dispatch__`` costs about as much as the op on a piece; the results, errors and version
counters are those of the dispatch path.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence, SupportsIndex, TypeGuard, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils._pytree import tree_map

from lightning_vescale.engine import collectives
from lightning_vescale.engine.placement import RaggedShard, ReorderedRaggedShard, flat_range_to_boxes

__all__ = [
    "ElementOrder", "GlobalExtent", "OuterShard", "RaggedLayout", "RaggedTensor", "UnsupportedRaggedOp", "block_layout", "is_ragged", "is_sharded_param",
    "RaggedPiece", "local_tensor", "piece_of",
    "local_piece_shape",
]

aten = torch.ops.aten
FlatRange = tuple[int, int]


def local_piece_shape(shape: Sequence[int], start: int, end: int) -> tuple[int, ...]:
    """Shape of the piece ``[start, end)`` of a tensor of ``shape``: whole rows keep their row shape, else 1-D."""
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    if len(shape) >= 1 and row > 0 and start % row == 0 and end % row == 0:
        return ((end - start) // row, *shape[1:])
    return (end - start,)


@dataclass(frozen=True, eq=False)
class OuterShard:
    """The tensor a layout shards over its group is this rank's piece of a larger DTensor on another mesh (tensor
    parallelism: ``fully_shard`` over ``mesh["dp"]`` of a weight ``ColwiseParallel`` made ``Shard(0)`` on
    ``mesh["tp"]``). The sharded tensor then reports the larger tensor's shape; reductions, ``full_tensor()``,
    checkpoint chunks and full-tensor copies go over both meshes."""

    mesh: DeviceMesh
    """The other (1-D) mesh, e.g. ``mesh["tp"]``."""
    placement: Placement
    """How the larger tensor lies on it: ``Shard(dim)`` or ``Replicate()``."""
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    """Where this rank's piece starts in the larger tensor (nonzero only along a ``Shard`` dim)."""

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()

    @property
    def is_sharded(self) -> bool:
        """Whether the ranks of ``mesh`` hold different parts (``Shard``), not copies (``Replicate``)."""
        return self.placement.is_shard()

    def local_slice(self, full: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """This rank's piece (of ``shape``) of ``full``, a tensor of ``global_shape``."""
        index = tuple(slice(o, o + n) for o, n in zip(self.offset, shape))
        return full[index]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OuterShard) and (self.mesh, self.placement, self.global_shape, self.offset) == (
            other.mesh, other.placement, other.global_shape, other.offset)

    def __hash__(self) -> int:
        return hash((self.placement, self.global_shape, self.offset))


@runtime_checkable
class ElementOrder(Protocol):
    """A storage order of a tensor's elements other than row-major, which a :class:`RaggedLayout`'s flat ranges
    index (an extension supplies it: block-quantized weights kept tile-major, so a cut may fall between any two
    ``b x b`` tiles). Everything that reads or writes the logical tensor goes through it, so ``full_tensor()``,
    state dicts and checkpoints see the row-major tensor. Must be hashable and compare by value."""

    def take(self, full: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` in storage order of the row-major tensor ``full`` (flat)."""

    def to_rowmajor(self, flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The row-major tensor of ``shape`` from its whole flat storage."""

    def boxes(self, shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """N-D ``(offsets, sizes)`` boxes of the storage range ``[start, end)``, each contiguous in storage, in
        storage order."""


@dataclass(frozen=True, eq=False)
class RaggedLayout:
    """Where the pieces of a sharded tensor live.

    ``ranges[q]`` is the flat (row-major) element range of the global tensor that rank ``q`` of ``group``
    holds. The ranges are disjoint and cover ``[0, numel)``; each element lives on exactly one rank of
    ``group`` (so a reduction over ``group`` counts it once). For a plain ``fully_shard`` group the ranges
    are consecutive in rank order; for expert-parallel stacks the owners are ordered by (dp, ep) while the
    experts are ordered by ep, so :attr:`owners` lists which rank holds each piece in flat order.
    """

    shape: tuple[int, ...]
    """The shape of the tensor the ranges cut: the global shape, or with ``outer`` this rank's piece of it."""
    ranges: tuple[FlatRange, ...]
    """Flat range of every rank of ``group``, in group rank order (empty ranges as ``(s, s)``)."""
    group: Optional[dist.ProcessGroup]
    """The ranks whose pieces partition the tensor; None for one process."""
    rank: int
    """This rank's index in ``group``."""
    mesh: Optional[DeviceMesh] = None
    """The mesh the tensor reports as a DTensor (``device_mesh``), whose dim ``mesh_dim`` holds the ranks of
    ``group``: a 2-D (replicate, shard) mesh for HSDP. None: a 1-D mesh of ``group`` (none for one process)."""
    mesh_dim: int = 0
    """The dim of ``mesh`` the pieces are spread over; every other dim holds replicas (``Replicate()``), or with
    ``outer`` the other mesh's placement."""
    outer: Optional[OuterShard] = None
    """Tensor parallelism: ``shape`` is this rank's piece of a larger DTensor laid out on another mesh."""
    order: Optional[ElementOrder] = None
    """The order of the flat storage the ranges index, when not row-major (a block-quantized weight kept
    tile-major, see :class:`ElementOrder`); None: row-major."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_specs", {})
        numel = math.prod(self.shape)
        covered = sorted(r for r in self.ranges if r[1] > r[0])
        cursor = 0
        for start, end in covered:
            if start != cursor:
                raise ValueError(f"the pieces of a {self.shape} tensor must tile [0, {numel}); got {self.ranges}")
            cursor = end
        if cursor != numel:
            raise ValueError(f"the pieces of a {self.shape} tensor must tile [0, {numel}); got {self.ranges}")

    @property
    def global_shape(self) -> tuple[int, ...]:
        """The shape the tensor reports (its ``DTensor`` shape)."""
        return self.outer.global_shape if self.outer is not None else self.shape

    @property
    def reduce_groups(self) -> list[dist.ProcessGroup]:
        """The groups a full reduction all-reduces over: ``group``, and the other mesh's when it holds different parts."""
        groups = [self.group] if self.group is not None and self.world_size > 1 else []
        if self.outer is not None and self.outer.is_sharded and self.outer.mesh.size() > 1:
            groups.append(self.outer.group)
        return groups

    def global_boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """:meth:`boxes` in the coordinates of the global tensor."""
        if self.outer is None:
            return self.boxes()
        shift = self.outer.offset
        return [(tuple(o + s for o, s in zip(offsets, shift)), sizes) for offsets, sizes in self.boxes()]

    def take_piece(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's flat piece of ``full``, a tensor of :attr:`global_shape` (a view where possible)."""
        if self.outer is not None:
            full = self.outer.local_slice(full, self.shape)
        start, end = self.local_range
        if self.order is not None:
            return self.order.take(full.reshape(self.shape), start, end)
        return full.reshape(-1)[start:end]

    @property
    def local_range(self) -> FlatRange:
        """The flat range of the global tensor this rank holds."""
        return self.ranges[self.rank]

    @property
    def local_shape(self) -> tuple[int, ...]:
        start, end = self.local_range
        if self.order is not None and end > start:
            return (end - start,)
        return local_piece_shape(self.shape, start, end)

    @property
    def world_size(self) -> int:
        return len(self.ranges)

    @property
    def owners(self) -> tuple[int, ...]:
        """Group ranks holding a non-empty piece, in the flat order of their pieces."""
        return tuple(sorted((q for q, (s, e) in enumerate(self.ranges) if e > s), key=lambda q: self.ranges[q][0]))

    @property
    def placement(self) -> RaggedShard:
        """The pieces as a :class:`RaggedShard` over ``owners`` (= the group's ranks in order, for ``fully_shard``)."""
        owners = self.owners
        ranges = self.ranges if list(owners) == sorted(owners) else [self.ranges[q] for q in owners]
        placement = RaggedShard.from_flat_ranges(self.shape, ranges)
        if self.order is not None:  # the ranges index another storage order: no run of rows covers a piece
            return ReorderedRaggedShard(placement.dims, placement.local_units)
        return placement

    def boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """N-D ``(offsets, sizes)`` boxes covering this rank's piece, in flat (storage) order."""
        if self.order is not None:
            return self.order.boxes(self.shape, *self.local_range)
        return flat_range_to_boxes(self.shape, *self.local_range)

    def device_mesh(self, device_type: str) -> Optional[DeviceMesh]:
        """:attr:`mesh`, or a 1-D mesh of ``group`` on ``device_type`` (made once per group); None for one process."""
        if self.mesh is not None:
            return self.mesh
        if self.group is None:
            return None
        key = (id(self.group), device_type)
        mesh = _GROUP_MESHES.get(key)
        if mesh is None:
            mesh = _GROUP_MESHES[key] = DeviceMesh.from_group(self.group, device_type)
        return mesh

    def placements(self, mesh: Optional[DeviceMesh]) -> tuple[Placement, ...]:
        """The DTensor placements on ``mesh``: :attr:`placement` on ``mesh_dim``, ``Replicate()`` elsewhere (the
        other mesh's placement on the other dim with ``outer``)."""
        ndim = 1 if mesh is None else mesh.ndim
        out: list[Placement] = [Replicate()] * ndim
        if self.outer is not None and mesh is not None:
            # The tp dim of the reported mesh, by name (HSDP x tp: (replicate, shard, tp); dp x tp: (dp, tp)).
            outer_names = self.outer.mesh.mesh_dim_names or ()
            names = mesh.mesh_dim_names or ()
            outer_dim = names.index(outer_names[0]) if outer_names and outer_names[0] in names else ndim - 1
            out[outer_dim] = self.outer.placement
        out[self.mesh_dim] = self.placement
        return tuple(out)

    def spec(self, dtype: torch.dtype, device: torch.device) -> DTensorSpec:
        """The DTensor spec of a tensor of this layout (one per dtype and device type, made once)."""
        key = (dtype, device.type)
        spec = self._specs.get(key)  # type: ignore[attr-defined]
        if spec is None:
            mesh = self.device_mesh(device.type)
            meta = TensorMeta(torch.Size(self.global_shape), _contiguous_strides(self.global_shape), dtype)
            # A RaggedShard is a Shard of dim 0 but not equal to Shard(0): leave the spec's shard order to be derived when
            # asked for, as for _StridedShard, instead of checking it against Shard(0) here.
            # One process: no mesh (None; the spec then only carries the shape and placements).
            spec = self._specs[key] = DTensorSpec(  # type: ignore[attr-defined]
                mesh,  # type: ignore[arg-type]
                self.placements(mesh), tensor_meta=meta, use_strided_shard_as_shard_order=True)
        return spec

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, RaggedLayout):
            return NotImplemented
        return (self.shape, self.ranges, self.rank, self.outer, self.order) == (
            other.shape, other.ranges, other.rank, other.outer, other.order) and self.group is other.group

    def __hash__(self) -> int:
        return hash((self.shape, self.ranges, self.rank, id(self.group), self.outer, self.order))

    def __repr__(self) -> str:
        return f"RaggedLayout(shape={self.shape}, local_range={self.local_range}, rank={self.rank}/{self.world_size})"


_GROUP_MESHES: dict[tuple[int, str], DeviceMesh] = {}
"""1-D meshes of the process groups layouts are spread over, by (id(group), device type); a mesh keeps its group
alive, so an id is never reused while its entry exists."""


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class GlobalExtent:
    """A declaration on a plain tensor: it is block ``[offset, offset + numel)`` of a larger tensor of ``shape``,
    the blocks held by the ranks of ``group`` in rank order (expert parallelism: each rank's experts).

    Set as ``param._vescale_global_extent``. ``fully_shard(..., norm_group=...)`` then lays the sharded parameter
    out as the larger tensor, and checkpoints store the larger tensor.
    """

    shape: tuple[int, ...]
    offset: int
    group: Optional[dist.ProcessGroup]


def block_layout(t: torch.Tensor, extent: GlobalExtent) -> RaggedLayout:
    """The layout of a plain tensor ``t`` that is one of equal blocks ``extent`` describes (rank q, block q)."""
    n = t.numel()
    q = dist.get_rank(extent.group) if extent.group is not None else 0
    size = dist.get_world_size(extent.group) if extent.group is not None else 1
    if extent.offset != q * n:
        raise ValueError(f"block {q} of {size} of a {extent.shape} tensor starts at {extent.offset}, not at {q * n}: "
                         f"the blocks must be equal and in rank order")
    return RaggedLayout(tuple(extent.shape), tuple((r * n, (r + 1) * n) for r in range(size)), extent.group, q)


class UnsupportedRaggedOp(RuntimeError):
    """An operation that a RaggedTensor cannot run on its piece without changing the result."""


def is_ragged(t: Any) -> TypeGuard[RaggedTensor]:
    """Whether ``t`` is a sharded :class:`RaggedTensor` (a parameter, its gradient or a state shaped like it)."""
    return isinstance(t, RaggedTensor)


def is_sharded_param(t: Any) -> bool:
    """Whether ``t`` is a parameter ``fully_shard`` sharded: a :class:`RaggedTensor`, or a tensor subclass built on
    them that says so (``is_sharded_tensor``, e.g. a block-quantized weight whose codes and scales are sharded)."""
    return isinstance(t, RaggedTensor) or bool(getattr(t, "is_sharded_tensor", False))


class RaggedTensor(DTensor):
    """A tensor of global shape ``layout.global_shape`` of which this rank holds the piece ``to_local()``.

    Made by ``fully_shard`` for every sharded parameter (and its ``.grad``), and by elementwise ops on
    those (optimizer states). See the module note for what runs on it. It is a
    :class:`~torch.distributed.tensor.DTensor` whose placement is :class:`RaggedShard` (see the module note on
    what DTensor-aware code gets from it).
    """

    _layout: RaggedLayout
    __slots__ = ("_layout",)

    @staticmethod
    def __new__(cls, local: torch.Tensor, layout: RaggedLayout, *, requires_grad: bool = False) -> RaggedTensor:
        if local.numel() != layout.local_range[1] - layout.local_range[0]:
            raise ValueError(
                f"the local piece has {local.numel()} elements but the layout gives this rank "
                f"{layout.local_range[1] - layout.local_range[0]} ({layout})"
            )
        r = _dtensor_new(cls, local, layout.spec(local.dtype, local.device), requires_grad=requires_grad)
        r._layout = layout
        return r

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # everything happens in __new__ (DTensor.__init__ is for DTensor's own constructor)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # The single-tensor optimizer step calls ~8 elementwise methods per parameter under no_grad: run them on
        # the pieces here, before the dispatcher, which costs as much again as the op on a piece. Anything else,
        # and these under grad mode (autograd must record them), goes the usual way to __torch_dispatch__.
        if func in _DIRECT_ELEMENTWISE and not torch.is_grad_enabled():
            out = _elementwise_direct(func, args, kwargs)
            if out is not NotImplemented:
                return out
        return _disabled_torch_function_impl(func, types, args, kwargs or _NO_KWARGS)

    # -- the public face -----------------------------------------------------------------------------------
    @property
    def layout_info(self) -> RaggedLayout:
        """Where every rank's piece lives (named so as not to shadow ``torch.Tensor.layout``)."""
        return self._layout

    @property
    def placement(self) -> RaggedShard:
        """The :class:`RaggedShard` placement of the pieces (see :attr:`RaggedLayout.placement`)."""
        return self._layout.placement

    @property
    def local_range(self) -> FlatRange:
        """The flat element range ``[start, end)`` of the global tensor held here."""
        return self._layout.local_range

    def to_local(self, *, grad_placements: Optional[Sequence[Placement]] = None) -> torch.Tensor:
        """This rank's piece: a zero-copy view of the sharded storage (for a parameter: its DBuffer).

        Unlike ``DTensor.to_local`` it is not differentiable: a sharded parameter is stepped by the optimizer, and
        forward uses the gathered parameter, never this piece. ``grad_placements`` is accepted for DTensor's
        signature and has no effect. A piece cut inside rows comes as a :class:`RaggedPiece`.
        """
        local = self._local_tensor
        if len(self._layout.shape) > 1 and len(local.shape) == 1 and local.numel():
            return RaggedPiece.of(local, self._layout)
        return local

    def full_tensor(self, *, grad_placements: Optional[Sequence[Placement]] = None) -> torch.Tensor:
        """The whole tensor on every rank of the layout's group (an all-gather; every rank must call it).

        Not differentiable (see :meth:`to_local`); ``grad_placements`` has no effect."""
        return gather_full(self._local_tensor, self._layout)

    def redistribute(
        self,
        device_mesh: Optional[DeviceMesh] = None,
        placements: Optional[Sequence[Placement]] = None,
        *,
        async_op: bool = False,
        forward_dtype: Optional[torch.dtype] = None,
        backward_dtype: Optional[torch.dtype] = None,
    ) -> DTensor:
        """This tensor under other placements on its mesh, as DTensor's ``redistribute`` (a collective).

        ``Replicate()`` on every mesh dim gives a plain DTensor holding the full tensor (what
        ``torch.distributed.checkpoint.state_dict`` does for ``full_state_dict``); other torch placements
        (``Shard(d)``) a plain DTensor sharded so; a :class:`RaggedShard` on the shard dim a RaggedTensor of that
        placement. Not differentiable (see :meth:`to_local`); ``async_op`` is accepted and runs synchronously.
        """
        mesh = self.device_mesh
        if device_mesh is not None and device_mesh != mesh:
            raise ValueError(
                f"redistribute: this tensor lives on {mesh}; moving it to another mesh ({device_mesh}) is not "
                f"supported. Gather it with full_tensor() and distribute that."
            )
        current = self.placements
        placements = current if placements is None else tuple(placements)
        if len(placements) != len(current):
            raise ValueError(f"redistribute: {len(placements)} placements for a {len(current)}-D mesh")
        if placements == current:
            return self
        full = self.full_tensor()
        if forward_dtype is not None:
            full = full.to(forward_dtype)
        ragged = [p for p in placements if isinstance(p, RaggedShard)]
        if ragged:
            if len(ragged) != 1 or not isinstance(placements[self._layout.mesh_dim], RaggedShard) or any(
                not isinstance(p, Replicate) for d, p in enumerate(placements) if d != self._layout.mesh_dim):
                raise ValueError(f"redistribute: a RaggedShard goes on mesh dim {self._layout.mesh_dim} with "
                                 f"Replicate() elsewhere, got {placements}")
            layout = dataclasses.replace(self._layout, ranges=tuple(ragged[0].flat_ranges(self._layout.shape)))
            return RaggedTensor.from_full(full, layout)
        if mesh is None:
            raise ValueError("redistribute: a tensor of one process has no mesh; use full_tensor()")
        return distribute_tensor(full, mesh, placements, src_data_rank=None)

    @classmethod
    def from_full(cls, full: torch.Tensor, layout: RaggedLayout) -> RaggedTensor:
        """A RaggedTensor holding this rank's piece (a copy) of ``full``, a tensor of ``layout.global_shape``."""
        if tuple(full.shape) != layout.global_shape:
            raise ValueError(f"from_full: the tensor has shape {tuple(full.shape)}, the layout {layout.global_shape}")
        return cls(layout.take_piece(full.detach()).clone().view(layout.local_shape), layout)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"RaggedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
            f"local_range={self.local_range}, rank={self._layout.rank}/{self._layout.world_size}, "
            f"local={self._local_tensor!r})"
        )

    def __deepcopy__(self, memo: dict) -> RaggedTensor:
        if id(self) in memo:
            return memo[id(self)]
        out = RaggedTensor(self._local_tensor.detach().clone(), self._layout, requires_grad=self.requires_grad)
        memo[id(self)] = out
        for key, value in self.__dict__.items():  # _is_param, user declarations
            setattr(out, key, copy.deepcopy(value, memo))
        return out

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        raise TypeError(
            "a RaggedTensor holds one rank's piece and is not pickled; save sharded state with "
            "lightning_vescale.checkpoint (or torch.distributed.checkpoint), or pickle .full_tensor() / .to_local()"
        )

    # -- torch.distributed.checkpoint extension points (as DTensor implements them) -------------------------
    def __create_write_items__(self, fqn: str, object: Any) -> list:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import (
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )

        props = TensorProperties.create_from_tensor(self._local_tensor)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                    properties=props,
                    size=torch.Size(self._layout.global_shape),
                ),
            )
            for offsets, sizes in self._chunks()
        ]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in self._chunks()]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        flat = self._local_tensor.detach().reshape(-1)
        pos = 0
        for offsets, sizes in self._chunks():
            n = math.prod(sizes)
            if tuple(offsets) == tuple(index.offset):
                return flat[pos : pos + n].view(sizes)
            pos += n
        raise ValueError(f"{index.fqn}: no piece at offsets {tuple(index.offset)} on this rank ({self._layout})")

    def _chunks(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        shape = self._layout.global_shape
        if math.prod(shape) == 0:
            # Nothing to write, but the checkpoint must still know the tensor: one rank lists an empty chunk.
            return [((0,) * len(shape), shape)] if self._layout.rank == 0 else []
        return self._layout.global_boxes()

    # -- dispatch -----------------------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        handler = _HANDLERS.get(func)
        if handler is None:
            handler = _HANDLERS[func] = _handler_for(func)
        return handler(func, args, kwargs or _NO_KWARGS)


_dtensor_new = torch.Tensor._dtensor__new__


def _wrap(local: torch.Tensor, layout: RaggedLayout) -> RaggedTensor:
    """``RaggedTensor(local, layout)`` without the size check (the caller got ``local`` from a same-layout op)."""
    r = _dtensor_new(RaggedTensor, local, layout.spec(local.dtype, local.device), requires_grad=False)
    r._layout = layout
    return r


# --------------------------------------------------------------------------------------------------------
# Gathering


def check_resident(local: torch.Tensor) -> None:
    """A piece whose storage the memory manager released (offloaded) cannot be read: say so instead of reading
    freed memory."""
    if local.numel() and local.untyped_storage().nbytes() == 0:
        raise RuntimeError(
            "this tensor's storage is offloaded (released by the memory manager between steps); bring it in "
            "first, e.g. `with lightning_vescale.memory.resident_states(optimizer): ...`"
        )


def gather_pieces(local: torch.Tensor, layout: RaggedLayout) -> torch.Tensor:
    """All-gather every rank's piece of ``layout`` into the full tensor (pieces padded to the largest)."""
    check_resident(local)
    shape = layout.shape
    sizes = [e - s for s, e in layout.ranges]
    if layout.group is None or layout.world_size == 1:
        if layout.order is not None:
            return layout.order.to_rowmajor(local.detach().reshape(-1), shape)
        return local.detach().reshape(shape).clone()
    padded = max(sizes)
    full = torch.empty(shape, dtype=local.dtype, device=local.device)
    if padded == 0:
        return full
    wire = _wire_view
    send = local.new_zeros(padded)
    wire(send)[: local.numel()].copy_(wire(local.detach().reshape(-1)))
    recv = local.new_empty(layout.world_size * padded)
    collectives.all_gather_into_tensor(wire(recv), wire(send), layout.group, kind="all_gather_full_tensor")
    out, flat_recv = wire(full.view(-1)), wire(recv)
    for q, (s, e) in enumerate(layout.ranges):
        out[s:e].copy_(flat_recv[q * padded : q * padded + (e - s)])
    if layout.order is not None:
        return layout.order.to_rowmajor(full.view(-1), shape)
    return full


def gather_full(local: torch.Tensor, layout: RaggedLayout) -> torch.Tensor:
    """The whole tensor of ``layout.global_shape``: :func:`gather_pieces`, then over the other mesh with ``outer``."""
    full = gather_pieces(local, layout)
    outer = layout.outer
    if outer is None or not outer.is_sharded or outer.mesh.size() == 1:
        return full
    return DTensor.from_local(full, outer.mesh, [outer.placement], run_check=False, shape=torch.Size(outer.global_shape),
                              stride=_contiguous_strides(outer.global_shape)).full_tensor()


def _wire_view(t: torch.Tensor) -> torch.Tensor:
    """float8 travels as bytes (gloo rejects float8 dtypes)."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.dtype.itemsize == 1 else t


# --------------------------------------------------------------------------------------------------------
# Handlers


def _op_name(func: Any) -> str:
    return str(func).replace("aten::", "aten.")


def _unsupported(func: Any, args: tuple, kwargs: dict) -> Any:
    shapes = [tuple(a.shape) for a in _flat_tensors((args, kwargs)) if isinstance(a, RaggedTensor)]
    raise UnsupportedRaggedOp(
        f"{_op_name(func)} is not supported on a sharded RaggedTensor (global shape "
        f"{shapes[0] if shapes else '?'}; this rank holds only its piece, so a local result would be wrong). "
        f"Call .full_tensor() to gather the whole tensor (every rank must call it), or .to_local() to work on "
        f"this rank's piece."
    )


def _flat_tensors(tree: Any) -> list:
    out: list = []

    def visit(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            out.append(x)
        return x

    tree_map(visit, tree)
    return out


class _Unwrapper:
    """Replaces RaggedTensors by their pieces, checking that they share one layout (per list position for
    ``_foreach_*`` ops) and that every plain tensor mixed in is a scalar."""

    def __init__(self, func: Any, foreach: bool) -> None:
        self.func = func
        self.foreach = foreach
        self.layouts: dict[int, RaggedLayout] = {}  # position (0 for non-foreach ops) -> layout
        self.wrappers: dict[int, RaggedTensor] = {}  # id(local) -> the RaggedTensor it came from

    def one(self, x: Any, position: int, in_list: bool) -> Any:
        if type(x) is RaggedTensor or isinstance(x, RaggedTensor):
            seen = self.layouts.get(position)
            if seen is None:
                self.layouts[position] = x._layout
            elif seen is not x._layout and seen != x._layout:
                raise UnsupportedRaggedOp(
                    f"{_op_name(self.func)} mixes RaggedTensors of two different layouts ({seen} and {x._layout}): "
                    f"their pieces hold different parts of the tensor. Use tensors sharded the same way (states "
                    f"made from the parameter with zeros_like / clone), or full_tensor() both."
                )
            self.wrappers[id(x._local_tensor)] = x
            return x._local_tensor
        if isinstance(x, torch.Tensor) and x.dim() != 0 and not (self.foreach and not in_list and x.dim() == 1):
            raise UnsupportedRaggedOp(
                f"{_op_name(self.func)} mixes a sharded RaggedTensor with a plain tensor of shape {tuple(x.shape)}: "
                f"only Python numbers and 0-d tensors combine with a sharded piece. Shard both the same way, or "
                f"call .full_tensor() on the RaggedTensor."
            )
        return x

    def __call__(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def arg(x: Any) -> Any:
            if isinstance(x, (list, tuple)) and any(isinstance(e, torch.Tensor) for e in x):
                return type(x)(self.one(e, i if self.foreach else 0, True) for i, e in enumerate(x))
            return self.one(x, 0, False)

        return tuple(arg(a) for a in args), {k: arg(v) for k, v in kwargs.items()}

    def wrap(self, out: Any, position: int = 0) -> Any:
        """The RaggedTensor for a local result: the input itself for in-place ops, else a new one."""
        if not isinstance(out, torch.Tensor):
            return out
        back = self.wrappers.get(id(out))
        if back is not None:
            return back
        layout = self.layouts.get(position)
        return out if layout is None else _wrap(out, layout)


_NO_KWARGS: dict = {}
_NOT_SCALARS = (torch.Tensor, list, tuple)
_disabled_torch_function_impl = torch._C._disabled_torch_function_impl
_increment_version = torch.autograd.graph.increment_version

_DIRECT_NAMES = (
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "addcmul", "addcmul_", "addcdiv", "addcdiv_",
    "lerp", "lerp_", "sqrt", "sqrt_", "rsqrt", "neg", "neg_", "abs", "sign", "sign_", "square", "clamp", "clamp_",
    "clamp_min", "clamp_min_", "clamp_max", "clamp_max_", "copy_", "zero_", "fill_", "__add__", "__radd__",
    "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__", "__rmul__", "__imul__", "__truediv__",
    "__itruediv__", "__neg__",
)
_DIRECT_ELEMENTWISE = frozenset(
    f for name in _DIRECT_NAMES for f in (getattr(torch.Tensor, name, None), getattr(torch, name, None)) if f is not None
)
"""Python-level elementwise functions and methods :meth:`RaggedTensor.__torch_function__` runs on the pieces
directly (under no_grad, between RaggedTensors of one layout and Python scalars): the same computation the
dispatch path does, without its cost."""


def _pieces_of_one_layout(args: tuple) -> tuple[Optional[RaggedLayout], list]:
    """``(layout, pieces)`` when the tensor arguments are RaggedTensors of one layout object and the rest Python
    scalars (the fast paths; the single-tensor optimizer step runs ~8 ops per parameter); ``(None, [])`` else."""
    layout = None
    local_args = []
    for a in args:
        if type(a) is RaggedTensor:
            if layout is None:
                layout = a._layout
            elif a._layout is not layout:
                return None, []
            local_args.append(a._local_tensor)
        elif isinstance(a, _NOT_SCALARS):
            return None, []
        else:
            local_args.append(a)
    return layout, local_args


def _wrap_piece(out: torch.Tensor, layout: RaggedLayout) -> RaggedTensor:
    return _wrap(out, layout)


def _elementwise_direct(func: Any, args: tuple, kwargs: Optional[dict]) -> Any:
    """``func`` on the pieces, or NotImplemented unless every tensor argument is a RaggedTensor of one layout."""
    layout, local_args = _pieces_of_one_layout(args)
    if layout is None:
        return NotImplemented
    if kwargs:
        for v in kwargs.values():
            if isinstance(v, _NOT_SCALARS):
                return NotImplemented
        out = func(*local_args, **kwargs)
    else:
        out = func(*local_args)
    if out is local_args[0]:
        _increment_version(args[0])  # as the dispatcher does for an in-place op on the wrapper
        return args[0]
    return _wrap_piece(out, layout)  # every listed op returns one tensor


def _elementwise(func: Any, args: tuple, kwargs: dict) -> Any:
    layout, local_args = _pieces_of_one_layout(args)
    if layout is None:
        return _elementwise_checked(func, args, kwargs)
    if kwargs:
        for v in kwargs.values():
            if isinstance(v, torch.Tensor):
                return _elementwise_checked(func, args, kwargs)
    out = func(*local_args, **kwargs)
    if out is local_args[0]:
        return args[0]  # in-place on the first argument
    if type(out) is torch.Tensor:
        return _wrap_piece(out, layout)
    return _elementwise_checked(func, args, kwargs)


def _elementwise_checked(func: Any, args: tuple, kwargs: dict) -> Any:
    unwrap = _Unwrapper(func, foreach=False)
    local_args, local_kwargs = unwrap(args, kwargs)
    out = func(*local_args, **local_kwargs)
    if isinstance(out, (list, tuple)):
        return type(out)(unwrap.wrap(o) for o in out)
    return unwrap.wrap(out)


def _foreach(func: Any, args: tuple, kwargs: dict) -> Any:
    unwrap = _Unwrapper(func, foreach=True)
    local_args, local_kwargs = unwrap(args, kwargs)
    out = func(*local_args, **local_kwargs)
    if isinstance(out, (list, tuple)):
        return type(out)(unwrap.wrap(o, i) for i, o in enumerate(out))
    return out


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The plain storage of ``t``'s piece for a RaggedTensor (what the engine computes on), else ``t``."""
    return t._local_tensor if isinstance(t, RaggedTensor) else t


class RaggedPiece(torch.Tensor):
    """This rank's piece of a RaggedTensor cut inside rows, as ``to_local()`` returns it: a plain tensor in every
    respect (results of ops on it are plain tensors) but one. ``copy_`` from the whole tensor, or from the rows that
    cover the piece, takes the piece's elements of it: DTensor code describes a shard by a box of rows
    (``compute_local_shape_and_global_offset``, which asks :class:`RaggedShard` for those rows), and torch's
    ``set_model_state_dict(..., broadcast_from_rank0=True)`` copies that box into ``to_local()``.
    """

    _ragged_layout: RaggedLayout

    @staticmethod
    def of(local: torch.Tensor, layout: RaggedLayout) -> RaggedPiece:
        piece = local.as_subclass(RaggedPiece)
        piece._ragged_layout = layout
        return piece

    def _source_offset(self, src: torch.Tensor) -> Optional[int]:
        """Where this piece starts in ``src`` when ``src`` is the whole tensor or its covering rows, else None."""
        layout = self._ragged_layout
        shape, (start, end) = layout.shape, layout.local_range
        if layout.order is not None:
            return None  # copy_ from the whole tensor takes the piece in storage order (__torch_function__)
        if tuple(src.shape) == shape:
            return start
        row = math.prod(shape[1:])
        first = start // row
        if row and tuple(src.shape) == (-(-end // row) - first, *shape[1:]):
            return start - first * row
        return None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and isinstance(args[0], RaggedPiece) and isinstance(args[1], torch.Tensor):
            dst, src = args[0], args[1]
            layout = dst._ragged_layout
            if layout.order is not None and tuple(src.shape) == layout.shape:
                with torch._C.DisableTorchFunctionSubclass():
                    dst.copy_(layout.take_piece(src), **kwargs)
                return dst
            offset = dst._source_offset(src) if tuple(src.shape) != tuple(dst.shape) else None
            if offset is not None:
                with torch._C.DisableTorchFunctionSubclass():
                    dst.copy_(src.reshape(-1)[offset : offset + dst.numel()], **kwargs)
                return dst
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if isinstance(out, RaggedPiece) and not any(out is a for a in args):
            return out.as_subclass(torch.Tensor)
        return out

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)  # saved as the plain tensor it is


def piece_of(src: torch.Tensor, layout: RaggedLayout) -> torch.Tensor:
    """This rank's piece of ``layout`` taken from ``src``, a tensor of the layout's global shape: a RaggedTensor
    (of any layout), another DTensor (``Shard``, ``Replicate`` ...: gathered first, a collective over its mesh), or
    a plain full tensor. The result is flat (``layout``'s local range), on ``src``'s device."""
    if tuple(src.shape) != layout.global_shape:
        raise ValueError(f"a {tuple(src.shape)} tensor cannot give a piece of a {layout.global_shape} tensor")
    if isinstance(src, RaggedTensor):
        if src._layout == layout:
            return src._local_tensor.reshape(-1)
        full = src.full_tensor()
    elif isinstance(src, DTensor):
        full = src.full_tensor()
    else:
        full = src
    return layout.take_piece(full.detach())


def _copy(func: Any, args: tuple, kwargs: dict) -> Any:
    """``dst.copy_(src)``: between pieces of one layout, or from a Python / 0-d scalar, it runs on the pieces; a
    RaggedTensor ``dst`` also takes its piece of a ``src`` of its global shape laid out otherwise (another layout,
    another DTensor, a full tensor): what ``load_state_dict`` and ``set_model_state_dict`` copy in."""
    dst, src = args[0], args[1]
    if (isinstance(dst, RaggedTensor) and isinstance(src, torch.Tensor) and src.dim() > 0
            and not (isinstance(src, RaggedTensor) and src._layout == dst._layout)
            and tuple(src.shape) == tuple(dst.shape)):
        piece = piece_of(src, dst._layout)
        dst._local_tensor.view(-1).copy_(piece.to(dst._local_tensor.device), **kwargs)
        return dst
    return _elementwise(func, args, kwargs)


def _detach(func: Any, args: tuple, kwargs: dict) -> Any:
    self = args[0]
    return RaggedTensor(func(self._local_tensor, *args[1:], **kwargs), self._layout)


def _same_shape_view(func: Any, args: tuple, kwargs: dict) -> Any:
    """``view`` / ``reshape`` to the same global shape (a no-op user code does) keeps the layout."""
    self, shape = args[0], args[1]
    if torch.empty(self.shape, device="meta").view(shape).shape != self.shape:
        return _unsupported(func, args, kwargs)
    return RaggedTensor(self._local_tensor.view(self._local_tensor.shape), self._layout)


def _is_same_size(func: Any, args: tuple, kwargs: dict) -> bool:
    return tuple(args[0].shape) == tuple(args[1].shape)


def _new_factory(func: Any, args: tuple, kwargs: dict) -> Any:
    """``new_empty`` / ``new_zeros`` ...: a RaggedTensor for the global shape, else a plain tensor (no data read)."""
    self, size = args[0], tuple(args[1])
    if size == tuple(self.shape):
        return RaggedTensor(func(self._local_tensor, self._local_tensor.shape, *args[2:], **kwargs), self._layout)
    return func(self._local_tensor, size, *args[2:], **kwargs)


def _random_fill(func: Any, args: tuple, kwargs: dict) -> Any:
    """Draw the full tensor from the generator and keep this rank's piece: the unsharded model's values."""
    self = args[0]
    others = _flat_tensors((args[1:], kwargs))
    if not isinstance(self, RaggedTensor) or any(isinstance(a, RaggedTensor) for a in others):
        return _unsupported(func, args, kwargs)
    full = torch.empty(self._layout.global_shape, dtype=self.dtype, device=self.device)
    func(full, *args[1:], **kwargs)
    self._local_tensor.view(-1).copy_(self._layout.take_piece(full))
    return self


# -- reductions -------------------------------------------------------------------------------------------


def _all_reduce(value: torch.Tensor, layout: RaggedLayout, op: Any) -> torch.Tensor:
    for group in layout.reduce_groups:
        collectives.all_reduce(value, group, op=op, kind="all_reduce_ragged")
    return value


def _is_full_reduction(self: torch.Tensor, dims: Any, keepdim: bool) -> bool:
    if keepdim:
        return False
    return dims in (None, [], ()) or sorted(d % self.dim() for d in dims) == list(range(self.dim()))


def _reduction_input(func: Any, args: tuple, kwargs: dict) -> RaggedTensor:
    """The RaggedTensor of a reduction over all of it; a reduction over some dims is refused."""
    self = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if not isinstance(self, RaggedTensor) or not _is_full_reduction(self, dims, keepdim):
        _unsupported(func, args, kwargs)
    return self


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype == torch.float64:
        return dtype
    return torch.float32 if dtype.is_floating_point or dtype.is_complex else torch.int64


def _sum(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    self = _reduction_input(func, args, kwargs)
    dtype = kwargs.get("dtype") or (self.dtype if self.dtype.is_floating_point else torch.int64)
    total = _all_reduce(self._local_tensor.sum(dtype=_accumulation_dtype(dtype)), self._layout, dist.ReduceOp.SUM)
    return total.to(dtype)


def _mean(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    self = _reduction_input(func, args, kwargs)
    dtype = kwargs.get("dtype") or self.dtype
    total = _all_reduce(self._local_tensor.sum(dtype=_accumulation_dtype(dtype)), self._layout, dist.ReduceOp.SUM)
    return (total / self.numel()).to(dtype)


def _neutral(dtype: torch.dtype, largest: bool) -> float:
    """The value that never wins a max (``largest``) or min: what an empty piece contributes."""
    if dtype.is_floating_point:
        return -math.inf if largest else math.inf
    info = torch.iinfo(dtype) if dtype != torch.bool else None
    if info is None:
        return not largest
    return info.min if largest else info.max


def _extreme(func: Any, args: tuple, kwargs: dict, largest: bool) -> torch.Tensor:
    self = _reduction_input(func, args, kwargs)
    if self.numel() == 0:
        raise RuntimeError(f"{_op_name(func)}: the tensor has no elements")
    local = self._local_tensor
    if local.numel():
        value = (local.max() if largest else local.min()).clone()
    else:
        value = torch.full((), _neutral(local.dtype, largest), dtype=local.dtype, device=local.device)
    return _all_reduce(value, self._layout, dist.ReduceOp.MAX if largest else dist.ReduceOp.MIN)


def _any_all(func: Any, args: tuple, kwargs: dict, want_all: bool) -> torch.Tensor:
    self = _reduction_input(func, args, kwargs)
    local = self._local_tensor
    value = (local.all() if want_all else local.any()) if local.numel() else torch.tensor(want_all, device=local.device)
    as_int = value.to(torch.int32)
    _all_reduce(as_int, self._layout, dist.ReduceOp.MIN if want_all else dist.ReduceOp.MAX)
    return as_int.to(torch.bool)


def _local_norm_power(local: torch.Tensor, p: float) -> torch.Tensor:
    """``sum |x|^p`` of the piece (``max |x|`` for inf, ``-min`` trick for -inf, count for 0), in fp32 or better."""
    acc = torch.float64 if local.dtype == torch.float64 else torch.float32
    if local.numel() == 0:
        return torch.zeros((), dtype=acc, device=local.device) if p != -math.inf else torch.full(
            (), math.inf, dtype=acc, device=local.device)
    x = local.detach().to(acc).abs()
    if p == math.inf:
        return x.max()
    if p == -math.inf:
        return x.min()
    if p == 0:
        return (x != 0).sum().to(acc)
    return torch.linalg.vector_norm(x, p) ** p


def _finish_norm(power: torch.Tensor, p: float, dtype: torch.dtype) -> torch.Tensor:
    if p in (math.inf, -math.inf, 0):
        return power.to(dtype)
    return (power ** (1.0 / p)).to(dtype)


def _norm_op(p: float) -> Any:
    return dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.MIN if p == -math.inf else dist.ReduceOp.SUM


def _vector_norm(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    self = args[0]
    p = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dims = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    if not isinstance(self, RaggedTensor) or not _is_full_reduction(self, dims, keepdim):
        return _unsupported(func, args, kwargs)
    dtype = kwargs.get("dtype") or self.dtype
    power = _all_reduce(_local_norm_power(self._local_tensor, p), self._layout, _norm_op(p))
    return _finish_norm(power, p, dtype)


def _norm(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """``aten.norm.Scalar`` / ``norm.ScalarOpt_dim`` (``Tensor.norm``) as a full vector norm."""
    p = args[1] if len(args) > 1 and args[1] is not None else kwargs.get("p", 2)
    dims = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    return _vector_norm(aten.linalg_vector_norm.default, (args[0], p, dims, keepdim), {"dtype": kwargs.get("dtype")})


def _check_resident(t: RaggedTensor) -> None:
    """A piece whose storage a memory tier released (gradients on disk between steps) cannot be read: say how to
    read it instead of letting a kernel read freed memory."""
    local = t._local_tensor
    if local.numel() and local.untyped_storage().nbytes() == 0:
        raise RuntimeError(
            "this sharded tensor's piece is not in memory (a memory tier keeps it off the device between steps, e.g. "
            "MemoryPolicy(grads='disk')): clip with lightning_vescale.clip_grad_norm_ (the strategies and the "
            "Accelerate adapter do), or read it inside lightning_vescale.memory.resident_pieces(model)"
        )


def _foreach_norm(func: Any, args: tuple, kwargs: dict) -> list:
    """The global norm of every tensor: one all-reduce per process group for the whole list
    (``clip_grad_norm_``'s fast path)."""
    tensors = args[0]
    p = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dtype = kwargs.get("dtype", args[2] if len(args) > 2 else None)
    out: list = [None] * len(tensors)
    by_group: dict = {}
    for i, t in enumerate(tensors):
        if isinstance(t, RaggedTensor):  # one all-reduce per set of groups (tensor-parallel shards: two)
            by_group.setdefault(tuple(id(g) for g in t._layout.reduce_groups), []).append(i)
        else:  # a plain tensor is whole on this rank: its norm is local (each output is one tensor's norm)
            out[i] = torch.linalg.vector_norm(t, p, dtype=dtype)
    for idx in by_group.values():
        for i in idx:
            _check_resident(tensors[i])
        powers = torch.stack([_local_norm_power(tensors[i]._local_tensor, p) for i in idx])
        _all_reduce(powers, tensors[idx[0]]._layout, _norm_op(p))
        for k, i in enumerate(idx):
            out[i] = _finish_norm(powers[k], p, dtype or tensors[i].dtype)
    return out


def _equal(func: Any, args: tuple, kwargs: dict) -> bool:
    """``torch.equal``: the global answer. Pieces of one layout compare locally (one all-reduce); anything else
    (another layout, a plain full tensor) is compared whole. Every rank takes the same path (shapes and
    layouts are the same everywhere)."""
    a, b = args[0], args[1]
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return False
    if isinstance(a, RaggedTensor) and isinstance(b, RaggedTensor) and a._layout == b._layout:
        same = torch.tensor(int(torch.equal(a._local_tensor, b._local_tensor)), dtype=torch.int32, device=a._local_tensor.device)
        return bool(_all_reduce(same, a._layout, dist.ReduceOp.MIN).item())
    whole = [t.full_tensor() if isinstance(t, RaggedTensor) else t for t in (a, b)]
    return torch.equal(whole[0], whole[1].to(whole[0].device))


_EXPLICIT_ELEMENTWISE = {
    aten.copy_.default, aten.zero_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.clone.default,
    aten._to_copy.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
    aten.full_like.default, aten.lerp_.Scalar, aten.lerp_.Tensor, aten.masked_fill_.Scalar,
}

_HANDLERS: dict[Any, Callable] = {
    aten.copy_.default: _copy,
    aten.detach.default: _detach,
    aten.alias.default: _detach,
    aten.view.default: _same_shape_view,
    aten.reshape.default: _same_shape_view,
    aten._unsafe_view.default: _same_shape_view,
    aten.is_same_size.default: _is_same_size,
    aten.new_empty.default: _new_factory,
    aten.new_zeros.default: _new_factory,
    aten.new_ones.default: _new_factory,
    aten.new_full.default: _new_factory,
    aten.sum.default: _sum,
    aten.sum.dim_IntList: _sum,
    aten.mean.default: _mean,
    aten.mean.dim: _mean,
    aten.max.default: functools.partial(_extreme, largest=True),
    aten.min.default: functools.partial(_extreme, largest=False),
    aten.amax.default: functools.partial(_extreme, largest=True),
    aten.amin.default: functools.partial(_extreme, largest=False),
    aten.any.default: functools.partial(_any_all, want_all=False),
    aten.all.default: functools.partial(_any_all, want_all=True),
    aten.linalg_vector_norm.default: _vector_norm,
    aten.norm.Scalar: _norm,
    aten.norm.ScalarOpt_dim: _norm,
    aten._foreach_norm.Scalar: _foreach_norm,
    aten.equal.default: _equal,
}


def _handler_for(func: Any) -> Callable:
    name = func._schema.name
    tags = func.tags
    if torch.Tag.nondeterministic_seeded in tags:
        return _random_fill if torch.Tag.inplace_view not in tags and name.endswith("_") else _unsupported
    if name.startswith("aten::_foreach_") or name.startswith("aten::_fused_"):
        if name in ("aten::_foreach_max",):
            return _unsupported
        return _foreach
    if torch.Tag.pointwise in tags or func in _EXPLICIT_ELEMENTWISE:
        return _elementwise
    return _unsupported


def _register_foreach_support() -> None:
    """Let torch's optimizers and ``clip_grad_norm_`` take their ``foreach`` paths with RaggedTensors, as
    ``torch.distributed.tensor`` does for DTensor (one dispatch per list instead of one per tensor)."""
    from torch.optim import optimizer as optim_module
    from torch.utils import _foreach_utils

    for supported in (optim_module._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if RaggedTensor not in supported:
            supported.append(RaggedTensor)


_register_foreach_support()

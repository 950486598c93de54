"""The buffers a resolved group gets on ``N`` ranks, without a process group: the engine's own
:func:`~lightning_vescale.engine.group_plan.plan_group_buffers` (the function :class:`~lightning_vescale.engine.param_group.ParamGroup`
builds its buffers from) on the group's parameters as the plan describes them, and the bytes of each buffer.

Block-quantized parameters (a plan's ``quantization: fp8_block | int8_block``, declared by ``parallelize`` on the
2-D weights and 3-D expert stacks it covers) carry the declaration ``parallelize`` would set, so they get the
engine's buffer kinds (:mod:`lightning_vescale.quant._kinds`):

* a trained one a :class:`~lightning_vescale.quant._gather.QuantizedGatherBuffer`: fp32 master pieces, tile-major
  and cut between any two tiles where the shape allows (layout ``"block_major"``, or ``"auto"`` where that pads
  less), else cut between bands of ``b``
  rows of each matrix (every ``b x b`` tile whole on one rank either way), gathered as one byte of code per element
  plus one fp32 scale per tile (two AllGathers);
* a frozen one a :class:`~lightning_vescale.quant._storage.QuantizedStorage`: ``b x b`` tiles of codes and one
  fp32 scale per tile on each rank, gathered as they are, dequantized into the compute dtype.

``tests/distributed/test_plan_parallelize.py`` checks that these plans have the fingerprints of the
plans of a model sharded for real, so the dry run's bytes are the engine's bytes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:  # the resolved plan prints its table through this module
    from lightning_vescale.plan._resolve import GroupPolicy, ParamPolicy, ResolvedPlan
from lightning_vescale.engine.group_plan import BufferKind, ParamEntry, plan_group_buffers
from lightning_vescale.engine.planner import BufferPlan, shard_size_lower_bound
from lightning_vescale.engine.policies import MixedPrecisionPolicy
from lightning_vescale.plan._spec import parse_dtype
from lightning_vescale.quant import GATHER, STORAGE, BlockQuantization, is_tile_major
from lightning_vescale.quant.blocks import band_scale_counts, tile_scale_count
from lightning_vescale.quant.formats import BlockFormat, parse_format

__all__ = ["BLOCK_PADDING_WARNING", "BufferLayout", "block_padding_warnings", "group_layouts",
           "quantized_gather_scales_per_rank"]

BLOCK_PADDING_WARNING = 0.03
"""Padding above which the plan table and the dry run warn that keeping a quantized AllGather's ``b x b`` blocks whole
is expensive (the veScale-FSDP paper's bar for row granularity: < 3%)."""

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool,
    torch.int8, torch.int16, torch.float8_e4m3fn, torch.float8_e5m2,
)}


@dataclass(frozen=True)
class BufferLayout:
    """One buffer of a group: its plan, the dtypes it stores, gathers and reduces in, and for a block-quantized
    buffer its kind and format. The ``*_bytes`` figures are per rank, as the engine allocates and sends them."""

    plan: BufferPlan
    dtype: torch.dtype
    """The local pieces' dtype (the master dtype; the codes' dtype of a quantized storage)."""
    param_dtype: torch.dtype
    """dtype of the unsharded parameters (and of the AllGather, unless quantized)."""
    reduce_dtype: torch.dtype
    """dtype of the ReduceScatter."""
    requires_grad: bool
    quant: Optional[str] = None
    """``None``, ``"quantized_gather"`` (trained, gathered as codes + scales) or ``"quantized_storage"`` (frozen,
    stored as codes + scales; ``plan`` is then in tiles)."""
    fmt: Optional[BlockFormat] = None
    scales_per_rank: int = 0
    """Scales each rank sends per AllGather (the largest rank's count; every rank's send is padded to it)."""
    gather_layout: str = "auto"
    """A quantized gather's master layout (``"auto"``, ``"block_major"`` or ``"bands"``, see
    :func:`~lightning_vescale.quant.quantize_all_gather`)."""
    real_numel: int = 0
    """Elements of the parameters (a storage's plan counts tiles)."""
    unsharded_numel: int = 0
    """Elements of the unsharded buffer in ``param_dtype``."""

    @property
    def _format(self) -> BlockFormat:
        assert self.fmt is not None  # a quantized buffer's
        return self.fmt

    @property
    def shard_bytes(self) -> int:
        """Bytes of this rank's pieces (codes and scales for a quantized storage)."""
        S = self.plan.shard_size
        if self.quant == STORAGE:
            return S * self._format.tile_numel * self.dtype.itemsize + 4 * S
        return S * self.dtype.itemsize

    @property
    def gathered_bytes(self) -> int:
        """Bytes of the unsharded parameters while gathered."""
        return self.unsharded_numel * self.param_dtype.itemsize

    @property
    def padding_elements(self) -> int:
        """Elements gathered beyond the parameters' own (alignment, cuts, a storage's partial edge tiles)."""
        if self.quant == STORAGE:
            return self.plan.world_size * self.plan.shard_size * self._format.tile_numel - self.real_numel
        return self.plan.padding

    @property
    def lower_bound_padding_elements(self) -> int:
        """Padding at the planner's lower bound on the shard size (:func:`~lightning_vescale.engine.planner.shard_size_lower_bound`):
        what no order of these tensors can avoid at their granularity."""
        lb = _lower_bound(self.plan)
        if self.quant == STORAGE:
            return self.plan.world_size * lb * self._format.tile_numel - self.real_numel
        return self.plan.world_size * lb - self.plan.total_numel

    @property
    def gather_vs_bf16(self) -> float:
        """Bytes one unshard gathers, relative to a bf16 AllGather of the same elements without padding."""
        N, S = self.plan.world_size, self.plan.shard_size
        if self.quant == GATHER:
            nbytes = N * (S * self._format.code_dtype.itemsize + 4 * self.scales_per_rank)
        elif self.quant == STORAGE:
            nbytes = N * S * (self._format.tile_numel * self.dtype.itemsize + 4)
        else:
            nbytes = N * S * self.param_dtype.itemsize
        return nbytes / max(2 * self.real_numel, 1)

    def all_gather_bytes(self) -> dict[str, int]:
        """Bytes this rank sends per unshard, by ``comm_stats`` kind (nothing on one rank)."""
        N, S = self.plan.world_size, self.plan.shard_size
        if N == 1:
            return {}
        if self.quant == STORAGE:
            return {"all_gather_quant_codes": (N - 1) * S * self._format.tile_numel * self.dtype.itemsize,
                    "all_gather_quant_scales": (N - 1) * S * 4}
        if self.quant == GATHER:
            return {"all_gather_quant_codes": (N - 1) * S * self._format.code_dtype.itemsize,
                    "all_gather_quant_scales": (N - 1) * self.scales_per_rank * 4}
        return {"all_gather": (N - 1) * S * self.param_dtype.itemsize}

    @property
    def gather_transient(self) -> int:
        """Bytes of a quantized gather in flight: the gathered codes and scales (and, for trained weights, this
        rank's quantized send buffers), alive from the AllGathers' issue until they are dequantized into the
        unsharded parameters, which are allocated only then (a plain buffer's are allocated at the issue)."""
        N, S = self.plan.world_size, self.plan.shard_size
        if self.quant == STORAGE:
            return N * S * (self._format.tile_numel * self.dtype.itemsize + 4)
        if self.quant == GATHER:
            P, c = self.scales_per_rank, self._format.code_dtype.itemsize
            return (N + 1) * (S * c + P * 4)
        return 0

    @property
    def reduce_transient(self) -> int:
        """Bytes of the one transient copy before a quantized gather's ReduceScatter: the largest tile-major weight's
        row-major gradient (``param_dtype``), copied while its region is rewritten in tile order."""
        if self.quant != GATHER or not self.requires_grad:
            return 0
        sizes = [s.numel for s in self.plan.specs if is_tile_major(s, self._format, self.gather_layout)]
        return max(sizes, default=0) * self.param_dtype.itemsize


def quantized_gather_scales_per_rank(plan: BufferPlan, fmt: BlockFormat, layout: str = "auto") -> int:
    """``QuantizedGatherBuffer.scales_per_rank`` without building one: the most scales a rank's pieces have
    (:func:`~lightning_vescale.quant.blocks.band_scale_count` per piece of a row-band master,
    :func:`~lightning_vescale.quant.blocks.tile_scale_count` of a tile-major one), in O(tensors + ranks) rather than
    O(tensors x ranks): each tensor counts only the ranks it spans."""
    N, S = plan.world_size, plan.shard_size
    counts = torch.zeros(N, dtype=torch.int64)
    for off, spec in zip(plan.offsets, plan.specs):
        if not spec.numel:
            continue
        ranks = torch.arange(off // S, (off + spec.numel - 1) // S + 1)
        starts = (ranks * S - off).clamp(0, spec.numel)
        ends = ((ranks + 1) * S - off).clamp(0, spec.numel)
        if is_tile_major(spec, fmt, layout):
            tiles = [tile_scale_count(spec.shape, a, b, fmt.block_size) for a, b in zip(starts.tolist(), ends.tolist())]
            counts.index_add_(0, ranks, torch.tensor(tiles, dtype=torch.int64))
            continue
        counts.index_add_(0, ranks, band_scale_counts(spec.shape, starts, ends, fmt))
    return int(counts.max()) if N else 0


def _kind(name: str, p: ParamPolicy, dtype: torch.dtype) -> Optional[BufferKind]:
    """The engine's buffer kind for ``p``: the one its declaration gives a meta stand-in carrying what
    ``parallelize`` would declare (2-D weights and 3-D stacks only; floating ones only)."""
    if p.quantization == "none" or len(p.shape) not in (2, 3) or not dtype.is_floating_point:
        return None
    stand_in = torch.empty(p.shape, dtype=dtype, device="meta", requires_grad=p.requires_grad)
    return BlockQuantization(parse_format(p.quantization)).kind_for(name, stand_in)


@functools.lru_cache(maxsize=4096)
def _lower_bound(plan: BufferPlan) -> int:
    return shard_size_lower_bound(plan.specs, plan.world_size, alignment=plan.alignment)


def block_padding_warnings(groups: list[tuple[str, list[BufferLayout]]]) -> list[str]:
    """Lines saying where a quantized AllGather cannot keep its blocks whole without much padding (more than
    :data:`BLOCK_PADDING_WARNING`), for ``(group label, layouts)`` pairs; groups with the same finding share a line.
    The format is kept (every ``b x b`` tile whole on one rank), never changed."""
    found: dict[str, list[str]] = {}
    for label, layouts in groups:
        for lay in layouts:
            if lay.quant != GATHER or lay.plan.world_size == 1:
                continue
            pad = lay.padding_elements / max(lay.real_numel, 1)
            if pad <= BLOCK_PADDING_WARNING:
                continue
            lb = lay.lower_bound_padding_elements / max(lay.real_numel, 1)
            b = lay._format.block_size
            banded = [s.name for s in lay.plan.specs if not is_tile_major(s, lay._format, lay.gather_layout)]
            where = (f"cuts between {b}x{b} tiles of tile-major masters" if not banded else
                     f"cuts only between {b}-row bands of {', '.join(banded[:3])}" + (" ..." if len(banded) > 3 else "")
                     + (" (shapes the tile order cannot serve, whole-matrix granularity or layout 'bands')"))
            finding = (
                f"keeping the {b}x{b} blocks of its trained {lay._format.kind} weights whole ({where}) costs {pad:.2%} padding on {lay.plan.world_size} ranks (the planner's lower bound at this "
                f"granularity: {lb:.2%}); the quantized AllGather gathers {lay.gather_vs_bf16:.3f}x the bytes of an "
                f"unpadded bf16 one. The format is kept; fewer ranks per group, larger groups or quantization: none "
                f"for these weights avoid the padding."
            )
            found.setdefault(finding, []).append(label)
    out = []
    for finding, labels in found.items():
        who = f"group {labels[0]}" if len(labels) == 1 else (
            f"groups {', '.join(labels[:3])}" + (f" and {len(labels) - 3} more" if len(labels) > 3 else ""))
        out.append(f"warning: {who}: {finding}")
    return out


@functools.lru_cache(maxsize=4096)
def _scales(plan: BufferPlan, fmt: BlockFormat, layout: str) -> int:
    return quantized_gather_scales_per_rank(plan, fmt, layout)


def group_layouts(
    resolved: ResolvedPlan, group: GroupPolicy, world_size: int, *, base_param_dtype: Optional[torch.dtype] = None,
    base_reduce_dtype: Optional[torch.dtype] = None,
) -> list[BufferLayout]:
    """The buffers of ``group`` on ``world_size`` ranks (of its shard group), in the engine's order.

    ``base_*``: the mixed-precision dtypes where the plan sets none (the Trainer's precision).
    """
    gp = parse_dtype(group.param_dtype, "param_dtype") or base_param_dtype
    gr = parse_dtype(group.reduce_dtype, "reduce_dtype") or base_reduce_dtype
    prefix = group.name + "." if group.name else ""
    entries = []
    for name in group.params:
        p = resolved.params[name]
        dtype = _DTYPES[p.dtype]
        entries.append(ParamEntry(name[len(prefix):], tuple(p.shape), dtype, p.requires_grad, p.granularity,
                                  _kind(name, p, dtype)))
    out = []
    for gb in plan_group_buffers(entries, world_size, MixedPrecisionPolicy(param_dtype=gp, reduce_dtype=gr)):
        real = sum(s.numel for s in gb.specs)
        param_dtype = gb.param_dtype or gb.dtype
        quant = gb.kind.key[0] if gb.kind is not None else None
        fmt = gb.kind.fmt if gb.kind is not None else None  # type: ignore[attr-defined]
        gather_layout = getattr(gb.kind, "layout", "auto")
        if quant == STORAGE:
            assert fmt is not None
            # As QuantizedStorage: the unsharded weights one after another in param_dtype, 16-byte aligned.
            align = max(1, 16 // param_dtype.itemsize)
            out.append(BufferLayout(
                plan=gb.plan, dtype=fmt.code_dtype, param_dtype=param_dtype, reduce_dtype=param_dtype,
                requires_grad=False, quant=STORAGE, fmt=fmt, real_numel=real,
                unsharded_numel=sum(-(-s.numel // align) * align for s in gb.specs),
            ))
            continue
        out.append(BufferLayout(
            plan=gb.plan, dtype=gb.dtype, param_dtype=param_dtype, reduce_dtype=gb.reduce_dtype or param_dtype,
            requires_grad=gb.requires_grad, quant=quant, fmt=fmt,
            scales_per_rank=_scales(gb.plan, fmt, gather_layout) if quant == GATHER else 0,
            gather_layout=gather_layout,
            real_numel=real, unsharded_numel=gb.plan.world_size * gb.plan.shard_size,
        ))
    return out

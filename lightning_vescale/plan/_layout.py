"""The buffers a resolved group gets on ``N`` ranks, computed as ``fully_shard`` computes them, without a process
group: one :class:`~lightning_vescale.planner.BufferPlan` per (dtype, requires_grad[, quantization]), the same
tensor specs, granularities, optimizer costs and alignment as :class:`~lightning_vescale._param_group.ParamGroup`
uses.

Block-quantized parameters (a plan's ``quantization: fp8_block | int8_block``, declared by ``parallelize`` on the
2-D weights and 3-D expert stacks it covers) get the engine's buffers, decided and cut by the engine's own
functions (:mod:`lightning_vescale.quant._sharding`, :mod:`lightning_vescale.quant.blocks`):

* a trained one a :class:`~lightning_vescale.quant._gather.QuantizedGatherBuffer`: fp32 master pieces as usual,
  cut between row bands (:func:`~lightning_vescale.quant._sharding.gather_granularity`), gathered as one byte of
  code per element plus one fp32 scale per band tile (two AllGathers);
* a frozen one a :class:`~lightning_vescale.quant._storage.QuantizedStorage`: ``b x b`` tiles of codes and one
  fp32 scale per tile on each rank, gathered as they are, dequantized into the compute dtype.

``tests/distributed/test_plan_parallelize.py`` checks that these plans have the fingerprints of the
plans of a model sharded for real, so the dry run's bytes are the engine's bytes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:  # the resolved plan prints its table through this module
    from lightning_vescale.plan._resolve import GroupPolicy, ParamPolicy, ResolvedPlan
from lightning_vescale.plan._spec import parse_dtype
from lightning_vescale.planner import (
    BufferPlan,
    TensorSpec,
    granule,
    plan_buffer,
)
from lightning_vescale.quant._sharding import GATHER, QUANT_ATTR, STORAGE, gather_granularity, group_key_suffix
from lightning_vescale.quant.blocks import band_scale_count, tile_grid
from lightning_vescale.quant.formats import BlockFormat, parse_format

__all__ = ["BufferLayout", "group_layouts", "quantized_gather_scales_per_rank"]

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
    real_numel: int = 0
    """Elements of the parameters (a storage's plan counts tiles)."""
    unsharded_numel: int = 0
    """Elements of the unsharded buffer in ``param_dtype``."""

    @property
    def shard_bytes(self) -> int:
        """Bytes of this rank's pieces (codes and scales for a quantized storage)."""
        S = self.plan.shard_size
        if self.quant == STORAGE:
            return S * self.fmt.tile_numel * self.dtype.itemsize + 4 * S
        return S * self.dtype.itemsize

    @property
    def gathered_bytes(self) -> int:
        """Bytes of the unsharded parameters while gathered."""
        return self.unsharded_numel * self.param_dtype.itemsize

    @property
    def padding_elements(self) -> int:
        """Elements gathered beyond the parameters' own (alignment, cuts, a storage's partial edge tiles)."""
        if self.quant == STORAGE:
            return self.plan.world_size * self.plan.shard_size * self.fmt.tile_numel - self.real_numel
        return self.plan.padding

    def all_gather_bytes(self) -> dict[str, int]:
        """Bytes this rank sends per unshard, by ``comm_stats`` kind (nothing on one rank)."""
        N, S = self.plan.world_size, self.plan.shard_size
        if N == 1:
            return {}
        if self.quant == STORAGE:
            return {"all_gather_quant_codes": (N - 1) * S * self.fmt.tile_numel * self.dtype.itemsize,
                    "all_gather_quant_scales": (N - 1) * S * 4}
        if self.quant == GATHER:
            return {"all_gather_quant_codes": (N - 1) * S * self.fmt.code_dtype.itemsize,
                    "all_gather_quant_scales": (N - 1) * self.scales_per_rank * 4}
        return {"all_gather": (N - 1) * S * self.param_dtype.itemsize}

    @property
    def gather_transient(self) -> int:
        """Bytes of a quantized gather in flight: the gathered codes and scales (and, for trained weights, this
        rank's quantized send buffers), alive from the AllGathers' issue until they are dequantized into the
        unsharded parameters, which are allocated only then (a plain buffer's are allocated at the issue)."""
        N, S = self.plan.world_size, self.plan.shard_size
        if self.quant == STORAGE:
            return N * S * (self.fmt.tile_numel * self.dtype.itemsize + 4)
        if self.quant == GATHER:
            P, c = self.scales_per_rank, self.fmt.code_dtype.itemsize
            return (N + 1) * (S * c + P * 4)
        return 0


def _owner_cost(shape: tuple[int, ...], g_numel: int) -> float:
    # As _param_group._owner_cost: Newton-Schulz cost of a matrix kept whole on one rank.
    numel = 1
    for s in shape:
        numel *= s
    if len(shape) != 2 or g_numel != numel:
        return 0.0
    short, long = sorted(shape)
    return float(5 * short * short * (2 * long + short))


@functools.lru_cache(maxsize=1024)
def _plan(specs: tuple[TensorSpec, ...], world_size: int, alignment: int) -> BufferPlan:
    return plan_buffer(list(specs), world_size, alignment=alignment)


@functools.lru_cache(maxsize=1024)
def _scales(specs: tuple[TensorSpec, ...], world_size: int, alignment: int, fmt: BlockFormat) -> int:
    return quantized_gather_scales_per_rank(_plan(specs, world_size, alignment), fmt)


def quantized_gather_scales_per_rank(plan: BufferPlan, fmt: BlockFormat) -> int:
    """``QuantizedGatherBuffer.scales_per_rank`` without building one: the most scales a rank's pieces have
    (:func:`~lightning_vescale.quant.blocks.band_scale_count` per piece), in O(tensors) rather than
    O(tensors x ranks) (ranks strictly inside a tensor all hold one shard of it)."""
    N, S = plan.world_size, plan.shard_size
    diff = torch.zeros(N + 1, dtype=torch.int64)
    ends = torch.zeros(N, dtype=torch.int64)
    for i, (off, spec) in enumerate(zip(plan.offsets, plan.specs)):
        if not spec.numel:
            continue
        first, last = off // S, (off + spec.numel - 1) // S
        for q in {first, last}:
            ends[q] += band_scale_count(spec.shape, *plan.piece(i, q), fmt)
        if last > first + 1:
            whole = band_scale_count(spec.shape, 0, S, fmt)
            diff[first + 1] += whole
            diff[last] -= whole
    return int((torch.cumsum(diff, 0)[:N] + ends).max()) if N else 0


def _quantization(name: str, p: ParamPolicy, dtype: torch.dtype) -> tuple[tuple, Optional[torch.Tensor]]:
    """The engine's buffer key suffix for ``p`` (``()``, ``(STORAGE, fmt)`` or ``(GATHER, fmt)``), decided by the
    engine's own function on a meta stand-in carrying the declaration ``parallelize`` would set."""
    # parallelize._declare_quantization: 2-D weights and 3-D stacks only; quantize_*: floating ones only.
    if p.quantization == "none" or len(p.shape) not in (2, 3) or not dtype.is_floating_point:
        return (), None
    stand_in = torch.empty(p.shape, dtype=dtype, device="meta", requires_grad=p.requires_grad)
    setattr(stand_in, QUANT_ATTR, parse_format(p.quantization))
    return group_key_suffix(name, stand_in), stand_in


def group_layouts(
    resolved: ResolvedPlan, group: GroupPolicy, world_size: int, *, base_param_dtype: Optional[torch.dtype] = None,
    base_reduce_dtype: Optional[torch.dtype] = None,
) -> list[BufferLayout]:
    """The buffers of ``group`` on ``world_size`` ranks (of its shard group), in the engine's order (identical
    groups share one planner call).

    ``base_*``: the mixed-precision dtypes where the plan sets none (the Trainer's precision).
    """
    gp = parse_dtype(group.param_dtype, "param_dtype") or base_param_dtype
    gr = parse_dtype(group.reduce_dtype, "reduce_dtype") or base_reduce_dtype
    specs: dict[tuple, list[TensorSpec]] = {}
    prefix = group.name + "." if group.name else ""
    for name in group.params:
        p = resolved.params[name]
        dtype = _DTYPES[p.dtype]
        quant, stand_in = _quantization(name, p, dtype)
        g, period = granule(p.shape, p.granularity)
        if quant and quant[0] == GATHER:
            g, period = gather_granularity(name, stand_in, quant[1], g), 0  # whole row bands, as ParamGroup._build
        inner = name[len(prefix):]
        specs.setdefault((dtype, p.requires_grad, *quant), []).append(
            TensorSpec(inner, p.shape, g, _owner_cost(p.shape, g), period))
    out = []
    for key, key_specs in specs.items():
        dtype, requires_grad, quant = key[0], key[1], key[2:]
        floating = dtype.is_floating_point
        real = sum(s.numel for s in key_specs)
        if quant and quant[0] == STORAGE:
            fmt: BlockFormat = quant[1]
            param_dtype = gp if floating and gp is not None else dtype
            # As QuantizedStorage: one spec of whole tiles per weight, no alignment; the unsharded weights one
            # after another in param_dtype, 16-byte aligned.
            tiles = tuple(TensorSpec(s.name, (math.prod(tile_grid(s.shape, fmt.block_size)),), 1) for s in key_specs)
            align = max(1, 16 // param_dtype.itemsize)
            out.append(BufferLayout(
                plan=_plan(tiles, world_size, 1), dtype=fmt.code_dtype, param_dtype=param_dtype,
                reduce_dtype=param_dtype, requires_grad=False, quant=STORAGE, fmt=fmt, real_numel=real,
                unsharded_numel=sum(-(-s.numel // align) * align for s in key_specs),
            ))
            continue
        param_dtype = gp if floating and gp is not None and gp != dtype else None
        reduce_dtype = (gr if gr is not None else param_dtype) if floating else None
        item = min(dtype.itemsize, (param_dtype or dtype).itemsize)
        alignment = max(1, 16 // item)
        plan = _plan(tuple(key_specs), world_size, alignment)
        fmt = quant[1] if quant else None
        out.append(BufferLayout(
            plan=plan, dtype=dtype, param_dtype=param_dtype or dtype,
            reduce_dtype=reduce_dtype or param_dtype or dtype, requires_grad=requires_grad and floating,
            quant=GATHER if quant else None, fmt=fmt, scales_per_rank=_scales(tuple(key_specs), world_size, alignment, fmt) if quant else 0,
            real_numel=real, unsharded_numel=plan.world_size * plan.shard_size,
        ))
    return out

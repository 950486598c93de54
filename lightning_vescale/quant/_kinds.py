"""How ``fully_shard`` stores block-quantized parameters: the engine's buffer kinds for them.

A parameter is block-quantized when it carries the declaration ``param._vescale_buffer_kind =
BlockQuantization(fmt)`` (set by :func:`~lightning_vescale.quant.quantize_frozen_weights` on a meta-device model or
:func:`~lightning_vescale.quant.quantize_all_gather` on trained weights) or is a
:class:`~lightning_vescale.quant.tensor.QuantizedTensor` (whose class carries ``BlockQuantization()``). The engine
asks the declaration for a kind (see [Note: buffer kinds] in :mod:`lightning_vescale.engine.group_plan`):

* :class:`QuantizedStorageKind` for a frozen one: a :class:`~lightning_vescale.quant._storage.QuantizedStorage`,
  stored sharded as codes + scales, gathered as codes + scales, dequantized into the compute dtype for forward;
* :class:`QuantizedGatherKind` for a trained one: a :class:`~lightning_vescale.quant._gather.QuantizedGatherBuffer`,
  fp32 master pieces, quantized per rank before the AllGather in exactly the tiles a quantization of the whole
  weight has. Layout ``"block_major"``: a weight whose requested granularity allows cuts inside a
  matrix (``"element"`` / ``"row"``) keeps its master tile-major (:func:`~lightning_vescale.quant.blocks.tile_order_granule`,
  [Note: tile-major master pieces]), cut between any two ``b x b`` tiles; the others, and shapes the tile order
  cannot serve, are cut between bands of ``b`` rows of each matrix (row-major master), as layout ``"bands"``
  does for every weight. ``"auto"`` (the default) takes, per group and world size, whichever of the two pads less.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import torch
from torch import nn

from lightning_vescale.engine.group_plan import GroupBuffer
from lightning_vescale.engine.planner import BufferPlan, TensorSpec, granule, plan_buffer
from lightning_vescale.quant._gather import QuantizedGatherBuffer
from lightning_vescale.quant._storage import QuantizedStorage
from lightning_vescale.quant.blocks import tile_grid, tile_order_granule
from lightning_vescale.quant.formats import BlockFormat
from lightning_vescale.quant.tensor import install_state_dict_hooks, is_quantized

__all__ = ["GATHER", "GATHER_LAYOUTS", "STORAGE", "BlockQuantization", "is_tile_major", "QuantizedGatherKind", "QuantizedStorageKind", "quantization_of"]

STORAGE, GATHER = "quantized_storage", "quantized_gather"
GATHER_LAYOUTS = ("auto", "block_major", "bands")
"""Master layouts of a quantized AllGather's trained weights: per group the one of the other two that pads less
(``"auto"``), tile-major where the shapes allow (cut between tiles), or row bands everywhere (cut between bands of
``b`` rows)."""


@functools.lru_cache(maxsize=1024)
def _planned(specs: tuple[TensorSpec, ...], world_size: int, alignment: int) -> BufferPlan:
    return plan_buffer(list(specs), world_size, alignment=alignment)


def _band(spec: TensorSpec, b: int) -> TensorSpec:
    """``spec`` cut between bands of ``b`` rows of each matrix instead."""
    g, period = granule(spec.shape, b)
    return TensorSpec(spec.name, spec.shape, g, spec.cost, period)


def _tile_granule(shape: tuple[int, ...], b: int) -> Optional[tuple[int, int]]:
    """The tile-major granule of ``shape`` when it gives cuts a band layout does not (more than one tile granule per
    matrix), else None."""
    g = tile_order_granule(tuple(shape), b)
    return g if g is not None and g[0] < g[1] else None


def is_tile_major(spec: TensorSpec, fmt: BlockFormat, layout: str) -> bool:
    """Whether a quantized-gather buffer keeps ``spec``'s master tile-major: its planned granule is one tile (the
    kind chose it, see :meth:`QuantizedGatherKind.granule`; a band or a whole matrix is never one tile then)."""
    return (layout in ("auto", "block_major") and len(spec.shape) in (2, 3) and _tile_granule(spec.shape, fmt.block_size) is not None
            and spec.granularity == fmt.block_size ** 2)


class QuantizedStorageKind:
    """Frozen block-quantized weights: one :class:`QuantizedStorage` of whole tiles per group and format."""

    holds_master_pieces = False

    def __init__(self, fmt: BlockFormat) -> None:
        self.fmt = fmt
        self.key = (STORAGE, fmt)

    def granule(self, name: str, shape: tuple[int, ...], requested: tuple[int, int]) -> tuple[int, int]:
        return requested  # the storage is laid out in whole tiles (planner_specs)

    def planner_specs(self, specs: list[TensorSpec], alignment: int, world_size: int) -> tuple[list[TensorSpec], int]:
        # Every weight has the same granule, one b x b tile of block-major codes: a cut never splits a block.
        return [TensorSpec(s.name, (math.prod(tile_grid(s.shape, self.fmt.block_size)),), 1) for s in specs], 1

    def make_buffer(self, plan: BufferPlan, buffer: GroupBuffer, **kwargs: Any) -> QuantizedStorage:
        return QuantizedStorage(
            [s.name for s in buffer.specs], [s.shape for s in buffer.specs], fmt=self.fmt, group=kwargs["group"],
            world_size=plan.world_size, device=kwargs["device"], param_dtype=buffer.param_dtype or buffer.dtype,
            plan=plan,
        )

    def make_parameters(self, group: Any, managed: Any, buffer: QuantizedStorage, original: torch.Tensor) -> None:
        """The sharded parameter is a QuantizedTensor on ``buffer``'s codes and scales (filled from ``original``'s
        codes, or by quantizing its values; a meta ``original`` is filled by init)."""
        sharded = buffer.sharded_tensor(managed.index, buffer.param_dtype if original.is_meta else original.dtype)
        if original.is_meta:
            group.needs_init = True
        else:
            with torch.no_grad():
                sharded.copy_(original.detach())
        managed.sharded = nn.Parameter(sharded, requires_grad=False)
        managed.unsharded = nn.Parameter(buffer.unsharded_view(managed.index), requires_grad=False)
        managed.requires_grad = False
        for module, _ in managed.uses:
            install_state_dict_hooks(module)


class QuantizedGatherKind:
    """Trained weights whose AllGather moves codes and scales: a :class:`QuantizedGatherBuffer` cut between bands of
    ``block_size`` rows of each matrix."""

    holds_master_pieces = True

    def __init__(self, fmt: BlockFormat, layout: str = "auto") -> None:
        if layout not in GATHER_LAYOUTS:
            raise ValueError(f"quantized AllGather layout must be one of {GATHER_LAYOUTS}, got {layout!r}")
        self.fmt = fmt
        self.layout = layout
        self.key = (GATHER, fmt, layout)

    def granule(self, name: str, shape: tuple[int, ...], requested: tuple[int, int]) -> tuple[int, int]:
        """Cuts where both the requested granularity and the ``b x b`` tiles allow one. For ``"element"`` /
        ``"row"``: between any two tiles of a tile-major master (layout ``"block_major"``, where the shape allows,
        see :func:`is_tile_major`), else between bands of ``b`` rows of each matrix (the last holding the rows that
        remain); bands of ``lcm(k, b)`` rows for ``k`` rows; whole matrices (Muon: row-major, whole on its owner) or
        the whole tensor as requested."""
        shape = tuple(shape)
        g, period = requested
        numel, cols, b = math.prod(shape), shape[-1], self.fmt.block_size
        if g >= numel:
            return requested  # the whole tensor on one rank
        if cols % g == 0:  # element or row: any row start
            tiles = _tile_granule(shape, b) if self.layout != "bands" else None
            return tiles if tiles is not None else granule(shape, b)
        if g % cols == 0:  # k rows (k = rows: whole matrices)
            return granule(shape, math.lcm(g // cols, b))
        return numel, numel  # no such granularity is named; the whole tensor is always safe

    def planner_specs(self, specs: list[TensorSpec], alignment: int, world_size: int) -> tuple[list[TensorSpec], int]:
        """Layout ``"auto"``: the tile-major granules, or the row bands for every weight where those plan to a
        smaller shard (ties: bands, which need no reorder before the ReduceScatter); a band's cuts are not a subset
        of a tile-major master's (its bands are not contiguous there), so neither layout always pads less."""
        if self.layout != "auto" or not any(is_tile_major(s, self.fmt, self.layout) for s in specs):
            return specs, alignment
        b = self.fmt.block_size
        bands = tuple(_band(s, b) if is_tile_major(s, self.fmt, "auto") else s for s in specs)
        tiles = _planned(tuple(specs), world_size, alignment).shard_size
        return (list(bands) if _planned(bands, world_size, alignment).shard_size <= tiles else specs), alignment

    def make_buffer(self, plan: BufferPlan, buffer: GroupBuffer, **kwargs: Any) -> QuantizedGatherBuffer:
        kwargs.pop("world_size", None)
        tile_major = [is_tile_major(s, self.fmt, self.layout) for s in plan.specs]
        return QuantizedGatherBuffer(plan, fmt=self.fmt, tile_major=tile_major, **kwargs)

    def make_parameters(self, group: Any, managed: Any, buffer: Any, original: torch.Tensor) -> None:
        raise AssertionError("a quantized AllGather keeps master pieces: the engine makes its parameters")


class BlockQuantization:
    """The declaration that a parameter is block-quantized in ``fmt`` (a QuantizedTensor's own format when None)."""

    def __init__(self, fmt: Optional[BlockFormat] = None, layout: str = "auto") -> None:
        if layout not in GATHER_LAYOUTS:
            raise ValueError(f"quantized AllGather layout must be one of {GATHER_LAYOUTS}, got {layout!r}")
        self.fmt = fmt
        self.layout = layout

    def format_of(self, param: torch.Tensor) -> BlockFormat:
        return self.fmt if self.fmt is not None else param.fmt  # type: ignore[attr-defined]

    def kind_for(self, name: str, param: torch.Tensor) -> QuantizedStorageKind | QuantizedGatherKind:
        """Frozen (or a QuantizedTensor): codes + scales storage; trained: a quantized AllGather. Raises for what
        the engine cannot honour."""
        if param.dim() not in (2, 3):
            raise ValueError(f"parameter {name} of shape {tuple(param.shape)} is declared block-quantized; only 2-D "
                             f"weights and 3-D expert stacks can be")
        if getattr(param, "_vescale_global_extent", None) is not None:
            raise ValueError(f"parameter {name} is a block of an expert-parallel stack and declared block-quantized: "
                             f"quantization under expert parallelism is not supported yet")
        fmt = self.format_of(param)
        if is_quantized(param) or not param.requires_grad:
            return QuantizedStorageKind(fmt)
        return QuantizedGatherKind(fmt, self.layout)


def quantization_of(param: torch.Tensor) -> Optional[BlockFormat]:
    """The block format ``param`` is declared quantized in, or None."""
    declaration = getattr(param, "_vescale_buffer_kind", None)
    return declaration.format_of(param) if isinstance(declaration, BlockQuantization) else None

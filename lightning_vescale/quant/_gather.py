"""QuantizedGatherBuffer: a DBuffer whose AllGather moves block-quantized codes and scales instead of ``param_dtype``.

[Note: quantized AllGather of trained weights]
Everything about a trained group stays as in :class:`~lightning_vescale.engine.dbuffer.DBuffer` (fp32 master pieces,
views, gradients, the ReduceScatter in ``reduce_dtype``) except how ``unsharded`` is filled:

1. each rank quantizes its own piece of every weight (:mod:`~lightning_vescale.quant.blocks`, row bands): the
   planner cut every weight only between bands of ``b`` rows of each matrix (``granularity=b``, the last band of a
   matrix holding the rows that remain), so every ``b x b`` tile of DeepSeek's ``ceil(R/b) x ceil(C/b)`` grid is
   whole on one rank, each rank quantizes exactly those tiles (scales over their real elements) and no amax is
   exchanged;
2. one AllGather of the codes (a ``uint8`` mirror of the fp32 buffer: 1 byte per element, padding included)
   and one of the scales (each rank's scales padded to the largest count);
3. each rank dequantizes every piece into ``unsharded`` in ``param_dtype``.

A weight kept tile-major (layout ``"block_major"``, see [Note: tile-major master pieces] in
:mod:`~lightning_vescale.quant.blocks`) is cut between any two tiles instead: its piece is whole tiles in tile
order, quantized tile by tile (each tile contiguous), its codes gathered in that order, and step 3 writes the
row-major weight forward uses straight from them (tile-major -> row-major in the same pass, no extra copy). Its
gradient arrives row-major in the unsharded gradient buffer: before the ReduceScatter each such weight's region is
reordered into tile order in place, through one transient copy of that weight (the largest such weight of the
group is the most held at once). Initialization from a full buffer likewise reorders before keeping the piece.

The gathered weights are therefore bitwise a quantize-dequantize of the whole fp32 master in ``b x b`` tiles, on
any world size. Bytes per element on the wire: ``(1 + p) + 4 / b^2`` (``p`` the padding the block granularity
costs, which the plan table shows next to the planner's lower bound) against ``2 (1 + p_bf16)`` for a bf16
AllGather. Quantization is deterministic, so the gather for backward reproduces forward's weights exactly.
"""

from __future__ import annotations

from typing import Optional

import torch

from lightning_vescale.engine import collectives
from lightning_vescale.engine.dbuffer import BufferState, DBuffer, _alloc_storage
from lightning_vescale.quant.blocks import (
    TileOrder,
    band_scale_count,
    copy_tile_range,
    dequantize_band_piece,
    dequantize_tile_piece_into,
    quantize_band_piece,
    quantize_tile_piece,
    tile_scale_count,
)
from lightning_vescale.quant.formats import BlockFormat

__all__ = ["QuantizedGatherBuffer"]


class QuantizedGatherBuffer(DBuffer):
    """A :class:`DBuffer` of block-quantized AllGather (see the module note). Takes DBuffer's arguments and ``fmt``."""

    def __init__(self, *args, fmt: BlockFormat, tile_major: Optional[list[bool]] = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fmt = fmt
        plan, N = self.plan, self.world_size
        # Per tensor: its master is tile-major (cut between tiles) rather than row bands.
        self.tile_major = list(tile_major) if tile_major is not None else [False] * len(plan.specs)
        self._order = TileOrder(fmt.block_size)
        # Per rank: (tensor index, start, end, local offset, scale offset) of every piece it holds.
        self._pieces: list[list[tuple[int, int, int, int, int]]] = []
        counts = []
        for q in range(N):
            mine, cursor = [], 0
            for i in range(len(plan.specs)):
                start, end = plan.piece(i, q)
                if end > start:
                    mine.append((i, start, end, plan.local_offset(i, q), cursor))
                    cursor += self._scale_count(i, start, end)
            self._pieces.append(mine)
            counts.append(cursor)
        self.scales_per_rank = max(counts) if counts else 0
        self._codes: Optional[torch.Tensor] = None  # the gathered codes and scales, while gathered
        self._scales: Optional[torch.Tensor] = None
        self._handles: list = []

    def _scale_count(self, i: int, start: int, end: int) -> int:
        shape = self.plan.specs[i].shape
        if self.tile_major[i]:
            return tile_scale_count(shape, start, end, self.fmt.block_size)
        return band_scale_count(shape, start, end, self.fmt)

    def element_order(self, index: int) -> Optional[TileOrder]:
        """The storage order of tensor ``index``'s pieces (its layout's ``order``): tile-major, or None (row-major)."""
        return self._order if self.tile_major[index] else None

    def _local_piece(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        start, end = self.plan.piece(index, self.rank)
        if not self.tile_major[index] or end == start:
            return super()._local_piece(flat, index)
        lo = self.plan.local_offset(index, self.rank)
        return flat[lo: lo + end - start]  # whole tiles in tile order: no row shape

    def _reorder_to_tiles(self, flat: torch.Tensor) -> None:
        """Rewrite every tile-major tensor's region of the unsharded ``flat`` (row-major there) in tile order,
        through one transient copy of the tensor."""
        b = self.fmt.block_size
        with torch.no_grad():
            for i, spec in enumerate(self.plan.specs):
                if self.tile_major[i] and spec.numel:
                    off = self.plan.offsets[i]
                    region = flat[off: off + spec.numel]
                    rowmajor = region.clone().view(spec.shape)  # the one transient copy
                    copy_tile_range(region, rowmajor, b, 0, spec.numel, to_tiles=True)

    def finish_init(self, full: torch.Tensor, sharded: dict) -> None:
        self._reorder_to_tiles(full)  # initialized row-major through init_view
        super().finish_init(full, sharded)

    def reduce_grad(self, *, accumulate: bool, async_op: bool = True) -> None:
        """The ReduceScatter of :class:`DBuffer`, after reordering the tile-major weights' row-major gradients into
        tile order (see the module note)."""
        if any(self.tile_major):
            assert self.unsharded_grad is not None and self.grad_allocated
            self._reorder_to_tiles(self.unsharded_grad)
        super().reduce_grad(accumulate=accumulate, async_op=async_op)

    def unshard(self, async_op: bool = False) -> None:
        if self.state is not BufferState.SHARDED:
            return
        S, N, fmt = self.shard_size, self.world_size, self.fmt
        send_codes = torch.zeros(S, dtype=fmt.code_dtype, device=self.device)
        send_scales = torch.zeros(self.scales_per_rank, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for i, start, end, lo, so in self._pieces[self.rank]:
                quantize = quantize_tile_piece if self.tile_major[i] else quantize_band_piece
                codes, scales = quantize(self.local[lo: lo + end - start], self.plan.specs[i].shape, start, end, fmt)
                send_codes[lo: lo + end - start] = codes
                send_scales[so: so + scales.numel()] = scales
        self._codes = torch.empty(N * S, dtype=torch.uint8, device=self.device)
        self._scales = torch.empty(N * self.scales_per_rank, dtype=torch.float32, device=self.device)
        handles = [
            collectives.all_gather_into_tensor(self._codes, send_codes.view(torch.uint8), self.group,
                                               async_op=async_op, kind="all_gather_quant_codes"),
            collectives.all_gather_into_tensor(self._scales, send_scales, self.group, async_op=async_op,
                                               kind="all_gather_quant_scales"),
        ]
        self._handles = [h for h in handles if h is not None]
        self.state = BufferState.GATHERING
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        if self.state is not BufferState.GATHERING:
            return
        for h in self._handles:
            h.wait()
        self._handles = []
        _alloc_storage(self.unsharded)
        S, P, fmt = self.shard_size, self.scales_per_rank, self.fmt
        assert self._codes is not None and self._scales is not None  # gathered by unshard
        codes_all = self._codes.view(fmt.code_dtype)
        # The parameters' views (and tensors autograd saved) see the same values again: keep their version.
        with torch.autograd._unsafe_preserve_version_counter(self.unsharded), torch.no_grad():
            for q, pieces in enumerate(self._pieces):
                for i, start, end, lo, so in pieces:
                    shape = self.plan.specs[i].shape
                    n_scales = self._scale_count(i, start, end)
                    if self.tile_major[i]:
                        view = self.unsharded_view(i)  # written in place: its own version counter stays too
                        with torch.autograd._unsafe_preserve_version_counter(view):
                            dequantize_tile_piece_into(
                                view, codes_all[q * S + lo: q * S + lo + end - start],
                                self._scales[q * P + so: q * P + so + n_scales], start, end, fmt)
                        continue
                    values = dequantize_band_piece(
                        codes_all[q * S + lo: q * S + lo + end - start], self._scales[q * P + so: q * P + so + n_scales],
                        shape, start, end, fmt, self.param_dtype)
                    self.unsharded[q * S + lo: q * S + lo + end - start] = values
        self._codes = self._scales = None
        self.state = BufferState.UNSHARDED

    def reshard(self, keep_for_backward: bool = False) -> None:
        self.wait_unshard()
        super().reshard()

"""QuantizedGatherBuffer: a DBuffer whose AllGather moves block-quantized codes and scales instead of ``param_dtype``.

[Note: quantized AllGather of trained weights]
Everything about a trained group stays as in :class:`~lightning_vescale.dbuffer.DBuffer` (fp32 master pieces,
views, gradients, the ReduceScatter in ``reduce_dtype``) except how ``unsharded`` is filled:

1. each rank quantizes its own piece of every weight (:mod:`~lightning_vescale.quant.blocks`, row bands): the
   planner cut every weight only between bands of ``b`` rows of each matrix (``granularity=b``, the last band of a
   matrix holding the rows that remain), so every ``b x b`` tile of DeepSeek's ``ceil(R/b) x ceil(C/b)`` grid is
   whole on one rank, each rank quantizes exactly those tiles (scales over their real elements) and no amax is
   exchanged;
2. one AllGather of the codes (a ``uint8`` mirror of the fp32 buffer: 1 byte per element, padding included)
   and one of the scales (each rank's scales padded to the largest count);
3. each rank dequantizes every piece into ``unsharded`` in ``param_dtype``.

The gathered weights are therefore bitwise a quantize-dequantize of the whole fp32 master in ``b x b`` tiles, on
any world size. Bytes per element on the wire: ``(1 + p) + 4 / b^2`` (``p`` the padding the block granularity
costs, which the plan table shows next to the planner's lower bound) against ``2 (1 + p_bf16)`` for a bf16
AllGather. Quantization is deterministic, so the gather for backward reproduces forward's weights exactly.
"""

from __future__ import annotations

from typing import Optional

import torch

from lightning_vescale import collectives
from lightning_vescale.dbuffer import BufferState, DBuffer, _alloc_storage
from lightning_vescale.quant.blocks import band_scale_count, dequantize_band_piece, quantize_band_piece
from lightning_vescale.quant.formats import BlockFormat

__all__ = ["QuantizedGatherBuffer"]


class QuantizedGatherBuffer(DBuffer):
    """A :class:`DBuffer` of block-quantized AllGather (see the module note). Takes DBuffer's arguments and ``fmt``."""

    def __init__(self, *args, fmt: BlockFormat, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fmt = fmt
        plan, N = self.plan, self.world_size
        # Per rank: (tensor index, start, end, local offset, scale offset) of every piece it holds.
        self._pieces: list[list[tuple[int, int, int, int, int]]] = []
        counts = []
        for q in range(N):
            mine, cursor = [], 0
            for i, spec in enumerate(plan.specs):
                start, end = plan.piece(i, q)
                if end > start:
                    mine.append((i, start, end, plan.local_offset(i, q), cursor))
                    cursor += band_scale_count(spec.shape, start, end, fmt)
            self._pieces.append(mine)
            counts.append(cursor)
        self.scales_per_rank = max(counts) if counts else 0
        self._codes: Optional[torch.Tensor] = None  # the gathered codes and scales, while gathered
        self._scales: Optional[torch.Tensor] = None
        self._handles: list = []

    def unshard(self, async_op: bool = False) -> None:
        if self.state is not BufferState.SHARDED:
            return
        S, N, fmt = self.shard_size, self.world_size, self.fmt
        send_codes = torch.zeros(S, dtype=fmt.code_dtype, device=self.device)
        send_scales = torch.zeros(self.scales_per_rank, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for i, start, end, lo, so in self._pieces[self.rank]:
                codes, scales = quantize_band_piece(self.local[lo: lo + end - start], self.plan.specs[i].shape, start,
                                                    end, fmt)
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
                    n_scales = band_scale_count(shape, start, end, fmt)
                    values = dequantize_band_piece(
                        codes_all[q * S + lo: q * S + lo + end - start], self._scales[q * P + so: q * P + so + n_scales],
                        shape, start, end, fmt, self.param_dtype)
                    self.unsharded[q * S + lo: q * S + lo + end - start] = values
        self._codes = self._scales = None
        self.state = BufferState.UNSHARDED

    def reshard(self, keep_for_backward: bool = False) -> None:
        self.wait_unshard()
        super().reshard()

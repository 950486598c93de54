"""QuantizedStorage: the sharded storage of a group's frozen block-quantized weights.

[Note: QuantizedStorage layout]
The planner lays the group's quantized weights out in units of *tiles* (``TensorSpec(name, (n_tiles,), 1)``):
every weight has the same granule, one ``b x b`` tile of block-major codes, so a cut never splits a block and
the planner pads as little as at element granularity (``benchmarks/quant_bench.py``, padding section). Rank
``r`` owns tiles ``[r*S, (r+1)*S)``; it keeps

* ``local_codes``  (S * b * b,)  uint8 bytes of its tiles' codes (float8/int8 views for the parameters);
* ``local_scales`` (S,)          fp32, one scale per tile.

That is all a frozen base costs per rank: ``1 + 4 / b**2`` bytes per element (plus edge-tile padding), against
2 for bf16 sharding. Unsharding is two AllGathers (codes as uint8, scales), then each weight's tiles are
dequantized into ``unsharded`` (``param_dtype``, row-major, one offset per weight), whose views are the
parameters forward uses. ``reshard`` frees the gathered codes, scales and ``unsharded``. There are no
gradients: the weights are frozen (adapters train on top of them).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from lightning_vescale.engine import collectives
from lightning_vescale.engine.dbuffer import BufferState, _alloc_storage, _free_storage, alias
from lightning_vescale.engine.planner import BufferPlan, TensorSpec, plan_buffer
from lightning_vescale.engine.tensor import RaggedLayout, RaggedTensor
from lightning_vescale.quant.blocks import codes_shape, dequantize_block_major, tile_grid
from lightning_vescale.quant.formats import BlockFormat
from lightning_vescale.quant.tensor import QuantizedTensor

__all__ = ["QuantizedStorage"]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class QuantizedStorage:
    """The frozen quantized weights of one group: codes and scales per rank, gathered and dequantized for use.

    Args:
        names / shapes: the weights (in group order).
        fmt: their block format.
        group: the process group (``world_size`` ranks).
        device: where every buffer lives.
        param_dtype: the dtype the weights are dequantized into for forward.
    """

    requires_grad = False
    grad_allocated = False
    reducing = False
    holds_master_pieces = False  # codes and scales; the sharded parameters are QuantizedTensors on them

    def __init__(
        self, names: list[str], shapes: list[tuple[int, ...]], *, fmt: BlockFormat,
        group: Optional[dist.ProcessGroup], world_size: int, device: torch.device, param_dtype: torch.dtype,
        plan: Optional[BufferPlan] = None,
    ) -> None:
        self.fmt = fmt
        self.group = group
        self.world_size = world_size
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.device = device
        self.dtype = torch.float32  # what init writes full weights in before they are quantized
        self.param_dtype = param_dtype
        self.shapes = {n: tuple(s) for n, s in zip(names, shapes)}
        if plan is None:  # whole tiles, the planning group_plan.plan_group_buffers does (QuantizedStorageKind)
            specs = [TensorSpec(n, (_numel(tile_grid(s, fmt.block_size)),), 1) for n, s in zip(names, shapes)]
            plan = plan_buffer(specs, world_size)
        self.plan: BufferPlan = plan
        bb = fmt.tile_numel
        S = self.plan.shard_size
        self.local_codes = torch.zeros(S * bb, dtype=torch.uint8, device=device)  # 1D, persistent
        self.local_scales = torch.zeros(S, dtype=torch.float32, device=device)  # 1D, persistent
        # Row-major dequantized weights, one after another (16-byte aligned), for forward.
        self._unsharded_offsets, cursor = [], 0
        align = max(1, 16 // param_dtype.itemsize)
        for spec in self.plan.specs:
            self._unsharded_offsets.append(cursor)
            cursor += -(-_numel(self.shapes[spec.name]) // align) * align
        self.unsharded = torch.empty(cursor, dtype=param_dtype, device=device)  # 1D, freed
        self._unsharded_views = [alias(self.unsharded, off, self.shapes[spec.name])
                                 for off, spec in zip(self._unsharded_offsets, self.plan.specs)]
        _free_storage(self.unsharded)
        self._gathered_codes: Optional[torch.Tensor] = None
        self._gathered_scales: Optional[torch.Tensor] = None
        self._handles: list = []
        self.state = BufferState.SHARDED

    # -- the sharded parameters ---------------------------------------------------------------------------
    @property
    def shard_size(self) -> int:
        return self.plan.shard_size

    def shape_of(self, index: int) -> tuple[int, ...]:
        return self.shapes[self.plan.specs[index].name]

    def tile_range(self, index: int, rank: Optional[int] = None) -> tuple[int, int]:
        """Tiles ``[start, end)`` of weight ``index`` (block-major order) that ``rank`` holds."""
        return self.plan.piece(index, self.rank if rank is None else rank)

    def sharded_tensor(self, index: int, dtype: torch.dtype) -> QuantizedTensor:
        """The sharded parameter of weight ``index``: codes and scales RaggedTensors on this rank's storage."""
        shape = self.shape_of(index)
        fmt, bb = self.fmt, self.fmt.tile_numel
        start, end = self.tile_range(index)
        lo = self.plan.local_offset(index, self.rank)
        tile_ranges = tuple(self.plan.pieces(index))
        codes_local = alias(self.local_codes, lo * bb, ((end - start) * bb,)).view(fmt.code_dtype)
        scales_local = alias(self.local_scales, lo, (end - start,))
        codes = RaggedTensor(codes_local, RaggedLayout(
            codes_shape(shape, fmt.block_size), tuple((a * bb, b * bb) for a, b in tile_ranges), self.group, self.rank))
        scales = RaggedTensor(scales_local, RaggedLayout(tile_grid(shape, fmt.block_size), tile_ranges, self.group,
                                                         self.rank))
        return QuantizedTensor(codes, scales, fmt, shape, dtype)

    def unsharded_view(self, index: int) -> torch.Tensor:
        """Weight ``index`` dequantized (valid data only while unsharded)."""
        return self._unsharded_views[index]

    def enable_grad(self) -> None:
        names = [s.name for s in self.plan.specs]
        raise RuntimeError(
            f"a block-quantized frozen weight ({', '.join(names[:3])}{' ...' if len(names) > 3 else ''}) was set to "
            f"requires_grad=True: its codes cannot be trained. Train adapters on top of it "
            f"(lightning_vescale.quant.apply_lora), or leave it out of quantize_frozen_weights to train it."
        )

    # -- init: full fp32 weights in, this rank's tiles quantized --------------------------------------------
    def materialize_unsharded_for_init(self) -> torch.Tensor:
        """A full fp32 buffer holding every weight row-major (for ``init_sharded_weights``)."""
        return torch.empty(self.unsharded.numel(), dtype=torch.float32, device=self.device)

    def init_view(self, full: torch.Tensor, index: int) -> torch.Tensor:
        return full[self._unsharded_offsets[index]: self._unsharded_offsets[index] + _numel(self.shape_of(index))
                    ].view(self.shape_of(index))

    def finish_init(self, full: torch.Tensor, sharded: dict[int, QuantizedTensor]) -> None:
        """Quantize this rank's tiles of every weight (``sharded``: plan index -> parameter) from the full values."""
        for index, param in sharded.items():
            param.detach().copy_(self.init_view(full, index))

    # -- AllGather / free ----------------------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """Gather every rank's codes and scales (two AllGathers); dequantize in :meth:`wait_unshard`."""
        if self.state is not BufferState.SHARDED:
            return
        N, S, bb = self.world_size, self.shard_size, self.fmt.tile_numel
        self._gathered_codes = torch.empty(N * S * bb, dtype=torch.uint8, device=self.device)
        self._gathered_scales = torch.empty(N * S, dtype=torch.float32, device=self.device)
        handles = [
            collectives.all_gather_into_tensor(self._gathered_codes, self.local_codes, self.group, async_op=async_op,
                                               kind="all_gather_quant_codes"),
            collectives.all_gather_into_tensor(self._gathered_scales, self.local_scales, self.group,
                                               async_op=async_op, kind="all_gather_quant_scales"),
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
        bb, b = self.fmt.tile_numel, self.fmt.block_size
        assert self._gathered_codes is not None and self._gathered_scales is not None  # gathered by unshard
        with torch.autograd._unsafe_preserve_version_counter(self.unsharded), torch.no_grad():
            for index, spec in enumerate(self.plan.specs):
                off, n = self.plan.offsets[index], spec.numel
                shape = self.shape_of(index)
                codes = self._gathered_codes[off * bb: (off + n) * bb].view(self.fmt.code_dtype)
                scales = self._gathered_scales[off: off + n]
                w = dequantize_block_major(codes.view(codes_shape(shape, b)), scales.view(tile_grid(shape, b)), shape,
                                           self.fmt, self.param_dtype)
                # Into the flat buffer (whose version counter is preserved), not through the parameter's view.
                start = self._unsharded_offsets[index]
                self.unsharded[start: start + w.numel()].copy_(w.reshape(-1))
        self._gathered_codes = self._gathered_scales = None
        self.state = BufferState.UNSHARDED

    def reshard(self, keep_for_backward: bool = False) -> None:
        self.wait_unshard()
        _free_storage(self.unsharded)
        self.state = BufferState.SHARDED

    # -- memory ---------------------------------------------------------------------------------------------
    def local_nbytes(self) -> int:
        """Bytes this rank keeps between steps (codes + scales)."""
        return self.local_codes.numel() + 4 * self.local_scales.numel()

"""Thin wrappers over ``torch.distributed`` collectives that count the bytes each rank sends.

Byte accounting follows the ring algorithms NCCL and gloo use: an AllGather or ReduceScatter of a
buffer of ``N * S`` elements sends ``(N - 1) * S`` elements per rank; an AllReduce sends twice that.
The counters are per kind and per step, so training loops can log them and benchmarks can compare
engines on equal terms.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

__all__ = [
    "CommStats", "comm_stats", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single",
]


@dataclass
class CommStats:
    """Bytes sent and calls made per collective kind, for the current step and in total."""

    step_bytes: dict = field(default_factory=lambda: defaultdict(int))
    step_calls: dict = field(default_factory=lambda: defaultdict(int))
    total_bytes: dict = field(default_factory=lambda: defaultdict(int))
    total_calls: dict = field(default_factory=lambda: defaultdict(int))
    last_step_bytes: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, kind: str, num_bytes: int) -> None:
        with self._lock:
            self.step_bytes[kind] += num_bytes
            self.step_calls[kind] += 1
            self.total_bytes[kind] += num_bytes
            self.total_calls[kind] += 1

    def step(self) -> dict:
        """Close the current step: return its bytes per kind and start counting a new one."""
        with self._lock:
            self.last_step_bytes = dict(self.step_bytes)
            self.step_bytes.clear()
            self.step_calls.clear()
            return self.last_step_bytes

    def reset(self) -> None:
        with self._lock:
            for d in (self.step_bytes, self.step_calls, self.total_bytes, self.total_calls):
                d.clear()
            self.last_step_bytes = {}

    def step_total(self) -> int:
        return sum(self.step_bytes.values())


comm_stats = CommStats()
"""The process-wide counter every collective of the engine records into."""


# torch 2.13 renamed the flat-tensor collectives; older releases only have the first names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup] = None, *, async_op: bool = False,
    kind: str = "all_gather",
):
    """``dist.all_gather_into_tensor`` that records ``(N - 1) * input`` bytes under ``kind``."""
    n = dist.get_world_size(group)
    if n == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return None
    comm_stats.record(kind, (n - 1) * _nbytes(input))
    return _all_gather_flat(output, input, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup] = None, *,
    op=dist.ReduceOp.SUM, async_op: bool = False, kind: str = "reduce_scatter",
):
    """``dist.reduce_scatter_tensor`` that records ``(N - 1) * output`` bytes under ``kind``."""
    n = dist.get_world_size(group)
    if n == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return None
    comm_stats.record(kind, (n - 1) * _nbytes(output))
    return _reduce_scatter_flat(output, input, op=op, group=group, async_op=async_op)


def all_reduce(
    tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None, *, op=dist.ReduceOp.SUM, async_op: bool = False,
    kind: str = "all_reduce",
):
    """``dist.all_reduce`` that records ``2 * (N - 1) / N * tensor`` bytes under ``kind``."""
    n = dist.get_world_size(group)
    if n == 1:
        return None
    comm_stats.record(kind, 2 * (n - 1) * _nbytes(tensor) // n)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(
    output: torch.Tensor, input: torch.Tensor, output_split_sizes: Optional[list] = None,
    input_split_sizes: Optional[list] = None, group: Optional[dist.ProcessGroup] = None, *, async_op: bool = False,
    kind: str = "all_to_all",
):
    """``dist.all_to_all_single`` that records the bytes this rank sends to other ranks under ``kind``."""
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    item = input.element_size()
    if input_split_sizes is None:
        sent = input.numel() * (n - 1) // n
    else:
        sent = sum(input_split_sizes) - input_split_sizes[rank]
    comm_stats.record(kind, sent * item)
    return dist.all_to_all_single(
        output, input, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes, group=group,
        async_op=async_op,
    )

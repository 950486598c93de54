"""Thin wrappers over ``torch.distributed`` collectives that count the bytes each rank sends.

Byte accounting follows the ring algorithms NCCL and gloo use: an AllGather or ReduceScatter of a
buffer of ``N * S`` elements sends ``(N - 1) * S`` elements per rank; an AllReduce sends twice that.
The counters are per kind and per step, so training loops can log them and benchmarks can compare
engines on equal terms.

A collective that fails (on gloo: a peer stopped, crashed or fell behind by more than the process-group
timeout) raises :class:`CollectiveError`, which names this rank, the collective and the group's other
ranks; torch's own message names neither. Asynchronous calls return a handle whose ``wait()`` does the
same. (On NCCL a timeout is caught by torch's watchdog, which logs the rank and the operation and ends
the process.)
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = [
    "CollectiveError", "CommStats", "comm_stats", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce",
    "all_to_all_single", "named_collective",
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


class CollectiveError(RuntimeError):
    """A collective failed on this rank; the message names the rank, the collective and the group's other ranks."""


def _describe(kind: str, group: Optional[dist.ProcessGroup], err: BaseException) -> str:
    rank = dist.get_rank()
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    others = [r for r in ranks if r != rank]
    return (
        f"rank {rank}: collective {kind!r} over ranks {ranks} failed: {err}\n"
        f"A collective fails like this when another rank of the group ({others}) stopped, crashed or fell behind "
        f"by more than the process-group timeout: look for the rank that did not reach {kind!r} (its log ends "
        f"earlier). If the wait is expected (slow first steps, large checkpoints), raise the timeout "
        f"(strategy.timeout in the recipes, VeScaleStrategy(timeout=...) / VeScaleFabricStrategy(timeout=...))."
    )


@contextmanager
def named_collective(kind: str, group: Optional[dist.ProcessGroup] = None) -> Iterator[None]:
    """Turn a failure of the collective inside into a :class:`CollectiveError` naming ``kind`` and this rank."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as err:  # DistBackendError and gloo's timeouts are RuntimeErrors
        raise CollectiveError(_describe(kind, group, err)) from err


class _NamedWork:
    """An async collective's handle whose ``wait()`` raises :class:`CollectiveError` (see :func:`named_collective`)."""

    def __init__(self, work: Any, kind: str, group: Optional[dist.ProcessGroup]) -> None:
        self._work, self._kind, self._group = work, kind, group

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        with named_collective(self._kind, self._group):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _run(kind: str, group: Optional[dist.ProcessGroup], collective: Any, *args: Any, **kwargs: Any) -> Any:
    with named_collective(kind, group):
        work = collective(*args, group=group, **kwargs)
    return _NamedWork(work, kind, group) if work is not None else None


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
    return _run(kind, group, _all_gather_flat, output, input, async_op=async_op)


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
    return _run(kind, group, _reduce_scatter_flat, output, input, op=op, async_op=async_op)


def all_reduce(
    tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None, *, op=dist.ReduceOp.SUM, async_op: bool = False,
    kind: str = "all_reduce",
):
    """``dist.all_reduce`` that records ``2 * (N - 1) / N * tensor`` bytes under ``kind``."""
    n = dist.get_world_size(group)
    if n == 1:
        return None
    comm_stats.record(kind, 2 * (n - 1) * _nbytes(tensor) // n)
    return _run(kind, group, dist.all_reduce, tensor, op=op, async_op=async_op)


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
    return _run(
        kind, group, dist.all_to_all_single, output, input, output_split_sizes=output_split_sizes,
        input_split_sizes=input_split_sizes, async_op=async_op,
    )

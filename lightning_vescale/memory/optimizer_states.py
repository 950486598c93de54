"""Optimizer states on the host or disk tier, stepped bucket by bucket with prefetch.

[Note: swapping optimizer states]
Between steps, every per-element optimizer state (a RaggedTensor or plain tensor of the parameter's layout)
keeps its tensor object, so ``optimizer.state``, checkpoints and LR schedulers see the optimizer unchanged,
but its storage is released (resized to 0) after its bytes were written to the tier. The optimizer's
``step`` runs bucket by bucket: the parameter lists of its param groups are narrowed to one bucket of about
``MemoryPolicy.bucket_bytes`` of states, that bucket's states are read back into their own storage, the
optimizer's own ``step`` runs (any elementwise torch optimizer: the numerics are untouched, so training is
bitwise the same as without offload), and the states are written back and released. The next bucket's states
are read on a background thread while a bucket steps, and a stepped bucket's states are written back on another
while the next one steps, with at most ``StateOffload.writes_in_flight`` buckets being written at a time (the
oldest is waited for before another is sent, and every write has completed when ``step`` returns, so between
steps every state is on the tier and nothing is half-written). At most ``2 + writes_in_flight`` buckets of
states are in memory at a time (the one stepping, the one being read, those being written), instead of all of
them. Without ``prefetch`` every read and write is synchronous.

On the disk tier large states bypass the page cache (``DiskStore(direct=True)``): each is read into storage
allocated on a page boundary (:func:`~lightning_vescale.memory.disk.alloc_aligned`) and written from it with
``O_DIRECT``, so the bytes leave memory for real and a read is the device's time, which the background thread
overlaps with the step, as an NVMe swapper does.

A state whose storage is present when a bucket is brought in (a checkpoint load replaced it, or it was just
created by the optimizer) is newer than the tier's copy and is used as it is. Scalar states (``step``) stay
in memory. The swap files are scratch: a checkpoint never reads them, so a killed process leaves nothing a
resume could read half-written.

With the weights and gradient pieces offloaded too (``pieces``, see [Note: offloading the pieces]), a bucket's
pieces are read with its states (the next bucket's ahead), and its weights written back after the step; the
buckets are then cut only between DBuffers, so a buffer's piece is read and written once per step.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional

import torch

from lightning_vescale.memory.disk import DiskStore, alloc_aligned, realign
from lightning_vescale.memory.ledger import memory_stats
from lightning_vescale.memory.pieces import PieceOffload
from lightning_vescale.memory.policy import MemoryPolicy
from lightning_vescale.tensor import is_ragged

logger = logging.getLogger(__name__)

__all__ = ["StateOffload", "offload_optimizer_states", "resident_states"]

_OFFLOADS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, StateOffload]" = weakref.WeakKeyDictionary()


def _storage_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_ragged(t) else t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_swappable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


class StateOffload:
    """Keeps an optimizer's per-element states on a tier between steps (see [Note: swapping optimizer states]).

    Made by :func:`offload_optimizer_states`; ``close()`` brings every state back and stops offloading.
    ``select``: which parameters' states move (a plan's per-parameter tiers); the others stay in memory.
    """

    writes_in_flight: int = 2
    """Buckets whose write-back may be in progress at once (each holds its states' memory until written)."""

    def __init__(self, optimizer: torch.optim.Optimizer, policy: MemoryPolicy,
                 pieces: Optional[PieceOffload] = None,
                 select: Optional[Callable[[torch.Tensor], bool]] = None) -> None:
        if policy.optimizer_states == "device" and pieces is None:
            raise ValueError("offload_optimizer_states needs MemoryPolicy(optimizer_states='host' or 'disk') or "
                             "offloaded pieces (pieces=offload_pieces(model, policy))")
        self.optimizer = optimizer
        self.policy = policy
        self.pieces = pieces
        self.tier = policy.optimizer_states
        self.moves_states = self.tier != "device"
        self.select = select
        self.store: Optional[DiskStore] = DiskStore(policy.disk_dir, direct=True) if self.tier == "disk" else None
        self._known: set[str] = set()  # states counted in the ledger
        self._host: dict[str, torch.Tensor] = {}
        self._offloaded: dict[str, tuple[torch.Tensor, int]] = {}  # key -> (storage tensor, nbytes) on the tier
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lv-prefetch") if policy.prefetch else None
        background_writes = policy.prefetch and self.store is not None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lv-writeback") if background_writes \
            else None
        self._writes: collections.deque[tuple[Future, list[tuple[str, torch.Tensor, int]]]] = collections.deque()
        self._original_step = optimizer.step
        self._original_zero_grad = optimizer.zero_grad
        optimizer.step = self.step  # type: ignore[method-assign]
        if pieces is not None and pieces.grads_io is not None:
            optimizer.zero_grad = self.zero_grad  # type: ignore[method-assign]
        _OFFLOADS[optimizer] = self

    # -- buckets --------------------------------------------------------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def buckets(self) -> list[list[torch.Tensor]]:
        """Parameters in optimizer order, cut into buckets of about ``bucket_bytes`` of states (estimated as two
        states per element of this rank's share of each parameter). The same cuts on every rank, from global
        sizes: optimizers that communicate inside ``step`` (Muon) must step the same parameters everywhere."""
        out, current, size = [], [], 0
        params = self._params()
        pieces = self.pieces
        owner = [pieces.buffer_of(p) if pieces is not None else None for p in params]
        for i, p in enumerate(params):
            share = p.layout_info.world_size if is_ragged(p) else 1
            # What moves per element: two states, the weights and the gradient piece (each where selected).
            per_element = (2 if self._moves(p) else 0) + (
                0 if owner[i] is None else (owner[i].params is not None) + (owner[i].grads is not None))
            size += per_element * p.numel() * p.element_size() // share
            current.append(p)
            # With offloaded pieces, never cut inside a buffer: its piece would be read and written twice.
            same_buffer = i + 1 < len(params) and owner[i] is not None and owner[i + 1] is owner[i]
            if size >= self.policy.bucket_bytes and not same_buffer:
                out.append(current)
                current, size = [], 0
        if current:
            out.append(current)
        return out

    # -- moving states ---------------------------------------------------------------------------------------
    def _moves(self, p: torch.Tensor) -> bool:
        return self.moves_states and (self.select is None or self.select(p))

    def _entries(self, params: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.moves_states:
            return
        for p in params:
            if not self._moves(p):
                continue
            for key, value in (self.optimizer.state.get(p) or {}).items():
                if _is_swappable(value):
                    yield f"{id(p)}:{key}", _storage_tensor(value)

    def _write_out(self, params: list[torch.Tensor]) -> None:
        """Put ``params``' resident states on the tier and release their storage: on the disk tier with a
        background writer, asynchronously (released once written; see :meth:`flush`)."""
        jobs = []
        for key, t in self._entries(params):
            storage = t.untyped_storage()
            if storage.nbytes() == 0:
                continue  # already on the tier
            nbytes = _nbytes(t)
            if key not in self._known:  # first seen (the optimizer just created it): on the device until now
                self._known.add(key)
                memory_stats.add("optimizer_states", "device", nbytes)
            if self.store is None:
                host = self._host.get(key)
                if host is None or host.shape != t.shape or host.dtype != t.dtype:
                    pin = t.device.type != "cpu" and torch.cuda.is_available()
                    host = self._host[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
                if t.device.type == "cpu":
                    continue  # a CPU-only machine: host memory is the device's, nothing to move
                host.copy_(t)
            jobs.append((key, t, nbytes))
        if not jobs:
            return
        if self.store is None:
            self._release(jobs)
        elif self._writer is None:
            self._write_files(jobs)
            self._release(jobs)
        else:
            while len(self._writes) >= self.writes_in_flight:
                self._finish_oldest_write()
            self._writes.append((self._writer.submit(self._write_files, jobs), jobs))

    def _write_files(self, jobs: list[tuple[str, torch.Tensor, int]]) -> None:
        for key, t, nbytes in jobs:
            if t.device.type == "cpu" and self.store.moves_direct(nbytes):
                realign(t)  # once, for a state the optimizer just created: O_DIRECT from then on
            self.store.write(key, t)

    def _release(self, jobs: list[tuple[str, torch.Tensor, int]]) -> None:
        for key, t, nbytes in jobs:
            t.untyped_storage().resize_(0)
            self._offloaded[key] = (t, nbytes)
            memory_stats.add("optimizer_states", self.tier, nbytes)
            memory_stats.add("optimizer_states", "device", -nbytes)

    def _finish_oldest_write(self) -> None:
        future, jobs = self._writes.popleft()
        future.result()  # a write that failed raises here; its states stay in memory (nothing is lost)
        self._release(jobs)

    def flush(self) -> None:
        """Wait for every write-back in flight and release what it wrote: afterwards every state not in use
        is on the tier, whole."""
        while self._writes:
            self._finish_oldest_write()

    def _read_in(self, params: list[torch.Tensor]) -> None:
        for key, t in self._entries(params):
            held = self._offloaded.pop(key, None)
            if held is None or t.untyped_storage().nbytes() != 0:
                continue  # resident: newer than the tier's copy (created by a step, or replaced by a load)
            nbytes = held[1]
            if self.store is not None and self.store.moves_direct(nbytes):
                alloc_aligned(t, nbytes)  # O_DIRECT straight into the state's own storage
            else:
                t.untyped_storage().resize_(nbytes)
            if self.store is not None:
                self.store.read_into(key, t)
            else:
                t.copy_(self._host[key], non_blocking=True)
            memory_stats.add("optimizer_states", self.tier, -nbytes)
            memory_stats.add("optimizer_states", "device", nbytes)

    def _prefetch(self, params: Optional[list[torch.Tensor]]) -> Optional[Future]:
        if params is None:
            return None
        if self.pieces is not None:
            for offload in self.pieces.buffers_of(params):
                offload.start_reads(self.pieces.reader)
        if self._reader is None:
            self._read_in(params)
            return None
        return self._reader.submit(self._read_in, params)

    # -- the step -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """The optimizer's own ``step``, bucket by bucket, with each bucket's states brought in and put back."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.optimizer.param_groups
        originals = [g["params"] for g in groups]
        buckets = self.buckets()
        pending = self._prefetch(buckets[0] if buckets else None)
        try:
            for i, bucket in enumerate(buckets):
                if pending is not None:
                    pending.result()
                pending = self._prefetch(buckets[i + 1] if i + 1 < len(buckets) else None)
                mine = {id(p) for p in bucket}
                for g, params in zip(groups, originals):
                    g["params"] = [p for p in params if id(p) in mine]
                pieces = self.pieces.buffers_of(bucket) if self.pieces is not None else []
                for offload in pieces:
                    offload.bring_in()
                self._original_step()
                self._write_out(bucket)
                for offload in pieces:
                    offload.put_back(params_changed=True)
        finally:
            for g, params in zip(groups, originals):  # first: a read or write that failed raises below
                g["params"] = params
            if self.pieces is not None:
                self.pieces.step_done()
            try:
                if pending is not None:
                    pending.result()
            finally:
                self.flush()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's ``zero_grad``; zeroing in place (``set_to_none=False``) brings offloaded gradient pieces
        in one buffer at a time (dropping them, the default, needs nothing)."""
        if set_to_none:
            return self._original_zero_grad(set_to_none=True)
        for offload in self.pieces.buffers_of(self._params()):
            with self.pieces.resident([offload], changes=True, weights=False):
                for p in self._params():
                    if self.pieces.buffer_of(p) is offload and p.grad is not None:
                        p.grad.zero_()
        rest = [p for p in self._params() if not self.pieces.owns(p) and p.grad is not None]
        for p in rest:
            p.grad.zero_()

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Every state in memory inside the block (to save or load a checkpoint), put back on the tier after."""
        params = self._params()
        self.flush()
        self._read_in(params)
        try:
            yield
        finally:
            self._write_out(params)
            self.flush()

    def close(self) -> None:
        """Bring every state back and stop offloading."""
        self.flush()
        self._read_in(self._params())
        self.optimizer.step = self._original_step  # type: ignore[method-assign]
        self.optimizer.zero_grad = self._original_zero_grad  # type: ignore[method-assign]
        _OFFLOADS.pop(self.optimizer, None)
        for pool in (self._reader, self._writer):
            if pool is not None:
                pool.shutdown()
        if self.store is not None:
            self.store.close()


def offload_optimizer_states(optimizer: torch.optim.Optimizer, policy: MemoryPolicy, *,
                             pieces: Optional[PieceOffload] = None,
                             select: Optional[Callable[[torch.Tensor], bool]] = None) -> StateOffload:
    """Keep ``optimizer``'s per-element states on ``policy.optimizer_states`` between steps.

    Works with any optimizer whose states are per-element tensors and scalars (every elementwise
    ``torch.optim`` optimizer, this package's Muon): training is bitwise the same as without offload.
    ``pieces``: the model's offloaded weights and gradient pieces (:func:`~lightning_vescale.memory.offload_pieces`),
    brought in bucket by bucket with the states (which may then stay on the device). ``select``: the parameters
    whose states move (default: all).
    """
    if optimizer in _OFFLOADS:
        raise ValueError("this optimizer's states are already offloaded")
    return StateOffload(optimizer, policy, pieces, select)


@contextlib.contextmanager
def resident_states(optimizer: Optional[torch.optim.Optimizer]) -> Iterator[None]:
    """Inside the block every state of ``optimizer`` is in memory (a no-op unless it is offloaded)."""
    offload = _OFFLOADS.get(optimizer) if optimizer is not None else None
    if offload is None:
        yield
        return
    with offload.resident():
        yield

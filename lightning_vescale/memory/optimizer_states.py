"""Optimizer states on the host or disk tier, stepped bucket by bucket with prefetch.

[Note: swapping optimizer states]
Between steps, every per-element optimizer state (a RaggedTensor or plain tensor of the parameter's layout)
keeps its tensor object, so ``optimizer.state``, checkpoints and LR schedulers see the optimizer unchanged,
but its storage is released (resized to 0) after its bytes were written to the tier. The optimizer's
``step`` runs bucket by bucket: the parameter lists of its param groups are narrowed to one bucket of about
``MemoryPolicy.bucket_bytes`` of states, that bucket's states are read back into their own storage, the
optimizer's own ``step`` runs (any elementwise torch optimizer: the numerics are untouched, so training is
bitwise the same as without offload), and the states are written back and released. Without ``prefetch``
every read and write is synchronous, inside ``step``. With it, the reads and writes run on two background
threads and overlap compute -- the optimizer step's, and backward's and forward's.

One bound holds the memory: at most ``MemoryPolicy.prefetch_buckets`` buckets (``B``, 5 by default) are in
memory at a time -- read or being read, stepping, or being written back -- and none outside the span from the
end of backward to the start of the next forward. Within it the disk is kept busy:

* Reads: the step's first ``B`` buckets are read during backward already (given the model, as
  :func:`~lightning_vescale.memory.apply_memory_policy` does): the first once all but
  ``StateOffload.backward_lead`` of the gradient reductions backward makes are done (one per sharded group,
  counted in the backward before the previous step; the groups report them through
  ``ParamGroup.grads_reduced_hooks``), and one more after each reduction that follows. Late, when backward has
  freed most activations, and early enough to hide the reads. During the step, bucket ``k`` is read as soon as
  the write of bucket ``k - B`` is done (its memory freed), while the buckets before it step. A forward that
  starts before the step (gradient accumulation, an evaluation) releases what was read ahead and not stepped
  (its tier copy is current), so reads ahead never stay through a forward.
* Writes: a stepped bucket's states are written while the next ones step; the writer releases a bucket's
  storage as soon as it is written. ``step`` returns with the last (at most ``B``) buckets still being written:
  they complete during the next forward, whose activations grow as the gradients (freed by ``zero_grad``) and
  those buckets leave. They are waited for (:meth:`StateOffload.flush`) before anything reads a state again:
  the next read ahead or step, ``resident()`` (every checkpoint save and export), the optimizer's
  ``state_dict`` / ``load_state_dict``, ``close``, and a step that failed.

One bound rather than a read depth and a write depth: what the step cannot hide is the I/O left inside it, and
a shared bound lets backward read, and the next forward write, as much as the step's own memory allows
(``offload_bench.py --prefetch-pairs``: a 2-read/2-write split left 0.66 of the synchronous cost, this 0.50).

On the disk tier large states bypass the page cache (``DiskStore(direct=True)``): a bucket's states are read
into one storage on page boundaries, backed by huge pages (:func:`~lightning_vescale.memory.disk.alloc_together`:
releasing one state releases the bucket's, which moves as one anyway) and written from it with
``O_DIRECT``, so the bytes leave memory for real and a read is the device's time, which the background threads
overlap with compute, as an NVMe swapper does.

A state whose storage is present when a bucket is brought in (a checkpoint load replaced it, or it was just
created by the optimizer) is newer than the tier's copy and is used as it is. Scalar states (``step``) stay
in memory. The swap files are scratch: a checkpoint never reads them (it reads the states through
``resident()``, after the writes in flight completed), so a killed process leaves nothing a resume could read
half-written.

With the weights and gradient pieces offloaded too (``pieces``, see [Note: offloading the pieces]), a bucket's
pieces are read with its states during the step (the next ``pieces_ahead`` buckets' ahead), and its weights
written back after the step; the buckets are then cut only between DBuffers, so a buffer's piece is read and
written once per step.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn

from lightning_vescale.engine.tensor import is_ragged, local_tensor
from lightning_vescale.memory.disk import DiskStore, alloc_together, realign
from lightning_vescale.memory.ledger import memory_stats
from lightning_vescale.memory.pieces import PieceOffload
from lightning_vescale.memory.policy import MemoryPolicy

logger = logging.getLogger(__name__)

__all__ = ["StateOffload", "offload_optimizer_states", "resident_states"]

_OFFLOADS: weakref.WeakKeyDictionary[torch.optim.Optimizer, StateOffload] = weakref.WeakKeyDictionary()


def _storage_tensor(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_swappable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


class StateOffload:
    """Keeps an optimizer's per-element states on a tier between steps (see [Note: swapping optimizer states]).

    Made by :func:`offload_optimizer_states`; ``close()`` brings every state back and stops offloading.
    ``select``: which parameters' states move (a plan's per-parameter tiers); the others stay in memory.
    """

    pieces_ahead: int = 1
    """With offloaded weights and gradient pieces: buckets whose pieces are read ahead of the one stepping."""
    backward_lead: int = 4
    """The step's first buckets are read during backward once all but this many of its gradient reductions
    (one per sharded group) are done."""

    def __init__(self, optimizer: torch.optim.Optimizer, policy: MemoryPolicy,
                 pieces: Optional[PieceOffload] = None,
                 select: Optional[Callable[[torch.Tensor], bool]] = None, model: Optional[nn.Module] = None) -> None:
        if policy.optimizer_states == "device" and pieces is None:
            raise ValueError("offload_optimizer_states needs MemoryPolicy(optimizer_states='host' or 'disk') or "
                             "offloaded pieces (pieces=offload_pieces(model, policy))")
        self.optimizer = optimizer
        self.policy = policy
        self.pieces = pieces
        self.tier = policy.optimizer_states
        self.moves_states = self.tier != "device"
        # With prefetch: buckets of states in memory at once, read ahead (from the end of backward), stepping, or
        # being written back (until the next forward).
        self.buckets_in_memory = policy.prefetch_buckets
        self.select = select
        self.store: Optional[DiskStore] = None
        if self.tier == "disk":
            assert policy.disk_dir  # MemoryPolicy checks a disk tier has one
            self.store = DiskStore(policy.disk_dir, direct=True)
        self._known: set[str] = set()  # states counted in the ledger
        self._host: dict[str, torch.Tensor] = {}
        self._offloaded: dict[str, tuple[torch.Tensor, int]] = {}  # key -> (storage tensor, nbytes) on the tier
        self._fresh: dict[str, tuple[torch.Tensor, int]] = {}  # read from the tier and not stepped since: current
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lv-prefetch") if policy.prefetch else None
        background_writes = policy.prefetch and self.store is not None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lv-writeback") if background_writes \
            else None
        self._writes: collections.deque[Future] = collections.deque()
        self._ahead: dict[tuple[int, ...], Future] = {}  # buckets (parameter ids) being or read ahead, not stepped
        # Gradient reductions in the backward under way (its autograd task) and in the last one before a step.
        self._backward, self._reduced, self._reductions = -1, 0, 0
        self._hooks: list[tuple[Any, Any]] = []
        self._original_step = optimizer.step
        self._original_zero_grad = optimizer.zero_grad
        self._original_state_dict = optimizer.state_dict
        self._original_load_state_dict = optimizer.load_state_dict
        self._patched = {"step": self.step, "state_dict": self._state_dict, "load_state_dict": self._load_state_dict}
        if pieces is not None and pieces.grads_io is not None:
            self._patched["zero_grad"] = self.zero_grad
        self._own_attrs = {name: optimizer.__dict__[name] for name in self._patched if name in optimizer.__dict__}
        for name, method in self._patched.items():
            setattr(optimizer, name, method)
        if model is not None and self.moves_states and self._reader is not None:
            from lightning_vescale.engine.fully_shard import sharded_groups

            for group in sharded_groups(model):
                group.grads_reduced_hooks.append(self._grads_reduced)
                self._hooks.append((group, group.module.register_forward_pre_hook(self._before_forward)))
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
            mine = owner[i]
            per_element = (2 if self._moves(p) else 0) + (
                0 if mine is None else (mine.params is not None) + (mine.grads is not None))
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

    def _write_out(self, params: list[torch.Tensor]) -> Optional[Future]:
        """Put ``params``' resident states on the tier and release their storage: on the disk tier with a
        background writer, asynchronously (released once written; see :meth:`flush`): the write's future."""
        jobs = []
        for key, t in self._entries(params):
            self._fresh.pop(key, None)
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
            return None
        if self.store is None:
            self._release(jobs)
        elif self._writer is None:
            self._write_files(jobs)
            self._release(jobs)
        else:
            while self._writes and self._writes[0].done() and self._writes[0].exception() is None:
                self._writes.popleft()  # one that failed stays: the next flush raises it, its states in memory
            self._writes.append(self._writer.submit(self._write_and_release, jobs))
            return self._writes[-1]
        return None

    def _write_files(self, jobs: list[tuple[str, torch.Tensor, int]]) -> None:
        assert self.store is not None  # the disk tier's
        for key, t, nbytes in jobs:
            if self._moves_direct(t, nbytes):
                realign(t)  # once, for a state the optimizer just created: O_DIRECT from then on
            self.store.write(key, t)

    def _moves_direct(self, t: torch.Tensor, nbytes: int) -> bool:
        """Whether state ``t`` moves with ``O_DIRECT`` (in and out of the storage ``realign`` or ``alloc_together``
        gives it)."""
        return self.store is not None and t.device.type == "cpu" and self.store.moves_direct(nbytes)

    def _write_and_release(self, jobs: list[tuple[str, torch.Tensor, int]]) -> None:
        """On the writer thread: nothing touches these states until they are read again, and every read of them
        waits for this write first."""
        self._write_files(jobs)  # raises (nothing released: the states stay in memory) when the tier cannot take it
        self._release(jobs)

    def _release(self, jobs: list[tuple[str, torch.Tensor, int]]) -> None:
        for key, t, nbytes in jobs:
            t.untyped_storage().resize_(0)
            self._offloaded[key] = (t, nbytes)
            memory_stats.add("optimizer_states", self.tier, nbytes)
            memory_stats.add("optimizer_states", "device", -nbytes)

    def flush(self) -> None:
        """Wait for every write-back in flight (raising the first that failed: its states stay in memory):
        afterwards every state not in use is on the tier, whole."""
        while self._writes:
            self._writes.popleft().result()

    def _read_in(self, params: list[torch.Tensor]) -> None:
        jobs = []
        for key, t in self._entries(params):
            held = self._offloaded.pop(key, None)
            if held is None or t.untyped_storage().nbytes() != 0:
                continue  # resident: newer than the tier's copy (created by a step, or replaced by a load)
            jobs.append((key, t, held))
        # O_DIRECT straight into the states' own memory: one huge-page backed storage for the lot.
        direct = [t for _, t, (_, nbytes) in jobs if self._moves_direct(t, nbytes)]
        try:
            alloc_together(direct)  # inside: out of memory here leaves every one on the tier too
            for key, t, (_, nbytes) in jobs:
                if t.untyped_storage().nbytes() == 0:
                    t.untyped_storage().resize_(nbytes)
                if self.store is not None:
                    self.store.read_into(key, t)
                else:
                    t.copy_(self._host[key], non_blocking=True)
                self._fresh[key] = (t, nbytes)
                memory_stats.add("optimizer_states", self.tier, -nbytes)
                memory_stats.add("optimizer_states", "device", nbytes)
        except BaseException:
            for key, t, held in jobs:  # every one still on the tier, whole: nothing is lost
                if self._fresh.pop(key, None) is not None:
                    memory_stats.add("optimizer_states", self.tier, held[1])
                    memory_stats.add("optimizer_states", "device", -held[1])
                t.untyped_storage().resize_(0)
                self._offloaded[key] = held
            raise

    def _start_read(self, bucket: list[torch.Tensor], after: Optional[Future] = None) -> None:
        """Read ``bucket`` (unless read already) on the background thread, once the write ``after`` is done: the
        write that frees the memory it takes (one that failed kept its states in memory: the step still completes,
        over the bound, and the next :meth:`flush` raises the failure before anything else changes)."""
        key = _bucket_key(bucket)
        if self._reader is not None and self.moves_states and key not in self._ahead:
            self._ahead[key] = self._reader.submit(self._read_after, after, bucket)

    def _read_after(self, write: Optional[Future], bucket: list[torch.Tensor]) -> None:
        if write is not None:
            wait([write])
        self._read_in(bucket)

    def _start_piece_reads(self, buckets: list[list[torch.Tensor]]) -> None:
        if self.pieces is not None and self.pieces.reader is not None:
            for bucket in buckets:
                for offload in self.pieces.buffers_of(bucket):
                    offload.start_reads(self.pieces.reader)

    def _bring_in(self, bucket: list[torch.Tensor]) -> None:
        future = self._ahead.pop(_bucket_key(bucket), None)
        if future is not None:
            future.result()
        else:
            self._read_in(bucket)  # no prefetch: now (states already resident are skipped)

    def _finish_reads(self) -> None:
        """Wait for the reads ahead (their states stay in memory, current: see :meth:`_drop_unstepped`)."""
        ahead, self._ahead = list(self._ahead.values()), {}
        for future in ahead:
            future.result()

    def _drop_unstepped(self) -> None:
        """Release the states read ahead that did not step: the tier's copy is theirs (nothing to write)."""
        self._finish_reads()
        fresh, self._fresh = self._fresh, {}
        for key, (t, nbytes) in fresh.items():
            if t.untyped_storage().nbytes() == 0:
                continue
            t.untyped_storage().resize_(0)
            self._offloaded[key] = (t, nbytes)
            memory_stats.add("optimizer_states", self.tier, nbytes)
            memory_stats.add("optimizer_states", "device", -nbytes)

    # -- reading ahead during backward ------------------------------------------------------------------------
    def _grads_reduced(self, group: Any) -> None:
        """A group's gradients were reduced (``ParamGroup.grads_reduced_hooks``): once all but ``backward_lead`` of
        backward's reductions are done, read the step's first bucket, and one more after each reduction that follows
        (``buckets_in_memory`` in all)."""
        task = torch._C._current_graph_task_id()
        if task == -1:
            return  # finished outside backward (a forward after a backward without a step)
        if task != self._backward:
            self._backward, self._reduced = task, 0
        self._reduced += 1
        first = max(self._reductions - self.backward_lead, 1)  # the reduction after which the first bucket is read
        if not self._reductions or self._reduced < first:
            return
        while self._writes:  # the last step's write-back: finished during forward, normally
            wait([self._writes[0]])
            if self._writes[0].exception() is not None:
                return  # the step raises it
            self._writes.popleft()
        # One more bucket per reduction, as backward frees its memory.
        for bucket in self.buckets()[: min(self.buckets_in_memory, self._reduced - first + 1)]:
            self._start_read(bucket)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if (self._ahead or self._fresh) and torch._C._current_graph_task_id() == -1:  # not a recomputation
            self._drop_unstepped()

    # -- the step -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """The optimizer's own ``step``, bucket by bucket, with each bucket's states brought in and put back."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._reduced:  # the backward just done: how many reductions the next one makes
            self._reductions, self._reduced, self._backward = self._reduced, 0, -1
        self.flush()  # the last step's write-back (complete by now, normally); raises a failure before any change
        groups = self.optimizer.param_groups
        originals = [g["params"] for g in groups]
        buckets = self.buckets()
        failed = True
        slots = max(self.buckets_in_memory, 1)
        writes: list[Optional[Future]] = []  # per bucket stepped: its write-back (None: done already)
        try:
            for i, bucket in enumerate(buckets):
                for k in range(i, min(i + slots, len(buckets))):  # bucket k takes the memory bucket k - slots frees
                    self._start_read(buckets[k], after=writes[k - slots] if k >= slots else None)
                self._start_piece_reads(buckets[i : i + 1 + self.pieces_ahead])
                self._bring_in(bucket)
                mine = {id(p) for p in bucket}
                for g, params in zip(groups, originals):
                    g["params"] = [p for p in params if id(p) in mine]
                pieces = self.pieces.buffers_of(bucket) if self.pieces is not None else []
                for offload in pieces:
                    offload.bring_in()
                self._original_step()
                writes.append(self._write_out(bucket))
                for offload in pieces:
                    offload.put_back(params_changed=True)
            failed = False
        finally:
            for g, params in zip(groups, originals):  # first: a read or write that failed raises below
                g["params"] = params
            if self.pieces is not None:
                self.pieces.step_done()
            try:
                self._finish_reads()  # after a failure: buckets read ahead that did not step stay, current
            finally:
                if failed:
                    self.flush()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's ``zero_grad``; zeroing in place (``set_to_none=False``) brings offloaded gradient pieces
        in one buffer at a time (dropping them, the default, needs nothing)."""
        if set_to_none:
            return self._original_zero_grad(set_to_none=True)
        assert self.pieces is not None  # patched in only with offloaded gradient pieces
        for offload in self.pieces.buffers_of(self._params()):
            with self.pieces.resident([offload], changes=True, weights=False):
                for p in self._params():
                    if self.pieces.buffer_of(p) is offload and p.grad is not None:
                        p.grad.zero_()
        for p in self._params():
            if not self.pieces.owns(p) and p.grad is not None:
                p.grad.zero_()

    def _settle(self) -> None:
        """Every write-back done and nothing read ahead: each state is on the tier, whole."""
        self.flush()
        self._drop_unstepped()

    def _state_dict(self) -> dict:
        self._settle()  # not a state half-written or about to be released under the caller
        return self._original_state_dict()

    def _load_state_dict(self, state_dict: dict) -> None:
        self._settle()  # nothing in flight writes or reads the states being replaced
        self._original_load_state_dict(state_dict)

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Every state in memory inside the block (to save or load a checkpoint), put back on the tier after."""
        params = self._params()
        self.flush()
        self._finish_reads()
        self._read_in(params)
        try:
            yield
        finally:
            self._write_out(params)
            self.flush()

    def close(self) -> None:
        """Bring every state back and stop offloading."""
        self.flush()
        self._finish_reads()
        self._read_in(self._params())
        self._fresh.clear()
        for name in self._patched:  # the optimizer's own methods again
            if name in self._own_attrs:
                setattr(self.optimizer, name, self._own_attrs[name])
            else:
                delattr(self.optimizer, name)
        for group, handle in self._hooks:
            group.grads_reduced_hooks.remove(self._grads_reduced)
            handle.remove()
        self._hooks.clear()
        _OFFLOADS.pop(self.optimizer, None)
        for pool in (self._reader, self._writer):
            if pool is not None:
                pool.shutdown()
        if self.store is not None:
            self.store.close()


def _bucket_key(bucket: list[torch.Tensor]) -> tuple[int, ...]:
    return tuple(id(p) for p in bucket)


def offload_optimizer_states(optimizer: torch.optim.Optimizer, policy: MemoryPolicy, *,
                             pieces: Optional[PieceOffload] = None,
                             select: Optional[Callable[[torch.Tensor], bool]] = None,
                             model: Optional[nn.Module] = None) -> StateOffload:
    """Keep ``optimizer``'s per-element states on ``policy.optimizer_states`` between steps.

    Works with any optimizer whose states are per-element tensors and scalars (every elementwise
    ``torch.optim`` optimizer, this package's Muon): training is bitwise the same as without offload.
    ``pieces``: the model's offloaded weights and gradient pieces (:func:`~lightning_vescale.memory.offload_pieces`),
    brought in bucket by bucket with the states (which may then stay on the device). ``select``: the parameters
    whose states move (default: all). ``model``: the sharded model the optimizer trains; with ``policy.prefetch``,
    the step's first buckets are then read during its backward (see [Note: swapping optimizer states]).
    """
    if optimizer in _OFFLOADS:
        raise ValueError("this optimizer's states are already offloaded")
    return StateOffload(optimizer, policy, pieces, select, model)


@contextlib.contextmanager
def resident_states(optimizer: Optional[torch.optim.Optimizer]) -> Iterator[None]:
    """Inside the block every state of ``optimizer`` is in memory (a no-op unless it is offloaded)."""
    offload = _OFFLOADS.get(optimizer) if optimizer is not None else None
    if offload is None:
        yield
        return
    with offload.resident():
        yield

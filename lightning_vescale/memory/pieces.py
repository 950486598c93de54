"""Sharded master weights and gradient pieces on the host or disk tier between uses.

[Note: offloading the pieces]
Each :class:`~lightning_vescale.engine.dbuffer.DBuffer` owns this rank's piece of its group's master weights (``local``)
and of their gradients (``local_grad``); the sharded parameters and their ``.grad`` are RaggedTensors aliasing
them. With ``MemoryPolicy(params=...)`` a weights piece lives on the tier between uses: its storage is released
(resized to 0, so every alias keeps its identity and becomes valid again when the storage is re-allocated in
place), read back just before the group's AllGather and released as soon as the AllGather completed (the
tier's copy is still current: nothing changes the weights between optimizer steps), read back for the
optimizer step of its bucket and written back after it. The order in which buffers are gathered repeats every
training step, so it is recorded once and each gather reads the piece of the next gather ahead on a background
thread (one group ahead of the AllGather prefetch, itself one group ahead of compute).

With ``MemoryPolicy(grads=...)`` a gradient piece is written to the tier as soon as its ReduceScatter finished
and released, so gradients do not pile up through backward; the optimizer step reads it back with its bucket,
:func:`~lightning_vescale.clip_grad_norm_` bucket by bucket, and gradient accumulation before adding to it.
``zero_grad()`` (``set_to_none=True``) drops it. Code that reads ``p.grad`` or ``p.to_local()`` of an
offloaded piece directly must bring it in first (:func:`resident_pieces`).

Training is bitwise the same as without offload: the bytes are moved, never recomputed. The tier's files are
scratch: checkpoints read the pieces through :func:`resident_pieces`, never the files, so a killed process
leaves nothing a resume could read half-written.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, cast

import torch
import torch.nn as nn

from lightning_vescale.engine.clip_grad import GRADIENT_TIERS
from lightning_vescale.engine.dbuffer import DBuffer
from lightning_vescale.memory.disk import DiskStore
from lightning_vescale.memory.ledger import memory_stats
from lightning_vescale.memory.policy import MemoryPolicy

logger = logging.getLogger(__name__)

__all__ = ["PieceOffload", "offload_pieces", "resident_pieces"]


class _TierIO:
    """Writes and reads whole flat tensors on one tier. ``releases`` is False where the tier is the device's own
    memory (the host tier on a CPU-only machine): nothing moves there."""

    def __init__(self, tier: str, store: Optional[DiskStore]) -> None:
        self.tier = tier
        self.store = store
        self._host: dict[str, torch.Tensor] = {}

    def releases(self, t: torch.Tensor) -> bool:
        return self.tier == "disk" or (self.tier == "host" and t.device.type != "cpu")

    def write(self, key: str, t: torch.Tensor) -> None:
        if self.store is not None:
            self.store.write(key, t)
            return
        host = self._host.get(key)
        if host is None or host.shape != t.shape or host.dtype != t.dtype:
            host = self._host[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
        host.copy_(t)

    def read_into(self, key: str, t: torch.Tensor) -> None:
        if self.store is not None:
            self.store.read_into(key, t)
        else:
            t.copy_(self._host[key])

    def drop(self, key: str) -> None:
        if self.store is not None:
            self.store.sizes.pop(key, None)
        self._host.pop(key, None)


class _Piece:
    """One flat tensor (a buffer's weights or gradient piece) that may live on the tier instead of in memory."""

    def __init__(self, io: _TierIO, key: str, kind: str, lock: threading.Lock) -> None:
        self.io, self.key, self.kind, self._lock = io, key, kind, lock
        self.tensor: Optional[torch.Tensor] = None
        self.released = False  # the storage is freed; the tier's copy holds the values
        self.current = False  # the tier's copy equals the tensor's values
        self.future: Optional[Future] = None

    @property
    def nbytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel() * self.tensor.element_size()

    def _move(self, to_tier: bool) -> None:
        n = self.nbytes if to_tier else -self.nbytes
        memory_stats.add(self.kind, self.io.tier, n)
        memory_stats.add(self.kind, "device", -n)

    def adopt(self, tensor: torch.Tensor) -> None:
        """Track ``tensor`` (new storage: counted on the device, the tier's copy is stale)."""
        if tensor is self.tensor:
            return
        self.forget()
        self.tensor, self.current, self.released = tensor, False, False
        memory_stats.add(self.kind, "device", self.nbytes)

    def release(self) -> None:
        """Put the values on the tier (written unless its copy is current) and free the storage."""
        if self.tensor is None or self.released or not self.io.releases(self.tensor) or self.nbytes == 0:
            return
        self.wait()
        if not self.current:
            self.io.write(self.key, self.tensor)  # raises (nothing released) when the tier cannot take it
            self.current = True
        self.tensor.untyped_storage().resize_(0)
        self.released = True
        self._move(True)

    def start_read(self, executor: Optional[ThreadPoolExecutor]) -> None:
        """Allocate the storage and read the values on ``executor`` (in place now without one)."""
        if not self.released or self.future is not None:
            return
        assert self.tensor is not None  # released: it was adopted
        self.tensor.untyped_storage().resize_(self.nbytes)
        if executor is None:
            self.io.read_into(self.key, self.tensor)
            self._arrived()
        else:
            self.future = executor.submit(self.io.read_into, self.key, self.tensor)

    def _arrived(self) -> None:
        self.released = False
        self._move(False)

    def wait(self) -> None:
        if self.future is not None:
            future, self.future = self.future, None
            future.result()
            self._arrived()

    def fetch(self) -> None:
        """The values in memory (waiting for a read ahead, or reading now)."""
        if self.future is None and self.released:
            self.start_read(None)
        self.wait()

    def forget(self) -> None:
        """The tensor is gone (the gradient was set to None): drop the tier's copy and the ledger's bytes."""
        if self.tensor is None:
            return
        self.wait()
        memory_stats.add(self.kind, self.io.tier if self.released else "device", -self.nbytes)
        self.io.drop(self.key)
        self.tensor, self.released, self.current = None, False, False


class BufferOffload:
    """The tier moves of one DBuffer's pieces, called from the buffer's hooks (``DBuffer.offload``)."""

    def __init__(self, owner: PieceOffload, index: int, buf: DBuffer, params_io: Optional[_TierIO],
                 grads_io: Optional[_TierIO]) -> None:
        self.owner, self.index, self.buf = owner, index, buf
        self.params = _Piece(params_io, f"b{index}_params", "params", owner.lock) if params_io else None
        self.grads = _Piece(grads_io, f"b{index}_grads", "grads", owner.lock) if grads_io else None
        self._stepping = False

    # -- weights: around the AllGather -----------------------------------------------------------------------
    @property
    def sends_copy(self) -> bool:
        """The AllGather sends a copy of the weights piece (written into its slot of the gathered buffer), so that
        the piece goes back to its tier before the AllGather completes: with the next group's piece read ahead,
        one piece is in memory at a time, not two."""
        piece = self.params
        return piece is not None and piece.tensor is not None and piece.io.releases(piece.tensor)

    def before_gather(self) -> None:
        if self.params is not None:
            self.params.fetch()
        self.owner.gathered(self)

    def after_gather(self) -> None:
        if self.params is not None and not self._stepping:
            self.params.release()

    # -- gradients: after the ReduceScatter -----------------------------------------------------------------
    def after_reduce(self) -> None:
        if self.grads is not None and self.buf.local_grad is not None:
            self.grads.adopt(self.buf.local_grad)
            self.grads.current = False  # new values (or accumulated into the old ones)
            self.grads.release()

    def fetch_grad(self) -> None:
        if self.grads is not None and self.grads.tensor is not None:
            self.grads.fetch()

    def grad_dropped(self) -> None:
        if self.grads is not None:
            self.grads.forget()

    # -- around an optimizer step or a checkpoint ---------------------------------------------------------
    def start_reads(self, executor: Optional[ThreadPoolExecutor]) -> None:
        for piece in (self.params, self.grads):
            if piece is not None:
                piece.start_read(executor)

    def _pieces(self, weights: bool) -> tuple[Optional[_Piece], ...]:
        return (self.params, self.grads) if weights else (self.grads,)

    def bring_in(self, *, weights: bool = True) -> None:
        """The gradient piece, and the weights piece unless ``weights=False``, in memory until :meth:`put_back`."""
        self._stepping = True
        for piece in self._pieces(weights):
            if piece is not None:
                piece.fetch()

    def put_back(self, *, params_changed: bool, grads_changed: bool = False, weights: bool = True) -> None:
        self._stepping = False
        for piece in self._pieces(weights):
            if piece is not None:
                if params_changed if piece is self.params else grads_changed:
                    piece.current = False
                piece.release()


class PieceOffload:
    """Keeps the weights and/or gradient pieces of every DBuffer of a sharded model on a tier between uses (see
    [Note: offloading the pieces]). Made by :func:`offload_pieces`; ``close()`` brings everything back.

    ``tiers``: ``id(buffer) -> (weights tier, gradients tier)`` for the buffers to move (a plan's per-parameter
    tiers, see :func:`~lightning_vescale.memory.apply.tier_placement`); the others stay in memory. Default: every
    buffer on ``policy.params`` / ``policy.grads``."""

    def __init__(self, model: nn.Module, policy: MemoryPolicy,
                 tiers: Optional[Mapping[int, tuple[str, str]]] = None) -> None:
        from lightning_vescale.engine.fully_shard import sharded_groups

        chosen = []  # (group, buffer, weights tier, gradients tier)
        for group in sharded_groups(model):
            for buf in group.buffers.values():
                # Quantized buffers keep their own storage layout: they stay where they are.
                if type(buf) is not DBuffer or not buf.dtype.is_floating_point:
                    continue
                pt, gt = (policy.params, policy.grads) if tiers is None else tiers.get(id(buf), ("device", "device"))
                if (pt, gt) != ("device", "device"):
                    chosen.append((group, buf, pt, gt))
        if not chosen:
            raise ValueError("offload_pieces needs MemoryPolicy(params=...) or (grads=...) on 'host' or 'disk'")
        self.policy = policy
        used = {t for _, _, pt, gt in chosen for t in (pt, gt)} - {"device"}
        self.store: Optional[DiskStore] = None
        if "disk" in used:
            assert policy.disk_dir  # MemoryPolicy checks a disk tier has one
            self.store = DiskStore(policy.disk_dir, tag="_pieces")
        ios = {t: _TierIO(t, self.store if t == "disk" else None) for t in used}
        # Some buffer's weights / gradients move (None: no buffer's do).
        self.params_io = next((ios[pt] for _, _, pt, _ in chosen if pt != "device"), None)
        self.grads_io = next((ios[gt] for _, _, _, gt in chosen if gt != "device"), None)
        self.lock = threading.Lock()
        self.reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lv-pieces") if policy.prefetch else None
        self.buffers: list[BufferOffload] = []
        self._by_param: dict[int, BufferOffload] = {}
        for group, buf, pt, gt in chosen:
            if buf.offload is not None:
                raise ValueError("this model's pieces are already offloaded (offload_pieces was called twice)")
            offload = BufferOffload(self, len(self.buffers), buf, ios.get(pt), ios.get(gt))
            buf.offload = offload
            self.buffers.append(offload)
            for mp in group.managed:
                if group.buffers[mp.key] is buf:
                    self._by_param[id(mp.sharded)] = offload
        for offload in self.buffers:
            if offload.params is not None:
                offload.params.adopt(offload.buf.local)
                offload.params.release()
        if self.grads_io is not None:
            _GRAD_OFFLOADS.add(self)
        # The sequence of gathers of one training step (recorded during the first), and where we are in it.
        self._sequence: list[BufferOffload] = []
        self._recording = True
        self._position = -1

    # -- read-ahead of the next gather ------------------------------------------------------------------------
    def gathered(self, offload: BufferOffload) -> None:
        """``offload``'s buffer is being gathered: read the piece of the one gathered after it last step."""
        if self._recording:
            self._sequence.append(offload)
            return
        seq = self._sequence
        pos: Optional[int]
        pos = self._position
        if not (0 <= pos + 1 < len(seq) and seq[pos + 1] is offload):
            later = [i for i in range(len(seq)) if seq[i] is offload]  # out of step (evaluation): find it again
            after = [i for i in later if i > pos]
            pos = next(iter(after or later), None)
        else:
            pos += 1
        self._position = -1 if pos is None else pos
        if pos is not None and pos + 1 < len(seq) and self.reader is not None:
            params = seq[pos + 1].params
            if params is not None:
                params.start_read(self.reader)

    def step_done(self) -> None:
        """An optimizer step ended: the gather sequence starts again (and is recorded once)."""
        self._recording = False
        self._position = -1

    # -- lookups -------------------------------------------------------------------------------------------------
    def buffers_of(self, params: Iterable[torch.Tensor]) -> list[BufferOffload]:
        """The buffers holding ``params``' pieces, in first-use order."""
        out: dict[int, BufferOffload] = {}
        for p in params:
            offload = self._by_param.get(id(p))
            if offload is not None:
                out.setdefault(id(offload), offload)
        return list(out.values())

    def buffer_of(self, p: torch.Tensor) -> Optional[BufferOffload]:
        """The buffer holding ``p``'s piece (``None`` for a parameter this offload does not manage)."""
        return self._by_param.get(id(p))

    def owns(self, p: torch.Tensor) -> bool:
        return id(p) in self._by_param

    # -- everything in memory -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def resident(self, buffers: Optional[list[BufferOffload]] = None, *, changes: bool = True,
                 weights: bool = True) -> Iterator[None]:
        """Every piece of ``buffers`` (default: all; only the gradients when ``weights=False``) in memory inside the
        block; written back after it when ``changes`` (a checkpoint load, a clip), else released as it was."""
        buffers = self.buffers if buffers is None else buffers
        for offload in buffers:
            offload.bring_in(weights=weights)
        try:
            yield
        finally:
            for offload in buffers:
                offload.put_back(params_changed=changes, grads_changed=changes, weights=weights)

    def each_resident(self, params: list[torch.Tensor], fn: Callable[[list[torch.Tensor]], Any]) -> list[Any]:
        """``fn`` on each chunk of ``params`` while its buffers' gradient pieces are in memory (one at a time)."""
        out = []
        for chunk, buffers in self._chunks(params):
            with self.resident(buffers, changes=False, weights=False):
                out.append(fn(chunk))
        return out

    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float, norm_type: float,
                        error_if_nonfinite: bool) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(foreach=True)`` with the gradients brought in one buffer at a time:
        the per-tensor norms are the same ops on the same bytes, so the result is bitwise the same."""
        with_grads = [p for p in params if p.grad is not None]
        if not with_grads:
            return torch.tensor(0.0)
        chunks = self._chunks(with_grads)
        norms: list[torch.Tensor] = []
        for chunk, buffers in chunks:
            with self.resident(buffers, changes=False, weights=False):
                grads = cast(list[torch.Tensor], [p.grad for p in chunk])  # the chunks of parameters with grads
                norms.extend(torch._foreach_norm(grads, norm_type))
        total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                               f"so it cannot be clipped. To disable this error and scale the gradients by the "
                               f"non-finite norm anyway, set `error_if_nonfinite=False`")
        for chunk, buffers in chunks:
            with self.resident(buffers, changes=True, weights=False):
                torch.nn.utils.clip_grads_with_norm_(chunk, max_norm, total, foreach=True)
        return total

    def _chunks(self, params: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], list[BufferOffload]]]:
        """``params`` cut where the buffer changes (the same cuts on every rank: buffers are global)."""
        chunks: list[tuple[list[torch.Tensor], list[BufferOffload]]] = []
        last = object()
        for p in params:
            offload = self._by_param.get(id(p))
            if not chunks or offload is not last:
                chunks.append(([], [offload] if offload is not None else []))
                last = offload
            chunks[-1][0].append(p)
        return chunks

    def close(self) -> None:
        """Bring every piece back into memory and stop offloading."""
        for offload in self.buffers:
            for piece in (offload.params, offload.grads):
                if piece is not None:
                    piece.fetch()
                    piece.forget()
            offload.buf.offload = None
        self.buffers.clear()
        self._by_param.clear()
        _GRAD_OFFLOADS.discard(self)
        if self.reader is not None:
            self.reader.shutdown()
        if self.store is not None:
            self.store.close()


def offload_pieces(model: nn.Module, policy: MemoryPolicy, *,
                   tiers: Optional[Mapping[int, tuple[str, str]]] = None) -> PieceOffload:
    """Keep the sharded master weights (``policy.params``) and gradient pieces (``policy.grads``) of ``model``
    (sharded by ``fully_shard``, weights initialized) on their tiers between uses; ``tiers``: per buffer instead
    (see :class:`PieceOffload`). The optimizer step must bring them in bucket by bucket:
    :func:`~lightning_vescale.memory.offload_optimizer_states` with ``pieces=`` does
    (:func:`~lightning_vescale.memory.apply_memory_policy` wires both)."""
    return PieceOffload(model, policy, tiers)


_GRAD_OFFLOADS = GRADIENT_TIERS  # the engine's clip_grad_norm_ asks the offloads that hold gradient pieces


def offload_of_grads(params: list[torch.Tensor]) -> Optional[PieceOffload]:
    """The :class:`PieceOffload` keeping some of ``params``' gradients on a tier (``None`` when none does)."""
    for offload in list(_GRAD_OFFLOADS):
        if any(offload.owns(p) for p in params):
            return offload
    return None


def _offloads_of(model: nn.Module) -> list[BufferOffload]:
    from lightning_vescale.engine.fully_shard import sharded_groups

    return [offload for group in sharded_groups(model) for buf in group.buffers.values()
            if isinstance(offload := getattr(buf, "offload", None), BufferOffload)]


@contextlib.contextmanager
def resident_pieces(model: Optional[nn.Module], *, changes: bool = True) -> Iterator[None]:
    """Inside the block every offloaded weights and gradient piece of ``model`` is in memory (to save, load or
    export a checkpoint); put back on its tier after it, written again when ``changes`` (a load). A no-op when
    nothing is offloaded."""
    buffers = _offloads_of(model) if model is not None else []
    if not buffers:
        yield
        return
    with buffers[0].owner.resident(buffers, changes=changes):
        yield

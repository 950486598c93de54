"""Activations saved for backward on the host or disk tier, and selective activation checkpointing, per block.

[Note: activation offload]
Between a block's forward and its backward, autograd keeps the tensors the block's operations saved. With
:func:`offload_activations`, every such tensor of the chosen blocks at least ``min_bytes`` large is moved by
``torch.autograd.graph.saved_tensors_hooks`` (pack on save, unpack on use) to the ``host`` tier (pinned memory,
copied on a side stream on CUDA; on a CPU-only machine host memory is the device's, so nothing moves) or to
the ``disk`` tier (one file per tensor, deleted as soon as backward has read it, or when autograd drops the
graph without a backward; the ledger counts what is on disk). Parameters are never
offloaded: the engine gathers them again for backward. A DTensor that tensor parallelism saves (the inputs of a
``ColwiseParallel`` / ``RowwiseParallel`` module) moves as its local tensor and is rebuilt on the same mesh with
the same placements when backward reads it. When backward unpacks the first tensor of a block, the
rest of that block's tensors are read on a background thread (prefetch).

Activation checkpointing (:func:`checkpoint_blocks`) keeps only a block's inputs and recomputes its forward in
backward; with ``fully_shard`` the recomputation reuses the gather of pre-backward.
"""

from __future__ import annotations

import fnmatch
import itertools
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from lightning_vescale.memory.disk import DiskStore, DiskTierError
from lightning_vescale.memory.ledger import memory_stats

__all__ = ["ActivationOffload", "checkpoint_blocks", "offload_activations"]

_COUNTER = itertools.count()


class _Handle:
    __slots__ = ("key", "shape", "dtype", "device", "nbytes", "future", "value", "release", "__weakref__")

    def __init__(self, key: str, t: torch.Tensor) -> None:
        self.key, self.shape, self.dtype, self.device = key, t.shape, t.dtype, t.device
        self.nbytes = t.numel() * t.element_size()
        self.future: Optional[Future] = None
        self.value: Optional[torch.Tensor] = None
        self.release: Optional[weakref.finalize] = None
        """Disk tier: deletes the file and takes it off the ledger, once (after backward read it, or when autograd
        drops the handle unread)."""


class _DTensorPacked:
    """A DTensor saved for backward: its local tensor, packed, and how to rebuild it around the unpacked one."""

    __slots__ = ("inner", "mesh", "placements", "shape", "stride")

    def __init__(self, inner: Any, t: DTensor) -> None:
        self.inner, self.mesh, self.placements, self.shape, self.stride = (
            inner, t.device_mesh, t.placements, t.shape, t.stride())

    def rebuild(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape,
                                  stride=self.stride)


def _drop_file(store: DiskStore, key: str, tier: str, nbytes: int) -> None:
    store.delete(key)
    memory_stats.add("activations", tier, -nbytes)


class ActivationOffload:
    """The pack/unpack hooks of [Note: activation offload] for one model; see :func:`offload_activations`."""

    def __init__(self, tier: str, *, disk_dir: Optional[str] = None, min_bytes: int = 2**16, prefetch: bool = True):
        if tier not in ("host", "disk"):
            raise ValueError(f"activations can be offloaded to 'host' or 'disk', got {tier!r}")
        if tier == "disk" and not disk_dir:
            raise ValueError("offloading activations to 'disk' needs disk_dir=<a directory on a local disk>")
        self.tier = tier
        self.min_bytes = min_bytes
        self.store: Optional[DiskStore] = None
        if tier == "disk":
            assert disk_dir  # checked above
            self.store = DiskStore(disk_dir, tag="_act")
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lv-act") if prefetch else None
        self._blocks: dict[int, list[weakref.ref]] = {}  # weak: a graph autograd drops frees its handles
        self._lock = threading.Lock()
        self.handles: list[Any] = []

    # -- the hooks ----------------------------------------------------------------------------------------------
    def pack(self, block: int):
        def hook(t: torch.Tensor) -> Any:
            nbytes = t.numel() * t.element_size()
            if isinstance(t, nn.Parameter) or t.requires_grad and t.is_leaf:
                return t
            if type(t) is DTensor:  # tensor parallelism's: its storage is the local tensor's
                return _DTensorPacked(hook(t._local_tensor.detach()), t)
            if nbytes < self.min_bytes or self.tier == "host" and t.device.type == "cpu":
                # Kept as it is (too small to move; host memory is the device's), as an alias without grad_fn:
                # the node's own output returned whole would hold the graph in a cycle that outlives a dropped
                # graph (autograd restores the grad_fn on unpack).
                return t.detach()
            handle = _Handle(f"a{next(_COUNTER)}", t)
            if self.store is not None:
                self.store.write(handle.key, t)
                handle.release = weakref.finalize(handle, _drop_file, self.store, handle.key, self.tier, nbytes)
            else:
                handle.value = t.to("cpu", non_blocking=True)
            memory_stats.add("activations", self.tier, nbytes)
            with self._lock:
                refs = self._blocks.setdefault(block, [])
                refs[:] = [r for r in refs if r() is not None]  # handles of graphs autograd dropped unread
                refs.append(weakref.ref(handle))
            return handle

        return hook

    def _load(self, handle: _Handle) -> torch.Tensor:
        if handle.value is not None:
            return handle.value.to(handle.device, non_blocking=True) if handle.device.type != "cpu" else handle.value
        out = torch.empty(handle.shape, dtype=handle.dtype, device=handle.device)
        assert self.store is not None  # values not kept in memory are on disk
        self.store.read_into(handle.key, out)
        return out

    def unpack(self, block: int):
        def hook(packed: Any) -> torch.Tensor:
            if isinstance(packed, _DTensorPacked):
                return packed.rebuild(hook(packed.inner))
            if not isinstance(packed, _Handle):
                return packed
            if packed.release is not None and not packed.release.alive:
                raise DiskTierError(
                    f"activation {packed.key} was read by a backward already and deleted from the disk tier: a second "
                    f"backward through the same graph (retain_graph=True) needs activations on the device or host "
                    f"(MemoryPolicy(activations='host' or 'checkpoint'))"
                )
            if self._reader is not None and packed.future is None:
                with self._lock:  # first use in this block: read the block's other tensors ahead
                    live = [h for h in (r() for r in self._blocks.get(block, [])) if h is not None]
                    for h in live:
                        if h.future is None and h is not packed:
                            h.future = self._reader.submit(self._load, h)
            t = packed.future.result() if packed.future is not None else self._load(packed)
            packed.future = None
            with self._lock:
                refs = self._blocks.get(block, [])
                refs[:] = [r for r in refs if r() is not None and r() is not packed]
            if packed.release is not None:
                packed.release()  # read: the file goes now, not when autograd frees the graph
            else:
                memory_stats.add("activations", self.tier, -packed.nbytes)
            return t

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        if self._reader is not None:
            self._reader.shutdown()
        for refs in self._blocks.values():  # handles of graphs still alive: their files go with the store
            for h in (r() for r in refs):
                if h is not None and h.release is not None:
                    h.release()
        self._blocks.clear()
        if self.store is not None:
            self.store.close()


def _matching(model: nn.Module, patterns: Sequence[str], what: str) -> list[tuple[str, nn.Module]]:
    """The outermost modules whose names match one of ``patterns`` (a match inside a match is left out)."""
    hits = [(n, m) for n, m in model.named_modules() if n and any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n, _ in hits)]
    named = [(n, m) for n, m in hits if not any(n.startswith(o + ".") for o, _ in hits)]
    if unmatched:
        raise ValueError(f"{what}: the pattern(s) {unmatched} match no module of {type(model).__name__}")
    return named


def offload_activations(model: nn.Module, blocks: Sequence[str], tier: str, *, disk_dir: Optional[str] = None,
                        min_bytes: int = 2**16, prefetch: bool = True) -> ActivationOffload:
    """Offload the activations that the modules named by the glob patterns ``blocks`` save for backward to
    ``tier`` (see [Note: activation offload]). Returns the offload; ``close()`` removes the hooks."""
    offload = ActivationOffload(tier, disk_dir=disk_dir, min_bytes=min_bytes, prefetch=prefetch)
    for i, (_, module) in enumerate(_matching(model, blocks, "offload_activations")):
        context: list = []

        def enter(mod, args, i=i, context=context):
            if torch.is_grad_enabled():
                ctx = torch.autograd.graph.saved_tensors_hooks(offload.pack(i), offload.unpack(i))
                ctx.__enter__()
                context.append(ctx)

        def leave(mod, args, output, context=context):
            if context:
                context.pop().__exit__(None, None, None)
            return output

        offload.handles.append(module.register_forward_pre_hook(enter))
        offload.handles.append(module.register_forward_hook(leave, always_call=True))
    return offload


def checkpoint_blocks(model: nn.Module, blocks: Sequence[str]) -> list[str]:
    """Recompute the forward of every module named by the glob patterns ``blocks`` in backward instead of keeping
    its activations (non-reentrant ``torch.utils.checkpoint``). Returns the names of the wrapped modules."""
    names = []
    for name, module in _matching(model, blocks, "checkpoint_blocks"):
        forward = module.forward

        def recomputed(*args, _forward=forward, **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        module.forward = recomputed
        names.append(name)
    return names

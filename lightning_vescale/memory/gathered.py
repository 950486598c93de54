"""Gathered (unsharded) parameters on the disk tier between a group's forward and its backward.

[Note: gathered parameters on disk]
A group that reshards after forward gathers its parameters twice per step: once for forward, and again for
backward, because autograd needs them to compute the input gradients. With ``MemoryPolicy(gathered_params=
"disk")`` the post-forward reshard hands the gathered buffer to :class:`GatheredOffload` instead of freeing it:
a background thread writes its bytes to a file under the disk tier and then releases the storage; the group's
unshard in backward (its own, a prefetch of it, or an activation-checkpoint recompute) reads the file back into
the same storage instead of running the AllGather. Memory is what resharding gives (the buffer is resident only
until written), and the backward AllGathers of those groups leave the network: each rank reads its own copy.
That trades link bandwidth for disk bandwidth (ZeRO-Infinity keeps parameters on NVMe for the same reason), and
pays where the link is the slower of the two (across nodes, or gloo on CPU).

The saved copy is valid only for the backward of the forward that wrote it: an unshard outside backward (the
next forward, evaluation) drops it and gathers, and the post-backward reshard drops it. Anything that finds no
valid copy gathers as before, so the tier only ever replaces a gather with a read of the same bytes (training
is bitwise the same). A write that fails (a full disk) keeps the buffer in memory and backward uses it from there.

Files go through the page cache (the views of the unsharded buffer fix its storage's address, so it cannot be
re-aligned for ``O_DIRECT``); the operating system counts that cache outside the process and reclaims it. Only
plain floating-point DBuffers take part: quantized gathers (codes and scales) are gathered again.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

from lightning_vescale.memory.disk import DiskStore, DiskTierError
from lightning_vescale.memory.ledger import memory_stats

logger = logging.getLogger(__name__)

__all__ = ["GatheredOffload"]


class _ReadHandle:
    """A collective-like handle (``wait()``) for a read issued on the background thread."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def wait(self) -> None:
        self._future.result()

    def is_completed(self) -> bool:
        return self._future.done()


class _Saved:
    """One buffer's copy on disk: the write in flight (or done), and whether it failed (the bytes stayed)."""

    def __init__(self, future: Future, nbytes: int) -> None:
        self.future = future
        self.nbytes = nbytes
        self.kept_in_memory = False


class GatheredOffload:
    """Writes resharded groups' gathered buffers to disk after forward and reads them back for backward (see
    [Note: gathered parameters on disk]). Installed on DBuffers by
    :func:`~lightning_vescale.memory.apply_memory_policy`; ``close()`` waits for the I/O and removes the files."""

    def __init__(self, store: DiskStore) -> None:
        self.store = store
        self._io = ThreadPoolExecutor(1, thread_name_prefix="lv-gathered-io")
        self._saved: dict[int, _Saved] = {}
        self.bytes_written = 0
        self.bytes_read = 0
        self._warned = False

    @staticmethod
    def _key(buf: torch.Tensor) -> str:
        return f"gathered{id(buf)}"

    def save(self, buf) -> None:
        """Take ``buf``'s gathered storage: write it to disk, then release it (on the background thread)."""
        self.drop(buf)
        t = buf.unsharded
        nbytes = t.numel() * t.element_size()
        saved = _Saved(None, nbytes)  # type: ignore[arg-type]
        saved.future = self._io.submit(self._write_then_release, self._key(buf), t, saved)
        self._saved[id(buf)] = saved

    def _write_then_release(self, key: str, t: torch.Tensor, saved: _Saved) -> None:
        try:
            self.store.write(key, t)
        except DiskTierError as e:
            saved.kept_in_memory = True  # backward uses the bytes where they are
            if not self._warned:
                self._warned = True
                logger.warning("lightning_vescale: gathered parameters stay in memory: %s", e)
            return
        t.untyped_storage().resize_(0)
        memory_stats.add("gathered_params", "disk", saved.nbytes)
        self.bytes_written += saved.nbytes

    def has(self, buf) -> bool:
        """Whether a copy of ``buf``'s gathered parameters from this step's forward is waiting for backward."""
        return id(buf) in self._saved

    def load(self, buf, async_op: bool) -> Optional[_ReadHandle]:
        """Bring ``buf``'s gathered parameters back into its unsharded storage (allocated here) in place of an
        AllGather; returns a handle to wait on when ``async_op`` (the read runs on the background thread)."""
        saved = self._saved.pop(id(buf))
        saved.future.result()  # the write has finished (and released the storage, unless it failed)
        if saved.kept_in_memory:
            return None
        memory_stats.add("gathered_params", "disk", -saved.nbytes)
        t = buf.unsharded
        storage = t.untyped_storage()
        storage.resize_(saved.nbytes)
        key = self._key(buf)

        def read() -> None:
            # The same values the forward used come back: keep the version autograd saved.
            with torch.autograd._unsafe_preserve_version_counter(t):
                self.store.read_into(key, t)
            self.bytes_read += saved.nbytes

        future = self._io.submit(read)
        handle = _ReadHandle(future)
        if not async_op:
            handle.wait()
            return None
        return handle

    def drop(self, buf) -> None:
        """Forget ``buf``'s copy (its backward is done, or it was never needed); its storage stays released."""
        saved = self._saved.pop(id(buf), None)
        if saved is None:
            return
        saved.future.result()
        if saved.kept_in_memory:
            buf.unsharded.untyped_storage().resize_(0)
        else:
            memory_stats.add("gathered_params", "disk", -saved.nbytes)

    def close(self) -> None:
        for saved in list(self._saved.values()):
            saved.future.result()
        self._saved.clear()
        self._io.shutdown(wait=True)
        self.store.close()

"""The disk tier: one file per tensor under a directory, written and read whole in large chunks.

Reads and writes go through ``pwrite`` / ``preadv`` straight between the tensor's memory and the file, so the
only memory a tensor on disk costs is the file's page cache, which the operating system reclaims (and does not
count in the process's resident set). Tensors on an accelerator are staged through one host buffer.

A store made with ``direct=True`` keeps large tensors out of the page cache too, as an NVMe swapper must (the
point of the tier is that the bytes leave memory, and a cache the size of the states would only hide the
device's speed): a tensor of at least :data:`DIRECT_MIN_BYTES` whose memory starts on an :data:`ALIGN` boundary
with room up to the next one (:func:`alloc_aligned`, :func:`realign`) moves with ``O_DIRECT``, straight between
its memory and the device, costing almost no CPU, so a background thread overlaps it with compute. Smaller
tensors (a few pages: a device round trip each would cost more than their cache) and file systems without
``O_DIRECT`` (tmpfs) go through the page cache.

Every tensor written carries a checksum of its bytes, kept in memory, and a read checks it before the tensor
is used: a file changed on disk (another process, a bad disk, random bytes written over it) is a
:class:`DiskTierError` naming the file, never silently wrong values in training. The checksum is a
position-weighted sum of the 64-bit words, block by block (:func:`fingerprint`; about 7 GB/s on one core here,
where ``zlib.crc32`` does 1.3-1.9 GB/s), computed by the thread that moves the bytes.

[Note: who owns a tier folder]
Each store's folder ``lightning_vescale_swap_<pid><tag>_<random>`` holds ``.owner.lock``, exclusively ``flock``-ed by the
process that uses it until it ends (the kernel drops the lock of a killed process). A new store removes the
folders whose lock is free: scratch of killed runs, which would otherwise fill the disk run after run. It never
removes a folder whose lock is held, whatever its name says: the pid in it may belong to another container's
namespace, where a live job uses it. A folder without the lock file (an older release's) is left alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import os
import shutil
import sys
import uuid
import zlib
from typing import Optional, Sequence

import torch

__all__ = ["ALIGN", "DIRECT_MIN_BYTES", "DiskStore", "DiskTierError", "alloc_aligned", "alloc_together",
           "check_disk_space", "fingerprint", "realign"]

CHUNK_BYTES = 16 * 2**20  # large sequential I/O, as ZeRO-Infinity's swapper does
ALIGN = 4096  # O_DIRECT: memory address, file offset and length on (at least) logical-block boundaries
DIRECT_MIN_BYTES = 2**20  # smaller tensors go through the page cache
_O_DIRECT = getattr(os, "O_DIRECT", 0)
HUGE_PAGE = 2 * 2**20  # a transparent huge page (x86-64, aarch64 with 4 KiB pages)
_MADV_HUGEPAGE = 14


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def alloc_aligned(t: torch.Tensor, nbytes: int) -> None:
    """(Re)allocate the released storage of contiguous CPU tensor ``t`` (``nbytes`` of data) so that its data
    starts on an :data:`ALIGN` boundary with room up to the next one: the storage grows by at most two pages
    and the tensor is re-pointed into it (same object, shape and values to be read)."""
    storage = t.untyped_storage()
    storage.resize_(_round_up(nbytes) + ALIGN)
    shift = (-storage.data_ptr()) % ALIGN  # the CPU allocator aligns to 64 bytes: a multiple of every dtype's size
    t.set_(storage, shift // t.element_size(), t.shape, t.stride())


def _advise_huge_pages(address: int, nbytes: int) -> None:
    """Ask Linux for transparent huge pages over ``[address, address + nbytes)`` (no-op elsewhere, or when the
    kernel says no): a 2 MiB page is one fault and one pin for ``O_DIRECT`` instead of 512."""
    libc = _libc()
    if libc is not None and nbytes >= HUGE_PAGE:
        libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE)


@functools.cache
def _libc() -> Optional[ctypes.CDLL]:
    """The C library, once (Linux only: ``madvise`` with transparent huge pages)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def alloc_together(tensors: Sequence[torch.Tensor]) -> None:
    """Give contiguous CPU tensors whose storage was released one new storage between them, each starting on an
    :data:`ALIGN` boundary with room up to the next (as :func:`alloc_aligned` gives one), the whole on huge-page
    boundaries with transparent huge pages asked for. One allocation for a bucket of optimizer states instead of
    one each, and reads into huge pages: page faults and ``O_DIRECT``'s page pinning were most of the CPU time
    and half the wall time of reading states (16 MiB: 4.9 vs 1.5 ms CPU, 15.7 vs 7.2 ms wall on this machine).
    The tensors then share that storage: releasing one (``resize_(0)``) releases them all, as a bucket moves."""
    spans = [_round_up(t.numel() * t.element_size()) for t in tensors]
    total = sum(spans)
    if total == 0:
        return
    align = HUGE_PAGE if total >= HUGE_PAGE else ALIGN
    storage = torch.UntypedStorage(total + align)
    offset = (-storage.data_ptr()) % align
    _advise_huge_pages(storage.data_ptr() + offset, total)
    for t, span in zip(tensors, spans):
        t.set_(storage, offset // t.element_size(), t.shape, t.stride())
        offset += span


def realign(t: torch.Tensor) -> None:
    """Move contiguous CPU tensor ``t``'s values into storage made by :func:`alloc_aligned` (a no-op if its memory
    is aligned already with room up to the next boundary): the optimizer creates states wherever the allocator
    puts them, and a page-aligned block without that room could not move with ``O_DIRECT`` either."""
    nbytes = t.numel() * t.element_size()
    storage = t.untyped_storage()
    if t.data_ptr() % ALIGN == 0 and storage.data_ptr() + storage.nbytes() - t.data_ptr() >= _round_up(nbytes):
        return
    values = t.clone()
    storage.resize_(0)
    alloc_aligned(t, nbytes)
    t.copy_(values)


class DiskTierError(RuntimeError):
    """The disk tier cannot hold or return a tensor (full, read-only or missing directory); nothing was lost."""


_PREFIX = "lightning_vescale_swap_"


_OWNER_LOCK = ".owner.lock"


def _remove_stale(directory: str) -> None:
    """Remove the swap folders of processes that ended without ``close`` (see [Note: who owns a tier folder])."""
    for name in os.listdir(directory):
        folder = os.path.join(directory, name)
        if not name.startswith(_PREFIX) or not os.path.isdir(folder):
            continue
        try:
            fd = os.open(os.path.join(folder, _OWNER_LOCK), os.O_RDWR)
        except OSError:
            continue  # no lock file: not ours to judge
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: a live process (perhaps in another pid namespace) uses it
        else:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)


def check_disk_space(directory: str, need: int, what: str) -> None:
    """Refuse (before anything moves) a disk tier without room for ``need`` bytes (``what`` says whose)."""
    free = shutil.disk_usage(directory).free
    if free < need:
        raise DiskTierError(
            f"the disk tier at {directory} has {free / 2**20:.1f} MiB free, but {what} need about "
            f"{need / 2**20:.1f} MiB on this rank: free space, choose another disk_dir, or keep some of them on the "
            f"device (nothing was moved)"
        )


_BLOCK_WORDS = 8192  # 64 KiB: a block's words are summed, the block sums weighted by position


def fingerprint(t: torch.Tensor) -> int:
    """A checksum of contiguous CPU tensor ``t``'s bytes: the sum of each 64 KiB block's 64-bit words (wrapping),
    weighted by the block's position, with the tail and the length. Any change of bytes within a block, and any
    move of data between blocks, changes it (but for a 2^-64 chance); it runs at memory speed, which
    ``zlib.crc32`` does not. A tensor whose bytes do not start on an 8-byte boundary falls back to CRC-32."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return 0
    raw = t.detach().reshape(-1).view(torch.uint8)
    words = nbytes // 8
    try:
        w = raw[: words * 8].view(torch.int64)
    except RuntimeError:
        return zlib.crc32(_bytes_of(t, nbytes))
    blocks = words // _BLOCK_WORDS
    total = 0
    if blocks:
        sums = w[: blocks * _BLOCK_WORDS].view(blocks, _BLOCK_WORDS).sum(1)
        total = int((sums * torch.arange(1, blocks + 1, dtype=torch.int64)).sum())
    tail = int(w[blocks * _BLOCK_WORDS :].sum()) if words > blocks * _BLOCK_WORDS else 0
    rest = bytes(raw[words * 8 :].tolist())
    return hash((total, tail, rest, nbytes))


def _bytes_of(t: torch.Tensor, nbytes: Optional[int] = None) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes, or of ``nbytes`` from its start (through its address:
    ``Tensor.numpy()`` would make the storage non-resizable, and the swapper releases storage by resizing it)."""
    nbytes = t.numel() * t.element_size() if nbytes is None else nbytes
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def _direct_span(t: torch.Tensor) -> int:
    """The byte count to move ``t`` with ``O_DIRECT`` (its size rounded up to :data:`ALIGN`), or 0 when it is
    small, its memory not aligned, or its storage ends before that."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or t.data_ptr() % ALIGN or nbytes < DIRECT_MIN_BYTES:
        return 0
    storage = t.untyped_storage()
    span = _round_up(nbytes)
    return span if storage.data_ptr() + storage.nbytes() - t.data_ptr() >= span else 0


def _supports_direct(directory: str) -> bool:
    probe = os.path.join(directory, ".direct_probe")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | _O_DIRECT, 0o600))
        return bool(_O_DIRECT)
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)


class DiskStore:
    """Tensors kept as files under ``directory`` (a private subdirectory, removed by :meth:`close`).

    ``direct``: keep large tensors out of the page cache (see the module's docstring); ``self.direct`` says
    whether the file system allows it.
    """

    def __init__(self, directory: str, *, tag: str = "", direct: bool = False) -> None:
        # A name of its own: the pid alone may repeat (two stores of a process, another pid namespace's process).
        self.root = os.path.join(directory, f"{_PREFIX}{os.getpid()}{tag}_{uuid.uuid4().hex[:8]}")
        try:
            os.makedirs(directory, exist_ok=True)
            os.mkdir(self.root)
            self._lock: Optional[int] = os.open(os.path.join(self.root, _OWNER_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise DiskTierError(f"cannot create the disk tier's directory {self.root} ({e})") from None
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours until close() or this process ends
        _remove_stale(directory)
        self.sizes: dict[str, int] = {}
        self.crcs: dict[str, int] = {}
        self.direct = direct and _supports_direct(self.root)

    def moves_direct(self, nbytes: int) -> bool:
        """Whether a tensor of ``nbytes`` moves with ``O_DIRECT`` here (given aligned memory)."""
        return self.direct and nbytes >= DIRECT_MIN_BYTES

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key.replace("/", "_") + ".bin")

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Write ``tensor``'s bytes under ``key`` (replacing what was there); the tensor is left as it is."""
        src = tensor.detach()
        if src.device.type != "cpu":
            src = src.to("cpu")
        src = src.contiguous()
        nbytes = src.numel() * src.element_size()
        span = _direct_span(src) if self.direct else 0
        data = _bytes_of(src, span or nbytes)  # O_DIRECT: the padding up to ALIGN is the storage's own slack
        fd = os.open(self._path(key), os.O_WRONLY | os.O_CREAT | (_O_DIRECT if span else 0), 0o600)
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done : done + CHUNK_BYTES], done)
            os.ftruncate(fd, len(data))
        except OSError as e:
            hint = "the disk is full" if e.errno == errno.ENOSPC else str(e)
            raise DiskTierError(
                f"cannot write {len(data)} bytes of {key} to the disk tier at {self.root}: {hint}. The tensor stays in "
                f"memory; free space, choose another disk_dir, or keep this state on the host tier."
            ) from None
        finally:
            os.close(fd)
        self.sizes[key] = nbytes
        self.crcs[key] = fingerprint(src)

    def delete(self, key: str) -> None:
        """Remove the file of ``key`` (a no-op if there is none)."""
        self.sizes.pop(key, None)
        self.crcs.pop(key, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(key))

    def read_into(self, key: str, tensor: torch.Tensor, staging: Optional[torch.Tensor] = None) -> None:
        """Fill ``tensor`` (contiguous, the size written under ``key``) from disk."""
        size = self.sizes.get(key)
        nbytes = tensor.numel() * tensor.element_size()
        if size is None or size != nbytes:
            raise DiskTierError(f"the disk tier holds {size} bytes for {key}, not the {nbytes} asked for")
        dst = tensor if tensor.device.type == "cpu" else (staging if staging is not None else torch.empty_like(
            tensor, device="cpu"))
        span = _direct_span(dst) if self.direct else 0
        view = _bytes_of(dst, span or nbytes)
        fd = os.open(self._path(key), os.O_RDONLY | (_O_DIRECT if span else 0))
        try:
            done = 0
            while done < nbytes:  # an O_DIRECT file written unaligned is shorter than the span: n stops early
                n = os.preadv(fd, [view[done : done + CHUNK_BYTES]], done)
                if n == 0:
                    raise DiskTierError(f"{self._path(key)} ended after {done} of {nbytes} bytes (was it truncated?)")
                done += n
        except OSError as e:
            raise DiskTierError(f"cannot read {key} from the disk tier at {self.root} ({e})") from None
        finally:
            os.close(fd)
        expected = self.crcs.get(key)
        if expected is not None and fingerprint(dst.reshape(-1)[: tensor.numel()]) != expected:
            raise DiskTierError(
                f"{self._path(key)} changed on disk since it was written (its bytes do not match the checksum taken "
                f"when {key} was written): the disk tier's files must not be touched while training runs. Nothing "
                f"was used; resume from the last checkpoint"
            )
        if dst is not tensor:
            tensor.copy_(dst, non_blocking=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self.sizes.clear()
        self.crcs.clear()
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

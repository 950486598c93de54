"""The disk tier: one file per tensor under a directory, written and read whole in large chunks.

Reads and writes go through ``pwrite`` / ``preadv`` straight between the tensor's memory and the file, so the
only memory a tensor on disk costs is the file's page cache, which the operating system reclaims (and does not
count in the process's resident set). Tensors on an accelerator are staged through one host buffer.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from typing import Optional

import torch

__all__ = ["DiskStore", "DiskTierError", "check_disk_space"]

CHUNK_BYTES = 16 * 2**20  # large sequential I/O, as ZeRO-Infinity's swapper does


class DiskTierError(RuntimeError):
    """The disk tier cannot hold or return a tensor (full, read-only or missing directory); nothing was lost."""


_PREFIX = "lightning_vescale_swap_"


def _remove_stale(directory: str) -> None:
    """Remove the swap directories of processes that no longer run (killed before ``close``): scratch nobody reads,
    which would otherwise fill the disk run after run."""
    for name in os.listdir(directory):
        pid = name[len(_PREFIX):].split("_", 1)[0]
        if not name.startswith(_PREFIX) or not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


def check_disk_space(directory: str, need: int, what: str) -> None:
    """Refuse (before anything moves) a disk tier without room for ``need`` bytes (``what`` says whose)."""
    free = shutil.disk_usage(directory).free
    if free < need:
        raise DiskTierError(
            f"the disk tier at {directory} has {free / 2**20:.1f} MiB free, but {what} need about "
            f"{need / 2**20:.1f} MiB on this rank: free space, choose another disk_dir, or keep some of them on the "
            f"device (nothing was moved)"
        )


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (through its address: ``Tensor.numpy()`` would make
    the storage non-resizable, and the swapper releases storage by resizing it)."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


class DiskStore:
    """Tensors kept as files under ``directory`` (a private subdirectory, removed by :meth:`close`)."""

    def __init__(self, directory: str, *, tag: str = "") -> None:
        self.root = os.path.join(directory, f"{_PREFIX}{os.getpid()}{tag}")
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise DiskTierError(f"cannot create the disk tier's directory {self.root} ({e})") from None
        _remove_stale(directory)
        self.sizes: dict[str, int] = {}

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key.replace("/", "_") + ".bin")

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Write ``tensor``'s bytes under ``key`` (replacing what was there); the tensor is left as it is."""
        src = tensor.detach()
        if src.device.type != "cpu":
            src = src.to("cpu")
        src = src.contiguous()
        data = _bytes_of(src)
        fd = os.open(self._path(key), os.O_WRONLY | os.O_CREAT, 0o600)
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
        self.sizes[key] = len(data)

    def read_into(self, key: str, tensor: torch.Tensor, staging: Optional[torch.Tensor] = None) -> None:
        """Fill ``tensor`` (contiguous, the size written under ``key``) from disk."""
        size = self.sizes.get(key)
        nbytes = tensor.numel() * tensor.element_size()
        if size is None or size != nbytes:
            raise DiskTierError(f"the disk tier holds {size} bytes for {key}, not the {nbytes} asked for")
        dst = tensor if tensor.device.type == "cpu" else (staging if staging is not None else torch.empty_like(
            tensor, device="cpu"))
        view = _bytes_of(dst)
        fd = os.open(self._path(key), os.O_RDONLY)
        try:
            done = 0
            while done < nbytes:
                n = os.preadv(fd, [view[done : done + CHUNK_BYTES]], done)
                if n == 0:
                    raise DiskTierError(f"{self._path(key)} ended after {done} of {nbytes} bytes (was it truncated?)")
                done += n
        except OSError as e:
            raise DiskTierError(f"cannot read {key} from the disk tier at {self.root} ({e})") from None
        finally:
            os.close(fd)
        if dst is not tensor:
            tensor.copy_(dst, non_blocking=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self.sizes.clear()

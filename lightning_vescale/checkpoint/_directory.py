"""Checkpoint directories that are replaced atomically.

[Note: atomic save]
:func:`~lightning_vescale.checkpoint.save` writes into ``<path>.tmp-<uuid>``. DCP's last step writes
``.metadata`` (after every rank's data); then the checksums are written, and rank 0 renames the old
checkpoint to ``<path>.old``, the new one to ``<path>`` and deletes ``.old``. A failure before the
renames leaves the old checkpoint at ``<path>`` and the unfinished ``.tmp-*`` directory is removed (in a
``finally``; if rank 0 itself was killed, the next save of the same target removes it); a crash between
the two renames leaves ``<path>.old``, which a load falls back to and the next save replaces.

While it writes, rank 0 holds an exclusive ``flock`` on ``<tmp>/.writer.lock``; the kernel drops it when the
process dies. Every save removes the ``*.tmp-*`` directories in its folder whose lock is free (their writer
is gone, whichever checkpoint they were for), and never one whose writer still runs (another job saving
into the same folder).

[Note: consistent reads]
A reader opens the checkpoint directory once (``last.ckpt`` and other links resolved by rank 0 and sent to
every rank) and reads every file through that open directory (``/proc/self/fd/<fd>/<file>``): a save that
replaces or relinks the checkpoint meanwhile cannot mix another step's files into the read. Files deleted
while it reads (a checkpoint rotated out) fail the read, which then changes nothing. The ranks compare a
checksum of the ``.metadata`` they opened, so they all read the same save or all refuse.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import uuid
import zlib
from typing import Iterator, Optional

from lightning_vescale.checkpoint._dist import from_rank0
from lightning_vescale.checkpoint._storage import (
    CHECKSUM_FILE,
    METADATA_FILE,
    CheckpointError,
    register_pinned,
    unregister_pinned,
)

logger = logging.getLogger(__name__)

__all__ = ["WriterLock", "commit", "check_save_target", "is_complete", "pinned", "remove_stale_tmp_dirs",
           "resolve_checkpoint_dir", "tmp_dir"]

WRITER_LOCK = ".writer.lock"  # in a save's temporary directory, locked by rank 0 while it writes


def tmp_dir(path: str) -> str:
    """A fresh temporary directory name next to ``path``, the same on every rank."""
    return f"{path}.tmp-{from_rank0(uuid.uuid4().hex[:12])}"


def is_complete(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, METADATA_FILE))


def _is_committed(directory: str) -> bool:
    return is_complete(directory) and os.path.isfile(os.path.join(directory, CHECKSUM_FILE))


def resolve_checkpoint_dir(path: os.PathLike | str) -> str:
    """The directory to load ``path`` from: ``path``, or ``path.old`` left by a save that crashed mid-commit."""
    path = os.fspath(path)
    if os.path.isdir(path):
        if not is_complete(path):
            raise CheckpointError(
                f"checkpoint directory {path} is incomplete: it has no {METADATA_FILE} file, which "
                f"torch.distributed.checkpoint writes last, after every rank's data. A save into it was "
                f"interrupted (or it is not a checkpoint); load an earlier checkpoint."
            )
        return path
    old = f"{path}.old"
    if is_complete(old):
        logger.warning("no checkpoint at %s, but a complete previous one at %s (a save crashed while "
                       "replacing it): loading that one", path, old)
        return old
    parent = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    unfinished = sorted(f for f in os.listdir(parent) if f.startswith(f"{base}.tmp-")) if os.path.isdir(parent) else []
    hint = f" Found unfinished saves that never completed: {unfinished}." if unfinished else ""
    raise FileNotFoundError(f"no checkpoint at {path}: the directory does not exist.{hint}")


def check_save_target(path: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"cannot save a checkpoint to {path}: it exists and is not a directory.")
    if os.path.isdir(path) and os.listdir(path) and not is_complete(path):
        raise ValueError(
            f"refusing to replace {path}: it is a non-empty directory without {METADATA_FILE}, so not a complete "
            f"checkpoint (an interrupted non-atomic save, or another directory). Remove it or choose another path."
        )


class WriterLock:
    """Rank 0's lock on a save's temporary directory (see [Note: atomic save]); :meth:`release` is idempotent."""

    def __init__(self, tmp: str) -> None:
        os.makedirs(tmp, exist_ok=True)
        self.tmp = tmp
        self.fd: Optional[int] = os.open(os.path.join(tmp, WRITER_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self) -> None:
        """Drop the lock file (before the directory is committed) and the lock."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.tmp, WRITER_LOCK))
        os.close(self.fd)
        self.fd = None


def _writer_is_gone(directory: str) -> Optional[bool]:
    """Whether the save writing ``directory`` ended without committing (its lock is free); ``None``: no lock file
    (an older release's save, or one whose lock is not taken yet)."""
    try:
        fd = os.open(os.path.join(directory, WRITER_LOCK), os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: its writer is still saving
    finally:
        os.close(fd)
    return True


def remove_stale_tmp_dirs(path: str, keep: str = "") -> None:
    """Rank 0: remove the ``*.tmp-*`` directories next to ``path`` left by saves that never committed (a rank
    died): any whose writer's lock is free, and lockless ones of ``path`` itself; never a live save's."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    base = os.path.basename(path)
    if not os.path.isdir(parent):
        return
    for name in os.listdir(parent):
        full = os.path.join(parent, name)
        if ".tmp-" not in name or full == os.path.abspath(keep) or os.path.islink(full) or not os.path.isdir(full):
            continue
        gone = _writer_is_gone(full)
        if gone or (gone is None and name.startswith(f"{base}.tmp-")):
            logger.info("removing %s, left by a save that did not complete", full)
            shutil.rmtree(full, ignore_errors=True)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit(tmp: str, path: str) -> None:
    """Rank 0: put the complete checkpoint ``tmp`` at ``path``, keeping the previous one until it is there."""
    if not _is_committed(tmp):
        raise RuntimeError(f"the new checkpoint {tmp} has no {METADATA_FILE} or {CHECKSUM_FILE}; {path} is left "
                           f"unchanged.")
    old = f"{path}.old"
    if os.path.isdir(path):
        if os.path.exists(old):
            shutil.rmtree(old)  # left by an earlier crash; path itself is complete
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    if os.path.exists(old):
        shutil.rmtree(old)


_PROC_FD = "/proc/self/fd"


def _metadata_crc(directory: str) -> int:
    with open(os.path.join(directory, METADATA_FILE), "rb") as f:
        return zlib.crc32(f.read())


@contextlib.contextmanager
def pinned(path: os.PathLike | str) -> Iterator[tuple[str, str]]:
    """Collective over the checkpoint's ranks: ``(read_path, real_path)`` of the checkpoint ``path`` names, opened
    once (see [Note: consistent reads]); read every file under ``read_path`` inside the block. ``real_path``
    names it in messages (the storage functions show it for ``read_path`` too).

    Raises:
        FileNotFoundError, CheckpointError: as :func:`resolve_checkpoint_dir`, on every rank; or the ranks
            opened different saves (the checkpoint was replaced while they opened it).
    """
    from lightning_vescale.checkpoint import _dist

    found: tuple[Optional[str], Optional[BaseException]] = (None, None)
    if _dist.rank() == 0:
        try:
            found = (os.path.realpath(resolve_checkpoint_dir(path)), None)
        except (FileNotFoundError, CheckpointError) as e:
            found = (None, e)
    real, error = _dist.from_rank0(found)
    if error is not None:
        raise error
    assert real is not None
    fd, read_path, problem = None, real, None
    try:
        if os.path.isdir(_PROC_FD):
            fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY)
            read_path = f"{_PROC_FD}/{fd}"
        crc = _metadata_crc(read_path)
    except OSError as e:
        problem, crc = f"cannot open checkpoint {real} ({e}): it was removed or replaced while it was opened", None
    problem = _dist.agree(problem)
    if problem is None and len(set(_dist.all_gather_object(crc))) > 1:
        problem = (f"the ranks opened different saves of checkpoint {real} (it was replaced while they opened it); "
                   f"nothing was loaded: load it again")
    if problem is not None:
        if fd is not None:
            os.close(fd)
        raise CheckpointError(problem)
    register_pinned(read_path, real)
    try:
        yield read_path, real
    finally:
        unregister_pinned(read_path)
        if fd is not None:
            os.close(fd)

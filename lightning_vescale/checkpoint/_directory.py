"""Checkpoint directories that are replaced atomically.

[Note: atomic save]
:func:`~lightning_vescale.checkpoint.save` writes into ``<path>.tmp-<uuid>``. DCP's last step writes
``.metadata`` (after every rank's data); then the checksums are written, and rank 0 renames the old
checkpoint to ``<path>.old``, the new one to ``<path>`` and deletes ``.old``. A failure before the
renames leaves the old checkpoint at ``<path>`` and the unfinished ``.tmp-*`` directory is removed (in a
``finally``; if rank 0 itself was killed, the next save of the same target removes it); a crash between
the two renames leaves ``<path>.old``, which a load falls back to and the next save replaces.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid

from lightning_vescale.checkpoint._dist import from_rank0
from lightning_vescale.checkpoint._storage import (
    CHECKSUM_FILE,
    METADATA_FILE,
    CheckpointError,
)

logger = logging.getLogger(__name__)

__all__ = ["commit", "check_save_target", "is_complete", "remove_stale_tmp_dirs", "resolve_checkpoint_dir", "tmp_dir"]


def tmp_dir(path: str) -> str:
    """A fresh temporary directory name next to ``path``, the same on every rank."""
    return f"{path}.tmp-{from_rank0(uuid.uuid4().hex[:12])}"


def is_complete(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, METADATA_FILE))


def _is_committed(directory: str) -> bool:
    return is_complete(directory) and os.path.isfile(os.path.join(directory, CHECKSUM_FILE))


def resolve_checkpoint_dir(path: "os.PathLike | str") -> str:
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


def remove_stale_tmp_dirs(path: str, keep: str = "") -> None:
    """Rank 0: remove ``<path>.tmp-*`` directories of earlier saves that never committed (a rank died)."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    base = os.path.basename(path)
    if not os.path.isdir(parent):
        return
    for name in os.listdir(parent):
        full = os.path.join(parent, name)
        if name.startswith(f"{base}.tmp-") and full != os.path.abspath(keep) and os.path.isdir(full):
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

"""Reading checkpoint files without running code in them, and checking that their bytes are intact.

[Note: what a load may execute]
DCP stores its ``.metadata`` as a pickle and, for non-tensor entries, pickled bytes that its default
planner loads with ``torch.load(weights_only=False)``: a checkpoint from the internet could run any code
on every rank. Here ``.metadata`` is read by an unpickler that only constructs DCP's metadata classes
(:data:`_ALLOWED`), tensors are read by DCP with ``weights_only=True``, and pickled entries are refused
unless the caller trusts the checkpoint (``weights_only=False``), which only checkpoints of format 1
need. Damaged files raise :class:`CheckpointError` naming the file, never a bare ``EOFError``.

[Note: checksums]
After DCP has written a checkpoint, every rank computes a CRC-32 of each item it wrote (the byte range
``.metadata`` records for it) and rank 0 writes them all to ``checksums.json`` before the checkpoint is
committed. A load verifies the items each rank is about to read (the same ranges DCP will read) before
any of them is used, so a flipped byte is reported with its file and tensor instead of loading silently.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import zlib
from typing import Any, Iterable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

__all__ = ["CheckpointError", "SafeFileSystemReader", "SafeLoadPlanner", "read_metadata", "write_checksums",
           "verify_checksums", "CHECKSUM_FILE", "METADATA_FILE"]

METADATA_FILE = ".metadata"  # what DCP's FileSystemWriter writes last
CHECKSUM_FILE = "checksums.json"


class CheckpointError(Exception):
    """A checkpoint cannot be loaded (damaged, incomplete, untrusted or of an unknown format); nothing changed."""


_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Constructs only DCP's metadata classes, torch dtypes and sizes; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: not part of checkpoint metadata")


def read_metadata(directory: str) -> Metadata:
    """The DCP metadata of ``directory``, read without running code; :class:`CheckpointError` if damaged."""
    path = os.path.join(directory, METADATA_FILE)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{directory} has no {METADATA_FILE}: it is not a complete checkpoint") from None
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path} is not checkpoint metadata ({e}). It may have been tampered with: nothing was loaded or run. "
            f"Use a checkpoint written by torch.distributed.checkpoint / lightning_vescale."
        ) from None
    except Exception as e:  # truncated, flipped or empty files fail in many ways
        raise CheckpointError(f"{path} is damaged and cannot be read ({type(e).__name__}: {e}); nothing was "
                              f"loaded. Load an earlier checkpoint.") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{path} does not hold DCP metadata (found a {type(metadata).__name__})")
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose metadata is read by :func:`read_metadata` (see [Note: what a load may execute])."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._directory = os.fspath(path)
        self._metadata: Optional[Metadata] = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = read_metadata(self._directory)
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that unpickles non-tensor entries only when the caller trusts the checkpoint."""

    def __init__(self, *, trust_pickle: bool, directory: str) -> None:
        super().__init__()
        self.trust_pickle = trust_pickle
        self.directory = directory

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        if not self.trust_pickle:
            raise CheckpointError(
                f"{self.directory}: entry {read_item.dest_index.fqn!r} is pickled, and unpickling a file can run "
                f"code. If you trust this checkpoint, load it with weights_only=False."
            )
        super().load_bytes(read_item, value)


# -- checksums --------------------------------------------------------------------------------------------


def _item_key(index: MetadataIndex) -> str:
    return f"{index.fqn}@{','.join(str(o) for o in index.offset)}" if index.offset is not None else index.fqn


def _crc_of_items(directory: str, items: Iterable[tuple[MetadataIndex, Any]]) -> dict[str, int]:
    """CRC-32 of each item's stored byte range, reading each file once in offset order."""
    by_file: dict[str, list] = {}
    for index, info in items:
        by_file.setdefault(info.relative_path, []).append((info.offset, info.length, index))
    out = {}
    for relative_path, entries in by_file.items():
        path = os.path.join(directory, relative_path)
        try:
            with open(path, "rb") as f:
                for offset, length, index in sorted(entries, key=lambda e: e[0]):
                    f.seek(offset)
                    data = f.read(length)
                    out[_item_key(index)] = zlib.crc32(data) if len(data) == length else -1
        except OSError as e:
            names = sorted({index.fqn for _, _, index in entries})
            raise CheckpointError(f"cannot read checkpoint file {path} ({e}), which holds {names[:5]}"
                                  f"{' ...' if len(names) > 5 else ''}; nothing was loaded") from None
    return out


def written_items_crc(directory: str, metadata: Metadata, rank: int) -> dict[str, int]:
    """Checksums of the items rank ``rank`` wrote (DCP names its files ``__<rank>_<n>.distcp``)."""
    mine = [(i, s) for i, s in metadata.storage_data.items() if s.relative_path.startswith(f"__{rank}_")]
    return _crc_of_items(directory, mine)


def write_checksums(directory: str, checksums: dict[str, int]) -> None:
    with open(os.path.join(directory, CHECKSUM_FILE), "w") as f:
        json.dump({"algorithm": "crc32", "items": checksums}, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_checksums(directory: str) -> Optional[dict[str, int]]:
    path = os.path.join(directory, CHECKSUM_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        items = data["items"]
        if data.get("algorithm") != "crc32" or not isinstance(items, dict):
            raise ValueError("unknown layout")
        return {str(k): int(v) for k, v in items.items()}
    except Exception as e:
        raise CheckpointError(f"{path} is damaged ({type(e).__name__}: {e}); nothing was loaded") from None


def verify_checksums(directory: str, metadata: Metadata, indices: Iterable[MetadataIndex],
                     checksums: dict[str, int]) -> None:
    """Check the stored bytes of ``indices`` against ``checksums``; :class:`CheckpointError` names the first bad one."""
    wanted = {}
    for index in indices:
        info = metadata.storage_data.get(index)
        if info is None:
            raise CheckpointError(f"{directory}: .metadata lists no storage for {_item_key(index)}; the checkpoint is "
                                  f"damaged")
        wanted[index] = info
    actual = _crc_of_items(directory, wanted.items())
    for index, info in wanted.items():
        key = _item_key(index)
        if key not in checksums:
            raise CheckpointError(f"{directory}/{CHECKSUM_FILE} has no checksum for {key}; the checkpoint is damaged")
        if actual[key] != checksums[key]:
            raise CheckpointError(
                f"checkpoint file {os.path.join(directory, info.relative_path)} is corrupted: the bytes of tensor "
                f"{index.fqn!r} (chunk at offsets {tuple(index.offset or ())}) do not match the checksum written at "
                f"save time. Nothing was loaded; load an earlier checkpoint."
            )

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
A checkpoint without ``checksums.json`` is refused on every read path (``load``, ``read_full_tensors`` and so
export, convert and ``init_from``) unless the caller passes ``allow_unverified=True``; format 1 (release 0.1)
never had them.

[Note: what .metadata may claim]
Before anything is allocated or read, :func:`read_metadata` checks that the metadata describes the files:
every tensor's chunks lie inside it and cover it exactly once (a chunk removed would leave rows of
uninitialised memory in the loaded tensor), every chunk has a stored item, and every stored item lies
inside its file and is at least as long as the chunk's bytes (so a forged shape cannot make a reader
allocate more than the files hold).
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import zlib
from typing import Any, Iterable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

__all__ = ["CheckpointError", "SafeFileSystemReader", "SafeLoadPlanner", "all_items_crc", "check_layout",
           "read_metadata", "require_checksums", "shown", "write_checksums", "verify_checksums", "CHECKSUM_FILE",
           "METADATA_FILE"]

METADATA_FILE = ".metadata"  # what DCP's FileSystemWriter writes last
CHECKSUM_FILE = "checksums.json"


class CheckpointError(Exception):
    """A checkpoint cannot be loaded (damaged, incomplete, untrusted or of an unknown format); nothing changed."""


_PINNED: dict[str, str] = {}  # a reader's pinned path -> the checkpoint's real path (see ``_directory.pinned``)


def register_pinned(read_path: str, real_path: str) -> None:
    _PINNED[read_path] = real_path


def unregister_pinned(read_path: str) -> None:
    _PINNED.pop(read_path, None)


def shown(path: str) -> str:
    """``path`` as a message names it: a pinned reader's ``/proc/self/fd/<n>`` prefix becomes the real path."""
    path = os.fspath(path)
    for read_path, real in _PINNED.items():
        if path == read_path or path.startswith(read_path + "/"):
            return real + path[len(read_path):]
    return path


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
        raise CheckpointError(f"{shown(directory)} has no {METADATA_FILE}: it is not a complete checkpoint") from None
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{shown(path)} is not checkpoint metadata ({e}). It may have been tampered with: nothing was loaded or "
            f"run. Use a checkpoint written by torch.distributed.checkpoint / lightning_vescale."
        ) from None
    except Exception as e:  # truncated, flipped or empty files fail in many ways
        raise CheckpointError(f"{shown(path)} is damaged and cannot be read ({type(e).__name__}: {e}); nothing was "
                              f"loaded. Load an earlier checkpoint.") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{shown(path)} does not hold DCP metadata (found a {type(metadata).__name__})")
    check_layout(directory, metadata)
    return metadata


def _overlap(a: Any, b: Any) -> bool:
    return all(oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(a.offsets, a.sizes, b.offsets, b.sizes))


def _check_chunks(fqn: str, md: TensorStorageMetadata, where: str) -> None:
    """The chunks of one tensor lie inside it and cover it exactly once (see [Note: what .metadata may claim])."""
    size = tuple(md.size)
    chunks = [c for c in md.chunks if math.prod(c.sizes) > 0]
    for c in chunks:
        if len(c.offsets) != len(size) or len(c.sizes) != len(size) or any(
                o < 0 or o + n > d for o, n, d in zip(c.offsets, c.sizes, size)):
            raise CheckpointError(f"{where}: tensor {fqn!r} of shape {list(size)} has a chunk at offsets "
                                  f"{list(c.offsets)} of size {list(c.sizes)} outside it; the checkpoint is damaged")
    # Sweep along the first dimension: only chunks whose first-dimension ranges meet can overlap.
    active: list = []
    for c in sorted(chunks, key=lambda c: tuple(c.offsets)):
        if size:
            active = [a for a in active if a.offsets[0] + a.sizes[0] > c.offsets[0]]
        for a in active:
            if _overlap(a, c):
                raise CheckpointError(f"{where}: tensor {fqn!r} has overlapping chunks at offsets {list(a.offsets)} "
                                      f"and {list(c.offsets)}; the checkpoint is damaged")
        active.append(c)
    covered, numel = sum(math.prod(c.sizes) for c in chunks), math.prod(size)
    if covered != numel:
        raise CheckpointError(
            f"{where}: the chunks of tensor {fqn!r} (shape {list(size)}) cover {covered} of its {numel} elements: "
            f"the metadata lost a chunk (or is damaged), and the missing part would load as uninitialised memory. "
            f"Nothing was loaded; load an earlier checkpoint."
        )


def check_layout(directory: str, metadata: Metadata) -> None:
    """Check that ``metadata`` describes the files of ``directory`` (see [Note: what .metadata may claim]).

    Raises:
        CheckpointError: names the tensor or file that does not add up.
    """
    where = f"{shown(os.path.join(directory, METADATA_FILE))}"
    storage = metadata.storage_data or {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        _check_chunks(fqn, md, where)
        itemsize = torch.empty((), dtype=md.properties.dtype).element_size()
        for c in md.chunks:
            info = storage.get(MetadataIndex(fqn, c.offsets))
            if info is None:
                if math.prod(c.sizes) == 0:
                    continue
                raise CheckpointError(f"{where} lists a chunk of tensor {fqn!r} at offsets {list(c.offsets)} with no "
                                      f"stored item; the checkpoint is damaged")
            if info.length < math.prod(c.sizes) * itemsize:
                raise CheckpointError(
                    f"{where}: tensor {fqn!r} claims a chunk of size {list(c.sizes)} ({math.prod(c.sizes) * itemsize} "
                    f"bytes) but its stored item holds only {info.length} bytes; the metadata does not match the files")
    file_sizes: dict[str, int] = {}
    for index, info in storage.items():
        rel = info.relative_path
        if rel not in file_sizes:
            if os.path.isabs(rel) or ".." in rel.replace("\\", "/").split("/"):
                raise CheckpointError(f"{where} names a data file {rel!r} outside the checkpoint directory")
            try:
                file_sizes[rel] = os.stat(os.path.join(directory, rel)).st_size
            except OSError as e:
                raise CheckpointError(f"cannot read checkpoint file {shown(os.path.join(directory, rel))} ({e}), which "
                                      f"{where} names; the checkpoint is incomplete, nothing was loaded") from None
        if info.offset < 0 or info.length < 0 or info.offset + info.length > file_sizes[rel]:
            raise CheckpointError(
                f"{where}: item {index.fqn!r} is stored at bytes {info.offset}..{info.offset + info.length} of {rel}, "
                f"which has {file_sizes[rel]} bytes (truncated, or the metadata is damaged)")


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

        storage_meta = getattr(self._metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = self._metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
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
                f"{shown(self.directory)}: entry {read_item.dest_index.fqn!r} is pickled, and unpickling a file can run "
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
            raise CheckpointError(f"cannot read checkpoint file {shown(path)} ({e}), which holds {names[:5]}"
                                  f"{' ...' if len(names) > 5 else ''}; nothing was loaded") from None
    return out


def written_items_crc(directory: str, metadata: Metadata, rank: int) -> dict[str, int]:
    """Checksums of the items rank ``rank`` wrote (DCP names its files ``__<rank>_<n>.distcp``)."""
    mine = [(i, s) for i, s in metadata.storage_data.items() if s.relative_path.startswith(f"__{rank}_")]
    return _crc_of_items(directory, mine)


def all_items_crc(directory: str, metadata: Metadata) -> dict[str, int]:
    """Checksums of every stored item of ``directory`` (for a checkpoint another library wrote)."""
    return _crc_of_items(directory, metadata.storage_data.items())


def add_checksums(directory: str) -> None:
    """Write ``checksums.json`` for a DCP directory another library wrote without one (see [Note: checksums]), so
    that loading it verifies every item as it does the package's own checkpoints."""
    write_checksums(directory, all_items_crc(directory, read_metadata(directory)))


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
        raise CheckpointError(f"{shown(path)} is damaged ({type(e).__name__}: {e}); nothing was loaded") from None


def require_checksums(directory: str, allow_unverified: bool) -> Optional[dict[str, int]]:
    """The checksums of ``directory``; a missing ``checksums.json`` is refused unless ``allow_unverified``."""
    checksums = read_checksums(directory)
    if checksums is None and not allow_unverified:
        raise CheckpointError(
            f"{shown(directory)} has no {CHECKSUM_FILE}, so its bytes cannot be verified: the save did not complete, "
            f"the file was removed, or another library wrote it. Nothing was loaded. If you trust these files as "
            f"they are, read them with allow_unverified=True (--allow-unverified on the command line, "
            f"allow_unverified=true in the recipes)."
        )
    return checksums


def verify_checksums(directory: str, metadata: Metadata, indices: Iterable[MetadataIndex],
                     checksums: dict[str, int]) -> None:
    """Check the stored bytes of ``indices`` against ``checksums``; :class:`CheckpointError` names the first bad one."""
    wanted = {}
    for index in indices:
        info = metadata.storage_data.get(index)
        if info is None:
            raise CheckpointError(f"{shown(directory)}: .metadata lists no storage for {_item_key(index)}; the "
                                  f"checkpoint is damaged")
        wanted[index] = info
    actual = _crc_of_items(directory, wanted.items())
    for index, info in wanted.items():
        key = _item_key(index)
        if key not in checksums:
            raise CheckpointError(f"{shown(directory)}/{CHECKSUM_FILE} has no checksum for {key}; the checkpoint is "
                                  f"damaged")
        if actual[key] != checksums[key]:
            raise CheckpointError(
                f"checkpoint file {shown(os.path.join(directory, info.relative_path))} is corrupted: the bytes of tensor "
                f"{index.fqn!r} (chunk at offsets {tuple(index.offset or ())}) do not match the checksum written at "
                f"save time. Nothing was loaded; load an earlier checkpoint."
            )

"""``save`` and ``load``: sharded checkpoints that reshard, load all-or-nothing, and never run stored code.

[Note: what a checkpoint holds (format 2)]
::

    model/<fqn>                         RaggedTensor (sharded parameter: its boxes) or tensor (buffer)
    optim/state/<fqn>/<key>             RaggedTensor (per-element state) or scalar tensor (``step``)
    optim<i>/state/<fqn>/<key>          the same for the i-th optimizer (i >= 1) when several are saved
    values/{meta,optim,schedulers,extra}  typed JSON as uint8 tensors (see ``_values``): format, world size,
                                        optimizer kinds; param groups and non-tensor states (``optim<i>``
                                        for the i-th optimizer); LR schedulers; the caller's loop state
    rng/rank<r>/{torch,cuda,values}     every rank's RNG states, each written by its own rank
    checksums.json                      CRC-32 of every stored item (see ``_storage``)

Everything is a tensor, so DCP reads everything with ``weights_only=True``. Format 1 (release 0.1)
pickled its non-tensor entries: its tensors load the same way, its pickled parts only with
``weights_only=False`` (see :func:`load`).

[Note: all-or-nothing loads]
A load checks names and shapes against ``.metadata``, then reads every tensor into *staging* tensors
laid out like the model's (never into the model), verifies the checksums of the bytes it reads, and
agrees with every other rank that all of it succeeded. Only then are the parameters copied and the
optimizer's own ``load_state_dict`` called. A damaged file leaves model and optimizer untouched on every
rank and raises :class:`CheckpointError` naming the file and the tensor. The staging tensors cost one
extra copy of this rank's sharded state while the load runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint._traverse import set_element, traverse_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_vescale.checkpoint import _directory, _dist, _storage
from lightning_vescale.checkpoint._state import (
    apply_model_state,
    as_global,
    check_idle,
    check_param_groups,
    declared_state_layout,
    get_model_state_dict,
    get_optimizer_state_dict,
    load_into_optimizer,
    model_entries,
    optimizer_kind,
    optimizer_params,
)
from lightning_vescale.checkpoint._storage import CheckpointError
from lightning_vescale.checkpoint._values import from_bytes_tensor, to_bytes_tensor
from lightning_vescale.engine.tensor import RaggedLayout, RaggedTensor, is_ragged, local_tensor
from lightning_vescale.memory.optimizer_states import resident_states
from lightning_vescale.memory.pieces import resident_pieces
from lightning_vescale.state_dict.report import listing, mismatch_report

logger = logging.getLogger(__name__)

__all__ = ["FORMAT_VERSION", "load", "read_full_checkpoint", "read_full_tensors", "save"]

FORMAT_VERSION = 2
Layout = dict[tuple, Optional[tuple[int, ...]]]
"""Object path -> tensor shape, or None for a non-tensor value."""


# --------------------------------------------------------------------------------------------------------
# Layouts (pure)


def _layout(state: Mapping[str, Any]) -> Layout:
    out: Layout = {}

    def visit(path: tuple, value: Any) -> None:
        out[tuple(path)] = tuple(value.shape) if isinstance(value, torch.Tensor) else None

    traverse_state_dict(dict(state), visit)
    return out


def _saved_layout(metadata: Metadata) -> Layout:
    """The layout a checkpoint's ``.metadata`` records."""
    paths = metadata.planner_data or {}
    out: Layout = {}
    for key, md in metadata.state_dict_metadata.items():
        path = tuple(paths.get(key, (key,)))
        out[path] = tuple(md.size) if isinstance(md, TensorStorageMetadata) else None
    return out


def _section(layout: Layout, *prefix: Any) -> Layout:
    n = len(prefix)
    return {k: v for k, v in layout.items() if k[:n] == prefix}


def _model_name(path: tuple) -> str:
    return ".".join(map(str, path[1:]))


def _optim_name(path: tuple) -> str:
    if len(path) >= 4 and path[1] == "state":
        return f"{path[2]} [{'.'.join(map(str, path[3:]))}]"
    return ".".join(map(str, path[1:]))


def _saved_dtype(metadata: Metadata, path: tuple) -> torch.dtype:
    keys = {tuple(v): k for k, v in (metadata.planner_data or {}).items()}
    entry = metadata.state_dict_metadata[keys.get(path, path[0])]
    assert isinstance(entry, TensorStorageMetadata)  # the entry of a tensor
    return entry.properties.dtype


# --------------------------------------------------------------------------------------------------------
# RNG


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "values": to_bytes_tensor({"python": random.getstate(), "numpy": np.random.get_state()}, "RNG state"),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    values = state["values"]
    random.setstate(values["python"])
    np.random.set_state(values["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --------------------------------------------------------------------------------------------------------
# DCP calls


def _quiet_dcp() -> None:
    """Inside ``warnings.catch_warnings()``: without a process group DCP runs in one process, as intended."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _describe(e: BaseException) -> str:
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, failure = sorted(failures.items())[0]
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {type(inner).__name__}: {inner}"
    return f"{type(e).__name__}: {e}"


def _dcp_load(state: dict, directory: str, *, trust_pickle: bool = False) -> None:
    """``dcp.load`` through the safe reader; every failure (DCP raises ``BaseException`` subclasses) becomes a
    :class:`CheckpointError` naming the directory, raised on every rank (DCP gathers failures)."""
    reader = _storage.SafeFileSystemReader(directory)
    planner = _storage.SafeLoadPlanner(trust_pickle=trust_pickle, directory=directory)
    try:
        with warnings.catch_warnings():
            _quiet_dcp()
            dcp.load(state, storage_reader=reader, planner=planner, process_group=_dist.group(),
                     no_dist=not _dist.dist_on())
    except (KeyboardInterrupt, SystemExit):
        raise
    except CheckpointError:
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException derives from BaseException
        raise CheckpointError(f"reading checkpoint {_storage.shown(directory)} failed ({_describe(e)}); nothing was "
                              f"loaded") from None


def _read_plan_items(state: dict, metadata: Metadata) -> list:
    """The stored items (``MetadataIndex``) this rank's load of ``state`` reads: what DCP's planner plans."""
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, _dist.rank() == 0)
    return [item.storage_index for item in planner.create_local_plan().items]


def _verified_load(state: dict, directory: str, metadata: Metadata, checksums: Optional[dict], *,
                   trust_pickle: bool = False) -> None:
    """Verify the checksums of what this rank will read (all ranks agree), then read it."""
    error = None
    if checksums is not None:
        try:
            _storage.verify_checksums(directory, metadata, _read_plan_items(state, metadata), checksums)
        except CheckpointError as e:
            error = str(e)
    error = _dist.agree(error)
    if error is not None:
        raise CheckpointError(error)
    _dcp_load(state, directory, trust_pickle=trust_pickle)


def _template(metadata: Metadata, saved: Layout, want: Callable[[tuple], bool]) -> dict[str, Any]:
    """A state dict to load the saved entries whose path ``want`` selects, built from the metadata alone."""
    template: dict[str, Any] = {}
    for path, shape in saved.items():
        if want(path):
            value = torch.empty(shape, dtype=_saved_dtype(metadata, path)) if shape is not None else None
            set_element(template, path, value)
    return template


# --------------------------------------------------------------------------------------------------------
# save


Optimizers = Optional[Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]]


def _optimizer_list(optimizer: Any) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    return list(optimizer)


def _optim_key(i: int) -> str:
    """The checkpoint section of the i-th optimizer ("optim" for the first, as with a single optimizer)."""
    return "optim" if i == 0 else f"optim{i}"


def _as_list(schedulers: Any) -> list[Any]:
    if schedulers is None:
        return []
    if hasattr(schedulers, "state_dict"):
        return [schedulers]
    return list(schedulers)


def _split_optimizer_state(optim: dict) -> tuple[dict, dict]:
    """(tensor states for DCP, JSON values: param groups and non-tensor states)."""
    tensors: dict[str, dict[str, Any]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for name, entries in optim["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors.setdefault(name, {})[key] = value
            else:
                scalars.setdefault(name, {})[key] = value
    order = {name: list(entries) for name, entries in optim["state"].items()}  # the optimizer's own key order
    return tensors, {"param_groups": optim["param_groups"], "scalars": scalars, "order": order}


@_dist.over_model
def save(
    path: os.PathLike | str,
    model: nn.Module,
    optimizer: Optimizers = None,
    *,
    extra: Optional[Mapping[str, Any]] = None,
    schedulers: Any = None,
    allow_non_finite: bool = False,
) -> None:
    """Save a sharded checkpoint to the directory ``path`` atomically; every rank writes its own pieces.

    Collective: every rank calls it with the same arguments. The checkpoint is written into
    ``<path>.tmp-<uuid>`` and moved to ``path`` only once it is complete and checksummed; the previous
    checkpoint at ``path`` stays loadable until then (see [Note: atomic save] in ``_directory``). It
    reloads on any world size.

    Args:
        path: the checkpoint directory, on a file system every rank can reach.
        model: the sharded model, between training steps.
        optimizer: its optimizer, or a sequence of optimizers on its parameters (a GAN's generator and
            discriminator); states are keyed by parameter FQN.
        extra: loop state (step, epoch, data position ...), the same on every rank, made of plain values,
            tensors and numpy arrays (stored as JSON, never pickled); returned by :func:`load`. Each rank's
            RNG states (torch, numpy, python ``random``, CUDA if used) are saved besides it.
        schedulers: an LR scheduler or a sequence of them (anything with ``state_dict()``).
        allow_non_finite: save weights that hold NaN or inf; by default such a model is refused (``ValueError``
            on every rank, naming the rank and the tensor) before anything is written.

    .. note::
        A value that cannot be stored without pickle raises ``TypeError`` naming it before anything is
        written. An existing non-empty directory at ``path`` that is not a complete checkpoint is never
        replaced (ValueError). When the save fails (on any rank, or a rank dies), the temporary directory is
        removed; leftovers of a killed rank 0 are removed by the next save of the same ``path``.
    """
    optimizers = _optimizer_list(optimizer)
    with contextlib.ExitStack() as stack:
        for opt in optimizers:
            stack.enter_context(resident_states(opt))
        stack.enter_context(resident_pieces(model, changes=False))
        _save(os.fspath(path), model, optimizers, extra, schedulers, allow_non_finite)


def _first_non_finite(tensors: Mapping[str, torch.Tensor]) -> Optional[str]:
    """The name of the first tensor whose piece on this rank holds NaN or inf (no collective), else None."""
    names, finite = [], []
    for name, t in tensors.items():
        local = local_tensor(t)
        if local.is_floating_point() and local.numel():
            names.append(name)
            # float8 codes have no isfinite kernel: widen them (one tensor at a time).
            finite.append(torch.isfinite(local.float() if local.element_size() == 1 else local).all())
    if not finite:
        return None
    bad = (~torch.stack(finite)).nonzero().flatten().tolist()
    return names[bad[0]] if bad else None


def _save(path: str, model: nn.Module, optimizers: list[torch.optim.Optimizer], extra: Optional[Mapping[str, Any]],
          schedulers: Any, allow_non_finite: bool = False) -> None:
    _directory.check_save_target(path)
    model_sd = get_model_state_dict(model)
    state: dict[str, Any] = {"model": {n: v for n, v in model_sd.items() if isinstance(v, torch.Tensor)}}
    if not allow_non_finite:
        bad = _first_non_finite(state["model"])
        error = _dist.agree(None if bad is None else f"tensor {bad} holds NaN or inf")
        if error is not None:
            error = error if error.startswith("rank ") else f"rank {_dist.rank()}: {error}"
            raise ValueError(
                f"not saving checkpoint {path}: the model's weights are not finite ({error}); the checkpoint there (if "
                f"any) is unchanged. A step wrote them (the recipes stop before such a step: trainer.on_non_finite); "
                f"pass allow_non_finite=True to save them anyway"
            )
    values: dict[str, Any] = {"meta": {"format": "lightning_vescale", "version": FORMAT_VERSION,
                                       "world_size": _dist.world_size()}}
    extra_states = {n: v for n, v in model_sd.items() if not isinstance(v, torch.Tensor)}
    if extra_states:
        values["model_extra"] = extra_states  # modules' get_extra_state()
    tied = _tied_names(model)
    if tied:
        values["tied"] = tied  # stored once, under the first name: readers of full state dicts restore the others
    for i, optimizer in enumerate(optimizers):
        tensors, optim_values = _split_optimizer_state(get_optimizer_state_dict(model, optimizer))
        state[_optim_key(i)] = {"state": tensors}
        values[_optim_key(i)] = optim_values
    if optimizers:
        values["meta"]["optimizer"] = optimizer_kind(optimizers[0])
        values["meta"]["optimizers"] = [optimizer_kind(o) for o in optimizers]
    scheds = _as_list(schedulers)
    if scheds:
        values["schedulers"] = [s.state_dict() for s in scheds]
    if extra:
        values["extra"] = dict(extra)
    state["values"] = {k: to_bytes_tensor(v, k if k != "extra" else "extra") for k, v in values.items()}
    state["rng"] = {f"rank{_dist.rank()}": _rng_state()}
    tmp = _directory.tmp_dir(path)
    committed = False
    lock = None
    try:
        if _dist.rank() == 0:
            lock = _directory.WriterLock(tmp)  # marks tmp as a live save until this process ends
            _directory.remove_stale_tmp_dirs(path, keep=tmp)
        try:
            with warnings.catch_warnings():
                _quiet_dcp()
                dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), process_group=_dist.group(),
                         no_dist=not _dist.dist_on())
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException derives from BaseException
            raise CheckpointError(f"saving checkpoint {path} failed ({_describe(e)}); the previous checkpoint there "
                                  f"(if any) is unchanged") from None
        _write_checksums(tmp)

        def commit() -> None:
            if lock is not None:
                lock.release()
            _directory.commit(tmp, path)

        _dist.run_on_rank0(commit)
        committed = True
    finally:
        if not committed and _dist.rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            if lock is not None:
                lock.release()
    logger.debug("lightning_vescale: saved checkpoint %s", path)


def _tied_names(model: nn.Module) -> dict[str, str]:
    """``{name: first name}`` for every state-dict name of a tensor that appears under an earlier name."""
    first: dict[int, str] = {}
    tied = {}
    for name, value in model_entries(model, dedupe=False):
        if isinstance(value, torch.Tensor):
            if id(value) in first:
                tied[name] = first[id(value)]
            else:
                first[id(value)] = name
    return tied


def _write_checksums(tmp: str) -> None:
    """Every rank checksums the items it wrote; rank 0 writes them all (see [Note: checksums] in ``_storage``)."""
    metadata = _storage.read_metadata(tmp)
    mine = _storage.written_items_crc(tmp, metadata, _dist.rank())
    everyone = _dist.all_gather_object(mine)
    merged = {k: v for part in everyone for k, v in part.items()}
    _dist.run_on_rank0(lambda: _storage.write_checksums(tmp, merged))


# --------------------------------------------------------------------------------------------------------
# load


def _read_values(directory: str, metadata: Metadata, saved: Layout, checksums: Optional[dict],
                 rng_key: str) -> dict[str, Any]:
    """Format 2's JSON values and this rank's RNG state."""
    template = _template(metadata, saved, lambda p: p[0] == "values" or (p[0] == "rng" and p[1] == rng_key))
    _verified_load(template, directory, metadata, checksums)
    out = {k: from_bytes_tensor(v) for k, v in template.get("values", {}).items()}
    rng = template.get("rng", {}).get(rng_key)
    if rng is not None:
        out["rng"] = {**rng, "values": from_bytes_tensor(rng["values"])}
    return out


def _read_values_v1(directory: str, metadata: Metadata, saved: Layout, rng_key: str) -> dict[str, Any]:
    """Format 1's pickled entries, in format 2's shape (only reached with ``weights_only=False``)."""
    template = _template(metadata, saved, lambda p: p[0] in ("schedulers", "extra", "meta")
                         or (p[0] == "rng" and p[1] == rng_key)
                         or (p[0] == "optim" and (p[1] == "param_groups" or saved[p] is None)))
    _dcp_load(template, directory, trust_pickle=True)
    out: dict[str, Any] = {"meta": template.get("meta", {})}
    optim = template.get("optim")
    if optim is not None:
        groups = optim["param_groups"]
        groups = [groups[k] for k in sorted(groups, key=int)] if isinstance(groups, dict) else list(groups)
        scalars = {n: {k: v for k, v in e.items() if not isinstance(v, torch.Tensor)}
                   for n, e in optim.get("state", {}).items()}
        out["optim"] = {"param_groups": groups, "scalars": {n: e for n, e in scalars.items() if e}}
    if "schedulers" in template:
        scheds = template["schedulers"]
        out["schedulers"] = [scheds[k] for k in sorted(scheds, key=int)]
    if "extra" in template:
        out["extra"] = dict(template["extra"][0])
    rng = template.get("rng", {}).get(rng_key)
    if rng is not None:
        out["rng"] = {"torch": rng["torch"], "values": {"python": rng["python"], "numpy": rng["numpy"]},
                      **({"cuda": rng["cuda"]} if "cuda" in rng else {})}
    return out


def _format_of(saved: Layout, directory: str) -> int:
    if ("values", "meta") in saved:
        return FORMAT_VERSION
    if ("meta", "format") in saved:
        return 1
    raise CheckpointError(f"{_storage.shown(directory)} is a DCP checkpoint but not one lightning_vescale wrote (no format entry); "
                          f"read it with torch.distributed.checkpoint directly")


def _staged_model(model_sd: Mapping[str, Any]) -> dict[str, Any]:
    """Empty tensors laid out like the model's (RaggedTensors for sharded parameters) to read into."""
    return {n: (torch.empty_like(v) if isinstance(v, torch.Tensor) else v) for n, v in model_sd.items()}


def _staged_optimizer(params: Mapping[str, torch.Tensor], saved: Layout, metadata: Metadata,
                      where: str, key: str = "optim",
                      state_layout: Optional[Callable[[str, str], Any]] = None) -> dict[str, dict[str, Any]]:
    """Empty tensors for every state tensor of the saved optimizer ``key``: per-element ones laid out like their
    parameter, those whose layout the optimizer declares (``state_layout(name, key)``, see
    :func:`~lightning_vescale.checkpoint._state.declared_state_layout`) in that layout."""
    staged: dict[str, dict[str, Any]] = {}
    for path, shape in _section(saved, key, "state").items():
        if shape is None:
            continue
        name, key = path[2], ".".join(map(str, path[3:]))
        p = params[name]
        dtype = _saved_dtype(metadata, path)
        declared = state_layout(name, key) if state_layout is not None and len(shape) > 0 else None
        if declared is not None:
            want = declared.global_shape if isinstance(declared, RaggedLayout) else tuple(declared)
            if tuple(shape) != tuple(want):
                raise ValueError(f"{where}: optimizer state {key!r} of {name} has shape {shape}; the optimizer expects "
                                 f"{tuple(want)} (saved with another block size?)")
            if isinstance(declared, RaggedLayout):
                value: Any = RaggedTensor(torch.empty(declared.local_shape, dtype=dtype, device=p.device), declared)
            else:
                value = torch.empty(shape, dtype=dtype, device=p.device)
        elif len(shape) > 0 and shape == tuple(p.shape):
            if is_ragged(p):
                local = torch.empty(p.layout_info.local_shape, dtype=dtype, device=p.device)
                value = RaggedTensor(local, p.layout_info)
            else:
                value = torch.empty(shape, dtype=dtype, device=p.device)
        elif len(shape) == 0:
            value = torch.empty((), dtype=dtype)
        else:
            raise ValueError(f"{where}: optimizer state {key!r} of {name} has shape {shape}, neither the parameter's "
                             f"{tuple(p.shape)} nor a scalar (another optimizer, or another model?)")
        staged.setdefault(name, {})[key] = value
    return staged


_SCHEDULED = {"lr", "initial_lr"}  # changed by LR schedulers as training goes


def _warn_replaced_hyperparameters(optimizer: torch.optim.Optimizer, saved_groups: list, where: str) -> None:
    """The checkpoint's hyperparameters replace the optimizer's (as ``load_state_dict`` does): say which change."""
    changes = []
    for i, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        for key, value in saved.items():
            if key in _SCHEDULED or key == "params" or key not in group:
                continue
            current = group[key]
            same = (torch.equal(torch.as_tensor(current), torch.as_tensor(value))
                    if isinstance(current, torch.Tensor) or isinstance(value, torch.Tensor) else current == value)
            if not same:
                changes.append(f"param_groups[{i}].{key}: {current} -> {value}")
    if changes:
        logger.warning("%s restores the optimizer settings it was saved with, replacing: %s", where, "; ".join(changes))


@_dist.over_model
def load(
    path: os.PathLike | str,
    model: nn.Module,
    optimizer: Optimizers = None,
    *,
    schedulers: Any = None,
    weights_only: bool = True,
    restore_rng: bool = True,
    allow_unverified: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save` (on any world size) into the sharded model and optimizer.

    Collective. All or nothing (see [Note: all-or-nothing loads]): names and global shapes are checked
    against the checkpoint's metadata (model; optimizer kind, param groups, state names and shapes;
    schedulers), every tensor is read into staging tensors and its checksum verified, and only when every
    rank succeeded are the model, optimizer and schedulers changed. Each rank reads exactly the saved boxes
    that overlap its pieces. RNG states are restored when the world size is the one that saved (otherwise a
    warning says they are not).

    Args:
        path: the checkpoint directory. If it is missing but ``<path>.old`` is complete (a save crashed
            between its renames), that one is loaded.
        model: the sharded model (any world size or mesh), between training steps.
        optimizer: its optimizer, built on ``model.parameters()`` (its states may be absent), or the sequence
            of optimizers that was saved, in the same order.
        schedulers: the LR schedulers saved with the checkpoint, in the same order.
        weights_only: never unpickle (default). Checkpoints of format 1 (release 0.1) pickled their optimizer
            hyperparameters, schedulers, loop state and RNG: with True, only their model weights load (an
            optimizer, schedulers or loop state raise :class:`CheckpointError` saying so); pass False only for
            a checkpoint you trust.
        restore_rng: set every rank's RNG states (torch, CUDA, numpy, ``random``) to the saved ones, so a resumed
            run draws what the uninterrupted one would have; False leaves them as they are (what Lightning's
            own strategies do on resume).
        allow_unverified: load a checkpoint whose ``checksums.json`` is missing (its bytes then cannot be
            verified); refused by default.

    The checkpoint is opened once, links resolved, and every file is read from that one directory, even if a
    save replaces or relinks it meanwhile (see [Note: consistent reads] in ``_directory``).

    Returns:
        The ``extra`` dict given to :func:`save` (empty if none).

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        CheckpointError: the checkpoint is incomplete, damaged, or needs unpickling; nothing changed.
        ValueError: the checkpoint does not match the model, optimizer or schedulers; nothing changed.
    """
    check_idle(model)
    with _directory.pinned(path) as (directory, _), resident_pieces(model):
        # offloaded weights are loaded in memory, then written back to their tier
        return _load(directory, model, _optimizer_list(optimizer), schedulers, weights_only, allow_unverified,
                     restore_rng)


def _load(directory: str, model: nn.Module, optimizers: list[torch.optim.Optimizer], schedulers: Any,
          weights_only: bool, allow_unverified: bool, restore_rng: bool = True) -> dict[str, Any]:
    metadata = _storage.read_metadata(directory)
    saved = _saved_layout(metadata)
    fmt = _format_of(saved, directory)
    checksums = _storage.require_checksums(directory, allow_unverified) if fmt >= 2 else None
    where = f"checkpoint {_storage.shown(directory)}"
    scheds = _as_list(schedulers)

    # 1. The model: names and global shapes against the metadata, before anything is read.
    model_sd = get_model_state_dict(model)
    tensors_sd = {n: v for n, v in model_sd.items() if isinstance(v, torch.Tensor)}
    expected = _section(_layout({"model": tensors_sd}), "model")
    given = {k: v for k, v in _section(saved, "model").items() if fmt >= 2 or v is not None}
    report = mismatch_report(expected, given, ours="model", theirs="checkpoint", name=_model_name)
    if report:
        raise ValueError(f"{where} does not match the model:\n{report}\n"
                         f"Load into the model that was saved (same modules and sizes), or convert the checkpoint.")

    # 2. The small values: format, param groups, schedulers, loop state, this rank's RNG.
    rng_key = f"rank{_dist.rank()}"
    if fmt == 1 and weights_only:
        if optimizers and not _section(saved, "optim"):
            raise ValueError(f"{where} has no optimizer state (it was saved without an optimizer); call load "
                             f"without one.")
        if optimizers or scheds:
            raise CheckpointError(
                f"{where} has format 1 (lightning-vescale 0.1), which pickled its optimizer hyperparameters, LR "
                f"schedulers and loop state; unpickling can run code stored in the file, so only its model weights "
                f"load by default. If you trust this checkpoint, load it with weights_only=False (once; saving it "
                f"again writes format {FORMAT_VERSION}), or load only the model."
            )
        values: dict[str, Any] = {}
    elif fmt == 1:
        values = _read_values_v1(directory, metadata, saved, rng_key)
    else:
        values = _read_values(directory, metadata, saved, checksums, rng_key)
    if optimizers and "optim" not in values:
        raise ValueError(f"{where} has no optimizer state (it was saved without an optimizer); call load without one.")
    num_saved = 0
    while _optim_key(num_saved) in values:
        num_saved += 1
    if optimizers and num_saved != len(optimizers):
        raise ValueError(f"{where} holds the states of {num_saved} optimizer(s), but {len(optimizers)} were given; "
                         f"pass the optimizers that were saved, in the same order.")
    saved_scheds = values.get("schedulers", [])
    if scheds and len(saved_scheds) != len(scheds):
        raise ValueError(f"{where} holds {len(saved_scheds)} LR scheduler(s), but {len(scheds)} were given; "
                         f"pass the schedulers that were saved, in the same order.")
    for i, sched in enumerate(scheds):
        report = mismatch_report({k: None for k in sched.state_dict()}, {k: None for k in saved_scheds[i]},
                                 ours="scheduler", theirs="checkpoint")
        if report:
            raise ValueError(f"{where}: LR scheduler {i} ({type(sched).__name__}) does not match:\n{report}")

    # 3. The optimizer: kind, groups and state names, then staging tensors for its states.
    extra_states = {n: v for n, v in model_sd.items() if not isinstance(v, torch.Tensor)}
    saved_extra_states = values.get("model_extra", {})
    if fmt >= 2 and set(extra_states) != set(saved_extra_states):
        report = mismatch_report({n: None for n in extra_states}, {n: None for n in saved_extra_states},
                                 ours="model", theirs="checkpoint")
        raise ValueError(f"{where}: the modules' extra states (get_extra_state) do not match:\n{report}")
    staged: dict[str, Any] = {"model": _staged_model(tensors_sd)}
    named_of: list[list] = []
    for i, optimizer in enumerate(optimizers):
        key = _optim_key(i)
        named = optimizer_params(model, optimizer)
        named_of.append(named)
        kinds = values.get("meta", {}).get("optimizers") or [values.get("meta", {}).get("optimizer")]
        saved_kind = kinds[i] if i < len(kinds) else None
        if saved_kind is not None and saved_kind != optimizer_kind(optimizer):
            raise ValueError(f"{where} holds the state of a {saved_kind} optimizer, not of a "
                             f"{optimizer_kind(optimizer)}; build the optimizer that was saved.")
        saved_groups = values[key]["param_groups"]
        try:
            # The optimizer class identifies the kind of state; hyperparameter names may change between torch
            # versions (the saved ones are set, others keep their values).
            check_param_groups(optimizer, named, saved_groups, check_keys=saved_kind is None)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        _warn_replaced_hyperparameters(optimizer, saved_groups, where)
        params = {n: as_global(p, p) for g in named for n, p in g}
        with_state = list(dict.fromkeys(p[2] for p in _section(saved, key, "state")))
        unknown = [n for n in with_state if n not in params]
        if unknown:
            raise ValueError(f"{where} has optimizer state for parameters the optimizer does not hold: "
                             f"{listing(unknown)}")
        raw = {n: p for g in named for n, p in g}

        def state_layout(n: str, k: str, opt: Any = optimizer, raw: Mapping[str, torch.Tensor] = raw) -> Any:
            return declared_state_layout(opt, raw[n], k)

        staged[key] = {"state": _staged_optimizer(params, saved, metadata, where, key, state_layout=state_layout)}

    # 4. Every tensor into the staging tensors, checksums verified, all ranks agreeing.
    _verified_load(staged, directory, metadata, checksums)

    # 5. Commit: nothing above changed the model, the optimizer or the schedulers.
    apply_model_state(model, {**staged["model"], **saved_extra_states}, dedupe=True, strict=fmt >= 2,
                      what="checkpoint")
    for i, (optimizer, named) in enumerate(zip(optimizers, named_of)):
        key = _optim_key(i)
        state = staged[key]["state"]
        for name, entries in values[key].get("scalars", {}).items():
            state.setdefault(name, {}).update(entries)
        order = values[key].get("order", {})
        state = {n: {k: e[k] for k in sorted(e, key=lambda k: order.get(n, []).index(k) if k in order.get(n, []) else 1e9)}
                 for n, e in state.items()}
        load_into_optimizer(optimizer, named, state, values[key]["param_groups"])
    for i, sched in enumerate(scheds):
        sched.load_state_dict(saved_scheds[i])
    saved_world = values.get("meta", {}).get("world_size")
    if not restore_rng:
        pass
    elif saved_world == _dist.world_size() and "rng" in values:
        _set_rng_state(values["rng"])
    elif values:
        logger.warning("checkpoint %s was saved on %s rank(s) and is loaded on %d: RNG states are not restored",
                       _storage.shown(directory), saved_world, _dist.world_size())
    return dict(values.get("extra", {}))


def read_full_checkpoint(path: os.PathLike | str, *, allow_unverified: bool = False
                         ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(state_dict, extra)`` of a checkpoint directory written by :func:`save`, whole, in this process.

    ``state_dict`` is the model's full state dict, named as ``model.state_dict()`` names it (tied weights under
    each of their names); ``extra`` the loop state given to :func:`save`. Nothing is unpickled and checksums
    are verified, as in :func:`read_full_tensors`.
    """
    with _dist.local(), _directory.pinned(path) as (directory, _):
        metadata = _storage.read_metadata(directory)
        saved = _saved_layout(metadata)
        if _format_of(saved, directory) < 2:
            raise CheckpointError(f"{directory} has format 1, whose values were pickled; load it with a model "
                                  f"(lightning_vescale.checkpoint.load) instead")
        checksums = _storage.require_checksums(directory, allow_unverified)
        values = _read_values(directory, metadata, saved, checksums, rng_key="")
        tensors = read_full_tensors(directory, allow_unverified=allow_unverified)
    state_dict = {k[len("model."):]: v for k, v in tensors.items()}
    for name, first in values.get("tied", {}).items():
        state_dict[name] = state_dict[first]
    return state_dict, dict(values.get("extra", {}))


def read_full_tensors(path: os.PathLike | str, prefix: str = "model.", *,
                      allow_unverified: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory whose key starts with ``prefix``, whole, in this process.

    No process group, model code or GPU is needed; nothing is unpickled, the metadata is checked against the
    files before anything is allocated, and the checksums are verified. A directory without ``checksums.json``
    (a save that did not complete, a removed file, or another library's DCP checkpoint) is refused unless
    ``allow_unverified`` (format 1, release 0.1, never had them). The directory is opened once (see [Note:
    consistent reads] in ``_directory``). No collective, even where a process group exists. Keys keep the prefix.
    """
    with _dist.local(), _directory.pinned(path) as (directory, _):  # one process: no collective, on any rank
        metadata = _storage.read_metadata(directory)
        format_1 = ("meta", "format") in _saved_layout(metadata)  # release 0.1 wrote no checksums
        checksums = _storage.read_checksums(directory) if format_1 else _storage.require_checksums(
            directory, allow_unverified)
        state = {
            key: torch.empty(md.size, dtype=md.properties.dtype)
            for key, md in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
        }
        if state:
            _verified_load(state, directory, metadata, checksums)
    return state

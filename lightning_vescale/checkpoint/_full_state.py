"""Full (unsharded) state dicts: export for use without this library, and import to start sharded training.

A full export is an ordinary state dict of unsharded tensors, loadable with
``safetensors.torch.load_file`` / ``torch.load(weights_only=True)`` and ``load_state_dict`` without this
library; :func:`load_full_state_dict` starts sharded training from one.
"""

from __future__ import annotations

import math
import os
import pickle
import uuid
import zipfile
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_vescale.checkpoint import _dist
from lightning_vescale.checkpoint._state import (
    apply_model_state,
    as_global,
    check_idle,
    declared_state_layout,
    is_per_element,
    model_entries,
    optimizer_params,
)
from lightning_vescale.engine.placement import redistribute_flat
from lightning_vescale.engine.tensor import is_ragged, local_tensor
from lightning_vescale.memory.optimizer_states import resident_states
from lightning_vescale.memory.pieces import resident_pieces

__all__ = [
    "export_full_optimizer_state_dict", "export_full_state_dict", "load_full_optimizer_state_dict", "load_full_state_dict",
    "read_state_file", "save_full", "save_pretrained",
]


def _full(value: torch.Tensor, rank0_only: bool) -> Optional[torch.Tensor]:
    """The whole tensor of ``value``: on the model group's first rank only (one ``all_to_all_single`` over the
    layout's group, that member receiving everything; groups without that rank skip it), or on every rank."""
    if not is_ragged(value):
        return value.detach().clone()
    layout = value.layout_info
    if not rank0_only:
        return value.full_tensor()
    group = _dist.group()
    first = dist.get_global_rank(group, 0) if group is not None else 0
    ranks = dist.get_process_group_ranks(layout.group) if layout.group is not None else [first]
    if first not in ranks:
        return None
    numel = math.prod(layout.shape)
    dst = [(0, numel) if q == ranks.index(first) else (0, 0) for q in range(len(ranks))]
    full = redistribute_flat(local_tensor(value).detach().reshape(-1), layout.ranges, dst, layout.group)
    if _dist.rank() != 0:
        return None
    return full.view(layout.shape) if layout.order is None else layout.order.to_rowmajor(full, layout.shape)


@_dist.over_model
def export_full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, Any]:
    """The model's ordinary state dict of unsharded tensors, as ``model.state_dict()`` of the unsharded model.

    Collective. Same names and order as the unsharded model (tied weights under each name, persistent
    buffers included), master dtype, on the parameters' device. Each sharded tensor is gathered with one
    collective over its group, one tensor at a time.

    Args:
        model: the sharded model, between training steps.
        rank0_only: gather onto global rank 0 only (other ranks get ``{}``); False gives every rank all.
    """
    check_idle(model)
    exporting = not rank0_only or _dist.rank() == 0
    out: dict[str, Any] = {}
    done: dict[int, Any] = {}
    with resident_pieces(model, changes=False):
        for name, value in model_entries(model, dedupe=False):
            if isinstance(value, torch.Tensor):
                if id(value) not in done:
                    done[id(value)] = _full(value, rank0_only)
                value = done[id(value)]
            if exporting:
                out[name] = value
    return out


@_dist.over_model
def export_full_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, rank0_only: bool = True
) -> dict[str, Any]:
    """The optimizer state with every per-element state gathered to the parameter's global shape.

    Collective. Keyed by FQN like :func:`~lightning_vescale.checkpoint.get_optimizer_state_dict`;
    :func:`~lightning_vescale.checkpoint.set_optimizer_state_dict` loads it back on any world size.

    Args:
        model: the sharded model the optimizer was built on.
        optimizer: the optimizer.
        rank0_only: gather onto global rank 0 only (other ranks get ``{}``); False gives every rank all.
    """
    check_idle(model)
    with resident_states(optimizer), resident_pieces(model, changes=False):
        return _export_optimizer(model, optimizer, rank0_only)


def _export_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, rank0_only: bool) -> dict[str, Any]:
    exporting = not rank0_only or _dist.rank() == 0
    state: dict[str, dict[str, Any]] = {}
    param_groups = []
    for group, named in zip(optimizer.param_groups, optimizer_params(model, optimizer)):
        for name, p in named:
            entries = optimizer.state.get(p) or {}
            full_entries = {}
            for key in sorted(entries, key=str):  # the same order on every rank: one collective each
                value = as_global(entries[key], p) if isinstance(entries[key], torch.Tensor) else entries[key]
                if isinstance(value, torch.Tensor) and declared_state_layout(optimizer, p, str(key)) is not None:
                    value = _full(entries[key], rank0_only)  # a state of its own layout (one scale per block)
                elif is_per_element(value, as_global(p, p), name, str(key)):
                    value = _full(value, rank0_only)
                elif isinstance(value, torch.Tensor):
                    value = value.detach().clone()
                full_entries[str(key)] = value
            if entries:
                state[name] = full_entries
        param_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": [n for n, _ in named]})
    return {"state": state, "param_groups": param_groups} if exporting else {}


def _unshared(state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Contiguous tensors with no storage shared between entries (safetensors refuses shared storage)."""
    out, seen = {}, set()
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"safetensors stores only tensors, but entry {name} is a {type(value).__name__} (a module's "
                f"get_extra_state()); use save_full(..., format='torch')."
            )
        ptr = value.untyped_storage().data_ptr()
        if value.numel() and (ptr in seen or not value.is_contiguous()):
            value = value.clone(memory_format=torch.contiguous_format)
        elif value.numel():
            seen.add(ptr)
        out[name] = value
    return out


@_dist.over_model
def save_full(path: os.PathLike | str, model: nn.Module, *, format: str = "safetensors") -> None:
    """Gather the full state dict onto rank 0 and write it as one ordinary file, atomically.

    Collective. The file loads without this library: ``safetensors.torch.load_file(path)`` or
    ``torch.load(path, weights_only=True)``, then ``load_state_dict`` into the unsharded model (tied weights
    appear under each of their names; in safetensors as separate copies, since it refuses shared storage).

    Args:
        path: the file to write (written as ``<path>.tmp-<uuid>`` and renamed into place).
        model: the sharded model, between training steps.
        format: ``"safetensors"`` or ``"torch"`` (``torch.save``).
    """
    if format not in ("safetensors", "torch"):
        raise ValueError(f"save_full format must be 'safetensors' or 'torch', got {format!r}.")
    path = os.fspath(path)
    state_dict = export_full_state_dict(model, rank0_only=True)

    def write() -> None:
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            if format == "safetensors":
                from safetensors.torch import save_file

                save_file(_unshared(state_dict), tmp, metadata={"format": "pt"})
            else:
                torch.save(state_dict, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    _dist.run_on_rank0(write)


@_dist.over_model
def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
    """Start sharded training from an ordinary full state dict: each rank copies its own pieces.

    No communication: every rank needs ``state_dict`` (e.g. each loads the same safetensors file).
    Names, global shapes and dtype kinds (a float weight never loads from an int or bool tensor) are checked
    before anything is copied; values are cast to the parameters' dtype and device.

    Args:
        model: the sharded model (or an unsharded one), between training steps.
        state_dict: names as ``model.state_dict()`` of the unsharded model, full tensors.
        strict: require exactly the model's names (tied weights under each name, persistent buffers);
            with False, missing and unexpected names are skipped, but shapes must still match.
    """
    check_idle(model)
    with resident_pieces(model):
        apply_model_state(model, state_dict, dedupe=False, strict=strict, what="full state dict")


def read_state_file(path: os.PathLike | str) -> dict[str, Any]:
    """A single-file checkpoint as written without this library: ``torch.save`` of a state dict or of a Lightning
    checkpoint (read with ``torch.load(weights_only=True)``: tensors and plain values, never unpickled code), or a
    ``.safetensors`` file. Tensors stay on the CPU (memory-mapped where the format allows).

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: the file needs unpickling of something other than tensors and plain values.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint file at {path!r}")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path, device="cpu")
    try:  # a zip archive (torch.save's format since 1.6) is memory-mapped; an older one is read whole
        return torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:  # weights_only refused a global: the file holds more than tensors and values
        raise ValueError(
            f"{path!r} holds objects other than tensors and plain values, and lightning_vescale never unpickles a "
            f"checkpoint (loading it could run code stored in the file): save state dicts (tensors, numbers, "
            f"strings, lists, dicts) instead ({str(e).splitlines()[0][:200]})"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise ValueError(f"{path!r} is not a checkpoint file torch.load can read (empty, truncated or another format): "
                         f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else 'no data'}") from None


def load_full_optimizer_state_dict(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
    """``optimizer.load_state_dict`` of a full optimizer state (torch's own format, as DDP or one process saves it):
    every per-element state then keeps only this rank's piece of its parameter's layout. Every rank loads."""
    from lightning_vescale.engine.optim_states import lay_out_like_params

    optimizer.load_state_dict(dict(state_dict))
    lay_out_like_params(optimizer)


@_dist.over_model
def save_pretrained(model: nn.Module, save_directory: os.PathLike | str, **kwargs: Any) -> None:
    """Write a Hugging Face directory (config, safetensors weights) of a sharded ``transformers`` model.

    Collective: every rank calls it. The full state dict is gathered to the model group's first rank, which calls
    the model's own ``save_pretrained(save_directory, state_dict=..., **kwargs)`` (so the config, generation config,
    tied-weight handling and sharding of the files are Hugging Face's); the others wait for it. ``model.save_pretrained``
    on a sharded model cannot gather by itself (as under FSDP2): call this instead (the strategies' and the
    Accelerate adapter's ``save_pretrained`` do).

    Args:
        model: a sharded ``transformers.PreTrainedModel`` (or any module with ``save_pretrained(dir, state_dict=)``).
        save_directory: the directory to write.
        **kwargs: passed to ``save_pretrained`` (``safe_serialization``, ``max_shard_size`` ...).
    """
    save_pretrained = getattr(model, "save_pretrained", None)
    if not callable(save_pretrained):
        raise TypeError(f"{type(model).__name__} has no save_pretrained(): export it with save_full(path, model)")
    if "state_dict" in kwargs or "is_main_process" in kwargs:
        raise TypeError("save_pretrained gathers the state dict and picks the writing rank itself: drop state_dict= "
                        "and is_main_process=")
    state_dict = export_full_state_dict(model, rank0_only=True)
    try:
        if _dist.rank() == 0:
            save_pretrained(os.fspath(save_directory), state_dict=state_dict, **kwargs)
    finally:
        _dist.barrier()

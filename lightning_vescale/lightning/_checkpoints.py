"""Checkpoint files the Trainer and Fabric strategies read and write besides their sharded directories.

* A state without a set-up model (``fabric.save(path, {"model": model.state_dict(), ...})``, the DDP habit) is
  written as one file, as DDP writes it: every sharded tensor gathered whole (a collective), rank 0 saving with
  ``torch.save`` into a temporary file renamed into place.
* A single file (``torch.save`` of a state dict or of a Lightning checkpoint, or ``.safetensors``) loads into a
  sharded model and its optimizers: every rank reads it (``weights_only=True``) and keeps its pieces.
* ``LightningModule.load_from_checkpoint(<sharded directory>)``: Lightning reads checkpoints through
  ``lightning.pytorch.core.saving.pl_load`` and has no plug-in point for a strategy's format, so
  :func:`install_load_from_checkpoint` wraps that one function: a lightning_vescale checkpoint directory is read
  whole in this process (model state dict and the Lightning loop state saved with it); any other path goes to
  Lightning's own function unchanged.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import _Stateful
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer

__all__ = ["full_values", "install_load_from_checkpoint", "is_sharded_checkpoint", "load_file_into", "save_as_file"]


def is_sharded_checkpoint(path: Union[str, Path]) -> bool:
    """Whether ``path`` is (or links to) a lightning_vescale checkpoint directory."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file() and (path / "checksums.json").is_file()


def full_values(obj: Any) -> Any:
    """``obj`` with every sharded tensor (a DTensor, this library's included) replaced by its whole value.
    Collective: every rank must call it on the same structure."""
    if isinstance(obj, DTensor):
        return obj.full_tensor().detach()
    if isinstance(obj, dict):
        return {k: full_values(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(full_values(v) for v in obj)
    return obj


def save_as_file(path: Path, state: dict[str, Any], rank: int) -> None:
    """Write ``state`` (no set-up model in it) as one file, as DDP does: modules, optimizers and stateful objects
    as their ``state_dict()``, sharded tensors whole; only ``rank`` 0 writes, atomically."""
    converted = {k: (v.state_dict() if isinstance(v, (Module, Optimizer, _Stateful)) else v) for k, v in state.items()}
    whole = full_values(converted)
    if rank == 0:
        if path.is_dir():
            raise IsADirectoryError(f"cannot write a checkpoint file over the directory {str(path)!r}")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            torch.save(whole, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def load_file_into(path: Path, state: Optional[Union[Module, Optimizer, dict[str, Any]]], strict: bool) -> dict:
    """Load the single-file checkpoint ``path`` into ``state`` as Lightning's strategies load one (a module, an
    optimizer, or a dict of them and other values, restored in place); return what ``state`` did not ask for (all of
    the file when ``state`` is empty). Every rank reads the file and keeps its pieces."""
    from lightning_vescale import checkpoint as vckpt

    checkpoint = vckpt.read_state_file(path)
    if not state:
        return checkpoint
    if isinstance(state, Module):
        vckpt.load_full_state_dict(state, checkpoint, strict=strict)
        return {}
    if isinstance(state, Optimizer):
        vckpt.load_full_optimizer_state_dict(state, checkpoint)
        return {}
    missing = [k for k in state if k not in checkpoint]
    if strict and missing:
        raise KeyError(f"the checkpoint at {str(path)!r} has no entries {missing}")
    for key, target in state.items():
        if key not in checkpoint:
            continue
        value = checkpoint.pop(key)
        if isinstance(target, Module):
            vckpt.load_full_state_dict(target, value, strict=strict)
        elif isinstance(target, Optimizer):
            vckpt.load_full_optimizer_state_dict(target, value)
        elif isinstance(target, _Stateful):
            target.load_state_dict(value)
        else:
            state[key] = value
    return checkpoint


def _lightning_checkpoint(path: Union[str, Path]) -> dict[str, Any]:
    """A lightning_vescale directory written by the Trainer strategy, as Lightning's ``.ckpt`` dict."""
    from lightning_vescale import checkpoint as vckpt

    state_dict, extra = vckpt.read_full_checkpoint(path)
    return {**extra, "state_dict": state_dict}


def install_load_from_checkpoint() -> None:
    """Let ``LightningModule.load_from_checkpoint`` (and ``LightningDataModule``'s) read sharded directories."""
    from lightning.pytorch.core import saving

    original: Callable = saving.pl_load
    if getattr(original, "_vescale_wrapped", False):
        return

    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: Optional[bool] = None) -> Any:
        if isinstance(path_or_url, (str, Path)) and is_sharded_checkpoint(path_or_url):
            checkpoint = _lightning_checkpoint(path_or_url)
            if map_location is not None:
                checkpoint["state_dict"] = {k: v.to(map_location) if isinstance(map_location, (str, torch.device))
                                            else v for k, v in checkpoint["state_dict"].items()}
            return checkpoint
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    pl_load._vescale_wrapped = True  # type: ignore[attr-defined]
    saving.pl_load = pl_load

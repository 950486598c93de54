"""Checkpoints of an MPMD model: every stage saves its own sharded checkpoint; together they are the whole model.

Layout::

    <path>/stage<i>-<name>/    an ordinary lightning_vescale checkpoint of stage i (its parameters under their
                               full-model names, its optimizer, written by the stage's ranks over its sub-mesh)

Reload into the same plan with :func:`load_mpmd` (sharded: each rank reads only its pieces, optimizer
included). Into another layout, go through full tensors keyed by full-model names:
:func:`read_mpmd_full_state_dict` gives the whole model (from every stage's directory) for
:func:`lightning_vescale.checkpoint.load_full_state_dict` on a plain sharded model, and
:func:`load_full_into` fills an MPMD stage from the full tensors of any checkpoint (e.g.
``read_full_tensors`` of a plain sharded one). Both are exact copies (bitwise).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

import torch
import torch.distributed as dist

from lightning_vescale import checkpoint as ckpt
from lightning_vescale.pipeline._runtime import MPMDModel

__all__ = ["load_full_into", "load_mpmd", "read_mpmd_full_state_dict", "save_mpmd"]

PathLike = Union[str, "os.PathLike[str]"]


def _stage_dir(path: PathLike, index: int, name: str) -> str:
    return os.path.join(os.fspath(path), f"stage{index}-{name}")


def save_mpmd(path: PathLike, model: MPMDModel, optimizer: torch.optim.Optimizer | None = None, *,
              extra: Mapping[str, Any] | None = None) -> None:
    """Save every stage of ``model`` under ``path`` (collective over every rank: each stage saves over its own
    sub-mesh, then all ranks wait for each other so the whole model is on disk when any rank returns)."""
    os.makedirs(os.fspath(path), exist_ok=True)
    ckpt.save(_stage_dir(path, model.stage_index, model.spec.name), model, optimizer, extra=extra)
    dist.barrier()


def load_mpmd(path: PathLike, model: MPMDModel, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load what :func:`save_mpmd` wrote into an MPMD model with the same stages (any number of ranks per stage)."""
    return ckpt.load(_stage_dir(path, model.stage_index, model.spec.name), model, optimizer)


def read_mpmd_full_state_dict(path: PathLike) -> dict[str, torch.Tensor]:
    """The whole model's tensors from every stage of an MPMD checkpoint, whole, keyed by full-model names
    (no process group needed)."""
    stages = sorted(p for p in Path(os.fspath(path)).iterdir() if p.is_dir() and p.name.startswith("stage"))
    if not stages:
        raise FileNotFoundError(f"{path} holds no MPMD stage checkpoints (stage<i>-<name>/ directories)")
    full: dict[str, torch.Tensor] = {}
    for stage in stages:
        for key, value in ckpt.read_full_tensors(stage).items():
            full[key.removeprefix("model.")] = value
    return full


def load_full_into(model: MPMDModel, full: Mapping[str, torch.Tensor]) -> None:
    """Copy this stage's tensors out of ``full`` (the whole model's, keyed by full-model names, e.g. from
    ``read_full_tensors`` of a plain sharded checkpoint with the ``model.`` prefix removed). Every name of the
    stage must be there; the other stages' names are ignored."""
    names = set(model.state_dict())
    missing = sorted(names - set(full))
    if missing:
        raise ValueError(f"the full state dict lacks {len(missing)} tensor(s) of MPMD stage {model.spec.name!r}: "
                         f"{missing[:5]}; load a checkpoint of the same model")
    ckpt.load_full_state_dict(model, {k: v for k, v in full.items() if k in names})

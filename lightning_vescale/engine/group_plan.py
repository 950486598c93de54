"""A group's buffers, decided once: the pure function the engine builds its DBuffers from and the dry run sizes.

[Note: one layout for the engine and the dry run]
``fully_shard`` (:class:`~lightning_vescale.engine.param_group.ParamGroup`) and the dry run
(:mod:`lightning_vescale.plan`) both call :func:`plan_group_buffers` with a group's parameters described by
:class:`ParamEntry` (name, shape, dtype, ``requires_grad``, granularity, buffer kind) and get the same
:class:`GroupBuffer` s: which parameters share a buffer (same dtype, ``requires_grad`` and kind), their granules
and optimizer costs (:func:`owner_cost`), the dtypes each buffer stores, gathers and reduces in, its alignment
and its :class:`~lightning_vescale.engine.planner.BufferPlan`. Nothing here needs a process group or a tensor.

[Note: buffer kinds]
The engine stores ordinary parameters in :class:`~lightning_vescale.engine.dbuffer.DBuffer` s. An extension can store a
parameter otherwise (block-quantized weights: frozen codes and scales, or an AllGather of codes) by giving it a
declaration, ``param._vescale_buffer_kind``, an object whose ``kind_for(name, param)`` returns a
:class:`BufferKind` (or None: an ordinary parameter after all), as FSDP2's tensor subclasses supply
``fsdp_pre_all_gather``. The engine never names the extension: it asks the kind for the buffer's key, its
granules, what the planner lays out, and to make the buffer (and, for a kind that keeps its own storage, the
sharded and unsharded parameters).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional, Protocol, runtime_checkable

import torch

from lightning_vescale.engine.planner import BufferPlan, Granularity, TensorSpec, granule, plan_buffer
from lightning_vescale.engine.policies import MixedPrecisionPolicy

__all__ = ["BufferKind", "GroupBuffer", "ParamEntry", "buffer_kind_of", "owner_cost", "plan_group_buffers"]


@runtime_checkable
class BufferKind(Protocol):
    """How a kind of parameter is stored in a group (supplied by an extension; see [Note: buffer kinds])."""

    key: tuple
    """Hashable; the parameters of one dtype, ``requires_grad`` and key share a buffer."""
    holds_master_pieces: bool
    """True: the buffer keeps each rank's master pieces (a :class:`DBuffer`, the engine makes the parameters);
    False: it keeps a storage of its own and :meth:`make_parameters` makes them."""

    def granule(self, name: str, shape: tuple[int, ...], requested: tuple[int, int]) -> tuple[int, int]:
        """The cut granule ``(granule_numel, period)`` (as :func:`~lightning_vescale.engine.planner.granule` gives them) of a
        parameter whose requested granularity has the granule ``requested``."""

    def planner_specs(self, specs: list[TensorSpec], alignment: int, world_size: int) -> tuple[list[TensorSpec], int]:
        """What the planner lays out for these parameters on ``world_size`` ranks, and its alignment (the engine's
        ``specs`` and ``alignment``, 16 bytes' worth of elements, are what a DBuffer of master pieces needs)."""

    def make_buffer(self, plan: BufferPlan, buffer: GroupBuffer, **kwargs: Any) -> Any:
        """The buffer (a DBuffer for master pieces); ``kwargs`` are DBuffer's (group, device, dtypes ...)."""

    def make_parameters(self, group: Any, managed: Any, buffer: Any, original: torch.Tensor) -> None:
        """For a kind with its own storage: set ``managed.sharded`` and ``managed.unsharded``."""


def buffer_kind_of(name: str, param: torch.Tensor) -> Optional[BufferKind]:
    """The kind an extension declared for ``param`` (``param._vescale_buffer_kind``), or None."""
    declaration = getattr(param, "_vescale_buffer_kind", None)
    return declaration.kind_for(name, param) if declaration is not None else None


def owner_cost(shape: tuple[int, ...], granule_numel: int) -> float:
    """Newton-Schulz cost of the matrices (2-D, or each expert of a 3-D stack) a granule keeps whole on one rank
    (the planner balances it across ranks); 0 when the granule does not hold whole matrices."""
    if len(shape) not in (2, 3):
        return 0.0
    rows, cols = shape[-2:]
    if granule_numel % max(rows * cols, 1):
        return 0.0
    short, long = sorted((rows, cols))
    return float(5 * short * short * (2 * long + short)) * (shape[0] if len(shape) == 3 else 1)


@dataclass(frozen=True)
class ParamEntry:
    """A parameter as the planning sees it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    granularity: Granularity
    kind: Optional[BufferKind] = None


@dataclass(frozen=True)
class GroupBuffer:
    """One buffer of a group: its parameters (in the planner's order), dtypes and plan."""

    key: tuple
    """``(dtype, requires_grad, *kind.key)``."""
    kind: Optional[BufferKind]
    names: tuple[str, ...]
    """The parameters, in the group's order."""
    specs: tuple[TensorSpec, ...]
    """The engine's specs of those parameters (granules, costs), before a kind turns them into planner specs."""
    plan: BufferPlan
    dtype: torch.dtype
    """The local pieces' dtype."""
    param_dtype: Optional[torch.dtype]
    """The unsharded parameters' dtype when it differs from ``dtype`` (mixed precision), else None."""
    reduce_dtype: Optional[torch.dtype]
    requires_grad: bool
    alignment: int


@functools.lru_cache(maxsize=4096)
def _plan(specs: tuple[TensorSpec, ...], world_size: int, alignment: int) -> BufferPlan:
    return plan_buffer(list(specs), world_size, alignment=alignment)


def plan_group_buffers(entries: list[ParamEntry], world_size: int, mp_policy: MixedPrecisionPolicy) -> list[GroupBuffer]:
    """The buffers of a group of ``entries`` on ``world_size`` ranks (see the module note), in first-use order.

    Raises:
        ValueError: a scalar parameter, a granularity a parameter cannot have, or a layout the planner cannot make
            (naming the parameter).
    """
    by_key: dict[tuple, list[tuple[ParamEntry, TensorSpec]]] = {}
    for e in entries:
        if len(e.shape) == 0:
            raise ValueError(f"fully_shard doesn't support scalar parameters. Change {e.name} to a 1D tensor with "
                             f"numel equal to 1.")
        try:
            g_numel, period = granule(e.shape, e.granularity)
        except ValueError as err:
            raise ValueError(f"parameter {e.name}: {err}") from None
        if e.kind is not None:
            g_numel, period = e.kind.granule(e.name, e.shape, (g_numel, period))
        key = (e.dtype, e.requires_grad, *(e.kind.key if e.kind is not None else ()))
        by_key.setdefault(key, []).append((e, TensorSpec(e.name, e.shape, g_numel, owner_cost(e.shape, g_numel), period)))
    out = []
    for key, members in by_key.items():
        dtype, requires_grad = key[0], key[1]
        kind = members[0][0].kind
        specs = [spec for _, spec in members]
        floating = dtype.is_floating_point
        param_dtype = mp_policy.param_dtype if floating else None
        if param_dtype is not None and param_dtype == dtype:
            param_dtype = None
        reduce_dtype = mp_policy.reduce_dtype if floating else None
        item = min(dtype.itemsize, (param_dtype or dtype).itemsize)
        # 16-byte aligned offsets and shard sizes keep NCCL on its fast paths; negligible padding.
        alignment = max(1, 16 // item)
        planner_specs, plan_alignment = (kind.planner_specs(specs, alignment, world_size) if kind is not None
                                         else (specs, alignment))
        try:
            plan = _plan(tuple(planner_specs), world_size, plan_alignment)
        except ValueError as err:
            raise ValueError(f"cannot plan the parameters {[s.name for s in specs][:4]}: {err}") from None
        out.append(GroupBuffer(
            key=key, kind=kind, names=tuple(s.name for s in specs), specs=tuple(specs), plan=plan, dtype=dtype,
            param_dtype=param_dtype, reduce_dtype=reduce_dtype, requires_grad=requires_grad and floating,
            alignment=plan_alignment,
        ))
    return out

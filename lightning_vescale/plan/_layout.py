"""The buffers a resolved group gets on ``N`` ranks, computed as ``fully_shard`` computes them, without a process
group: one :class:`~lightning_vescale.planner.BufferPlan` per (dtype, requires_grad), the same tensor specs,
granularities, optimizer costs and alignment as :class:`~lightning_vescale._param_group.ParamGroup` uses.

``tests/distributed/test_plan_parallelize.py`` checks that these plans have the fingerprints of the
plans of a model sharded for real, so the dry run's bytes are the engine's bytes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from lightning_vescale.plan._resolve import GroupPolicy, ResolvedPlan
from lightning_vescale.plan._spec import parse_dtype
from lightning_vescale.planner import (
    BufferPlan,
    TensorSpec,
    granularity_numel,
    plan_buffer,
)

__all__ = ["BufferLayout", "group_layouts"]

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool,
    torch.int8, torch.int16, torch.float8_e4m3fn, torch.float8_e5m2,
)}


@dataclass(frozen=True)
class BufferLayout:
    """One DBuffer of a group: its plan and the dtypes it stores, gathers and reduces in."""

    plan: BufferPlan
    dtype: torch.dtype
    """The local pieces' (master) dtype."""
    param_dtype: torch.dtype
    """dtype of the AllGather and of the unsharded parameters."""
    reduce_dtype: torch.dtype
    """dtype of the ReduceScatter."""
    requires_grad: bool


def _owner_cost(shape: tuple[int, ...], g_numel: int) -> float:
    # As _param_group._owner_cost: Newton-Schulz cost of a matrix kept whole on one rank.
    numel = 1
    for s in shape:
        numel *= s
    if len(shape) != 2 or g_numel != numel:
        return 0.0
    short, long = sorted(shape)
    return float(5 * short * short * (2 * long + short))


@functools.lru_cache(maxsize=1024)
def _plan(specs: tuple[TensorSpec, ...], world_size: int, alignment: int) -> BufferPlan:
    return plan_buffer(list(specs), world_size, alignment=alignment)


def group_layouts(
    resolved: ResolvedPlan, group: GroupPolicy, world_size: int, *, base_param_dtype: Optional[torch.dtype] = None,
    base_reduce_dtype: Optional[torch.dtype] = None,
) -> list[BufferLayout]:
    """The DBuffers of ``group`` on ``world_size`` ranks (identical groups share one planner call).

    ``base_*``: the mixed-precision dtypes where the plan sets none (the Trainer's precision).
    """
    gp = parse_dtype(group.param_dtype, "param_dtype") or base_param_dtype
    gr = parse_dtype(group.reduce_dtype, "reduce_dtype") or base_reduce_dtype
    specs: dict[tuple, list[TensorSpec]] = {}
    prefix = group.name + "." if group.name else ""
    for name in group.params:
        p = resolved.params[name]
        dtype = _DTYPES[p.dtype]
        g = granularity_numel(p.shape, p.granularity)
        inner = name[len(prefix):]
        specs.setdefault((dtype, p.requires_grad), []).append(TensorSpec(inner, p.shape, g, _owner_cost(p.shape, g)))
    out = []
    for (dtype, requires_grad), key_specs in specs.items():
        floating = dtype.is_floating_point
        param_dtype = gp if floating and gp is not None and gp != dtype else None
        reduce_dtype = (gr if gr is not None else param_dtype) if floating else None
        item = min(dtype.itemsize, (param_dtype or dtype).itemsize)
        alignment = max(1, 16 // item)
        out.append(BufferLayout(
            plan=_plan(tuple(key_specs), world_size, alignment), dtype=dtype, param_dtype=param_dtype or dtype,
            reduce_dtype=reduce_dtype or param_dtype or dtype, requires_grad=requires_grad and floating,
        ))
    return out

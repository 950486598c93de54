"""The dry run under tensor parallelism: one tp rank's view of the model, and the bytes tensor parallelism sends.

A module a plan splits over ``tp`` ranks holds ``1/tp`` of its weight on each (colwise: output features, rowwise:
input features; a rowwise bias stays whole). The dry run sizes the data-parallel sharding of that *local* model
over ``world_size / tp`` ranks exactly as the engine shards it (the engine sees only tp-local pieces), counts its
activations and FLOPs by the local shapes, and adds torch's tensor-parallel collectives, measured on the engine:
a rowwise ``nn.Linear`` AllReduces its output in forward, a colwise one its input's gradient in backward
(``tokens x features`` in the compute dtype each; activation checkpointing runs the forward ones again, but for a
block's last rowwise projection, which torch's checkpoint does not recompute).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from lightning_vescale.plan._resolve import ResolvedPlan
from lightning_vescale.plan._spec import PlanError

__all__ = ["check_tensor_parallel_size", "tensor_parallel_bytes", "tensor_parallel_view"]


def check_tensor_parallel_size(world_size: int, replicate: int, tp: int) -> int:
    """``tp`` if it divides ``world_size`` (and is not combined with HSDP yet); else a :class:`PlanError`."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise PlanError(f"tp={tp!r}: give the tensor-parallel size, a positive int dividing the world size")
    if tp > 1 and replicate > 1:
        raise PlanError(f"tp={tp} with replicate={replicate}: HSDP x tensor parallelism is not supported yet; give one")
    if world_size % tp:
        raise PlanError(f"tp={tp} does not divide world_size={world_size}: the mesh is (world_size / tp, tp)")
    return tp


def _local_shapes(model: nn.Module, styles: Mapping[str, Any], tp: int) -> dict[str, tuple[int, ...]]:
    modules = dict(model.named_modules())
    shapes: dict[str, tuple[int, ...]] = {}
    for name, style in styles.items():
        module = modules.get(name)
        if style not in ("colwise", "rowwise") or not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        # nn.Linear's weight is (out, in): colwise splits dim 0; nn.Embedding's is (vocab, dim): colwise splits dim 1.
        dim = (0 if style == "colwise" else 1) if isinstance(module, nn.Linear) else (1 if style == "colwise" else 0)
        w = module.weight
        local = list(w.shape)
        local[dim] //= tp
        shapes[f"{name}.weight" if name else "weight"] = tuple(local)
        bias = getattr(module, "bias", None)
        if isinstance(module, nn.Linear) and bias is not None and style == "colwise":
            shapes[f"{name}.bias"] = (bias.shape[0] // tp,)
    return shapes


def tensor_parallel_view(model: nn.Module, resolved: ResolvedPlan, tp: int) -> tuple[nn.Module, ResolvedPlan]:
    """One tp rank's model (a meta-device copy with the split weights' local shapes) and the plan resolved on it.

    Raises ``ValueError`` (from :func:`~lightning_vescale.parallel.check_tensor_parallel`) where ``tp`` does not
    divide a split shape or the heads, and a :class:`PlanError` where the plan splits nothing."""
    from lightning_vescale.parallel.tensor_parallel import check_tensor_parallel

    if tp == 1:
        return model, resolved
    styles = dict(resolved.tensor_parallel)
    if any(not isinstance(s, str) and set(s) - {"style"} or s == "sequence" for s in styles.values()):
        raise PlanError("the dry run does not size sequence-parallel layouts yet (tp: sequence, or input / output "
                        "layouts on a colwise / rowwise module): size the plan without them")
    if not any(s != "replicate" for s in styles.values()):
        raise PlanError(f"tp={tp}, but the plan {resolved.plan.name or ''!r} splits no module over tp: give a plan with "
                        f"tp rules (e.g. plan=llama)")
    check_tensor_parallel(model, styles, tp)
    shapes = _local_shapes(model, styles, tp)
    local = copy.deepcopy(model).to("meta")
    for full_name, shape in shapes.items():
        owner, _, attr = full_name.rpartition(".")
        module = local.get_submodule(owner)
        old = getattr(module, attr)
        setattr(module, attr, nn.Parameter(torch.empty(shape, dtype=old.dtype, device="meta"),
                                           requires_grad=old.requires_grad))
    local._vescale_tp_local = tp  # type: ignore[assignment]  # marks the view (dry_run checks it)
    local._vescale_global_numel = sum(p.numel for p in resolved.params.values())  # type: ignore[assignment]
    local._vescale_tp_split = frozenset(shapes)  # type: ignore[assignment]  # the parameters split over tp
    params = {}
    for name, policy in resolved.params.items():
        params[name] = policy if name not in shapes else type(policy)(**{**vars(policy), "shape": shapes[name]})
    return local, ResolvedPlan(plan=resolved.plan, model_type=resolved.model_type, groups=resolved.groups,
                               params=params, tensor_parallel=resolved.tensor_parallel)


def tensor_parallel_bytes(local: nn.Module, styles: Mapping[str, Any], tp: int, tokens: int, itemsize: int,
                          checkpointed: frozenset[str] = frozenset()) -> tuple[float, int]:
    """``(bytes, calls)`` per step of the tp AllReduces of one rank, counted as ``comm_stats`` counts an AllReduce
    (``2 (tp - 1) / tp`` of the payload): rowwise outputs in forward (twice under ``checkpointed`` groups: the
    recompute), colwise input gradients in backward."""
    if tp == 1:
        return 0.0, 0
    modules = dict(local.named_modules())
    # torch's non-reentrant checkpoint stops recomputing once the tensors backward needs exist again: a group's last
    # rowwise projection (its output only feeds the residual sum) is not run again, the earlier ones are.
    last_rowwise = {}
    for name, style in styles.items():
        owner = next((g for g in checkpointed if name.startswith(g + ".")), None)
        if owner is not None and style == "rowwise":
            last_rowwise[owner] = name
    total, calls = 0.0, 0
    for name, style in styles.items():
        module = modules.get(name)
        if isinstance(module, nn.Embedding) and style == "rowwise":  # vocabulary split: the lookups are summed
            total += 2 * (tp - 1) * tokens * module.weight.shape[1] * itemsize / tp
            calls += 1
            continue
        if not isinstance(module, nn.Linear) or style not in ("colwise", "rowwise"):
            continue
        if style == "rowwise":
            payload = tokens * module.weight.shape[0] * itemsize
            owner = next((g for g in checkpointed if name.startswith(g + ".")), None)
            times = 2 if owner is not None and last_rowwise[owner] != name else 1
        else:
            payload, times = tokens * module.weight.shape[1] * itemsize, 1
        total += times * 2 * (tp - 1) * payload / tp
        calls += times
    return total, calls

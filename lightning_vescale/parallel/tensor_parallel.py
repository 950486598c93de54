"""Tensor parallelism from a plan's ``tp`` rules: torch's ``parallelize_module`` over the mesh's tp dimension.

The styles are torch's (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``); this module maps the
plan's words onto them, finds the tp dimension of a mesh, and checks shapes against the tp size before any
process group exists, naming the module and the fix. ``fully_shard`` then shards the resulting DTensors over
the data-parallel dimension (see [Note: RaggedTensor as a DTensor] in :mod:`lightning_vescale.tensor`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Union

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "TENSOR_PARALLEL_DIM_NAMES",
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "split_tensor_parallel_mesh",
    "tensor_parallel_style",
]

TENSOR_PARALLEL_DIM_NAMES = (("dp", "tp"), ("data_parallel", "tensor_parallel"), ("replicate", "shard", "tp"),
                             ("replicate", "shard", "tensor_parallel"))
"""Meshes whose last dimension is tensor parallel: torchtitan's names and Lightning's ModelParallelStrategy's (2-D),
and HSDP's ``(replicate, shard)`` with tp (3-D: the groups are sharded over the 2-D HSDP slice)."""


def split_tensor_parallel_mesh(mesh: Optional[DeviceMesh]) -> Optional[tuple[DeviceMesh, DeviceMesh]]:
    """``(dp_mesh, tp_mesh)`` of a mesh named as :data:`TENSOR_PARALLEL_DIM_NAMES` says, else None; ``dp_mesh`` is
    the 2-D ``(replicate, shard)`` slice of a 3-D one."""
    names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()
    if mesh is None or names not in TENSOR_PARALLEL_DIM_NAMES:
        return None
    dp = mesh[names[:-1]] if len(names) == 3 else mesh[names[0]]
    return dp, mesh[names[-1]]


def _style_name(value: Union[str, Mapping[str, str]]) -> str:
    return value if isinstance(value, str) else value["style"]


def tensor_parallel_style(value: Union[str, Mapping[str, str]]) -> Any:  # a torch ParallelStyle, or None
    """The torch ``ParallelStyle`` for a plan's ``tp`` value (None for ``replicate``: nothing is split); the mapping
    form's ``input`` / ``output`` become the style's ``input_layouts`` / ``output_layouts``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence": SequenceParallel}
    style = _style_name(value)
    if style == "replicate":
        return None
    if style not in styles:
        raise ValueError(f"unknown tensor-parallel style {style!r}: expected colwise, rowwise, sequence or replicate")
    layouts = {"replicate": Replicate(), "sequence": Shard(1), "split": Shard(-1)}
    kwargs = {}
    if not isinstance(value, str):
        for key, arg in (("input", "input_layouts"), ("output", "output_layouts")):
            if key in value:
                kwargs[arg] = layouts[value[key]]
    return styles[style](**kwargs)


def _split_size(module: nn.Module, style: str) -> Optional[tuple[str, int]]:
    """(what is split, its size) for a colwise / rowwise Linear or Embedding."""
    if isinstance(module, nn.Linear):
        return ("out_features", module.out_features) if style == "colwise" else ("in_features", module.in_features)
    if isinstance(module, nn.Embedding):
        return ("embedding_dim", module.embedding_dim) if style == "colwise" else ("num_embeddings", module.num_embeddings)
    return None


def check_tensor_parallel(model: nn.Module, styles: Mapping[str, Any], tp_size: int) -> None:
    """Raise ``ValueError`` listing every module whose shapes ``tp_size`` does not divide: a colwise / rowwise
    split dimension, and the head counts (``n_heads``, ``n_kv_heads``) of a module whose projections are split
    (attention reshapes its output into heads: each tp rank must hold whole heads). Runs on a meta model."""
    if tp_size <= 1:
        return
    modules = dict(model.named_modules())
    problems = []
    split_parents = set()
    for name, value in styles.items():
        module, style = modules.get(name), _style_name(value)
        if module is None or style in ("replicate", "sequence"):
            continue
        split = _split_size(module, style)
        if split is not None and split[1] % tp_size != 0:
            problems.append(f"{name} ({type(module).__name__}, tp: {style}) has {split[0]}={split[1]}, not divisible "
                            f"by tp={tp_size}")
        split_parents.add(name.rpartition(".")[0])
    for parent in sorted(split_parents):
        module = modules.get(parent)
        for attr in ("n_heads", "n_kv_heads"):
            heads = getattr(module, attr, None)
            if isinstance(heads, int) and heads % tp_size != 0:
                problems.append(f"{parent or '<model>'} ({type(module).__name__}) has {attr}={heads}, not divisible by "
                                f"tp={tp_size}: each tensor-parallel rank must hold whole heads")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; ... ({len(problems)} in all)" if len(problems) > 5 else "")
        raise ValueError(f"tensor parallelism over {tp_size} ranks cannot split this model: {shown}. Choose a "
                         f"tensor-parallel size that divides them (strategy.tp_size / tensor_parallel_size), or mark "
                         f"those modules tp: replicate in the plan")


def _tied_across(model: nn.Module, names: set[str]) -> list[str]:
    """Parameters of split modules that another module also holds (splitting one copy would break the tie)."""
    owners: dict[int, list[str]] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for pname, p in m.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{mname}.{pname}" if mname else pname)
    tied = []
    for users in owners.values():
        split = [u for u in users if u.rpartition(".")[0] in names]
        if split and len(users) > 1:
            tied.append(f"{split[0]} (also {', '.join(u for u in users if u != split[0])})")
    return tied


def apply_tensor_parallel(model: nn.Module, styles: Mapping[str, Any], tp_mesh: DeviceMesh) -> int:
    """Split the modules ``styles`` names over ``tp_mesh`` (``parallelize_module``); returns how many were split.
    Modules on the meta device are split too (their DTensors stay meta until ``materialize``)."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = {name: tensor_parallel_style(style) for name, style in styles.items() if _style_name(style) != "replicate"}
    if not plan:
        return 0
    check_tensor_parallel(model, styles, tp_mesh.size())
    tied = _tied_across(model, set(plan))
    if tied:
        raise ValueError(f"tensor parallelism would split tied parameters {tied[:3]}: untie them or mark those "
                         f"modules tp: replicate")
    parallelize_module(model, tp_mesh, plan)
    return len(plan)

"""Tensor parallelism from a plan's ``tp`` rules: torch's ``parallelize_module`` over the mesh's tp dimension.

The styles are torch's (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInputOutput``);
this module maps the plan's words onto them, finds the tp dimension of a mesh, and checks shapes against the tp size
before any process group exists, naming the module and the fix. ``fully_shard`` then shards the resulting DTensors
over the data-parallel dimension (see [Note: RaggedTensor as a DTensor] in :mod:`lightning_vescale.engine.tensor`).

[Note: experts on ep, attention on tp]
On a ``("dp", "ep", "tp")`` mesh attention and dense projections are split over ``tp`` as usual, so the activations
between them are whole (or sequence-split) on every tp rank. A routed MoE feed-forward is not split that way:
``tp: split_tokens`` (``PrepareModuleInputOutput``) gives each tp rank 1/tp of the sequence, on which it runs the
router, the shared experts and the routed experts, whose dispatch all-to-all runs among the ep ranks of equal
(dp, tp) coordinate; the outputs are gathered over tp (backward: the input gradient is). No expert computes a
token twice, and no expert weight is held twice: the experts of ep rank e are sharded over the ``dp * tp`` ranks
sharing e. The module's own parameters (router, shared experts) stay whole, and their gradients differ per tp rank
(each saw other tokens), so the module is a group of its own sharded over every rank, whose ReduceScatter sums over
tp too. Every rank's loss is the mean over its (dp, ep) replica's batch, so those groups and the experts divide the
summed gradients by the number of replicas, ``dp * ep``, not by their group's size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Union

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_vescale.plan import check_tensor_parallel, token_split_modules, tp_style_name

__all__ = [
    "TENSOR_PARALLEL_DIM_NAMES",
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "split_tensor_parallel_mesh",
    "tensor_parallel_style",
    "token_split_modules",
]

TENSOR_PARALLEL_DIM_NAMES = (("dp", "tp"), ("data_parallel", "tensor_parallel"), ("replicate", "shard", "tp"),
                             ("replicate", "shard", "tensor_parallel"), ("dp", "ep", "tp"))
"""Meshes whose last dimension is tensor parallel: torchtitan's names and Lightning's ModelParallelStrategy's (2-D),
HSDP's ``(replicate, shard)`` with tp (3-D: the groups are sharded over the 2-D HSDP slice), and expert parallelism
with tp (3-D ``("dp", "ep", "tp")``: dense groups are sharded over the ``dp * ep`` ranks of equal tp coordinate)."""

EXPERT_TENSOR_PARALLEL_DIM_NAMES = ("dp", "ep", "tp")


def split_tensor_parallel_mesh(mesh: Optional[DeviceMesh]) -> Optional[tuple[DeviceMesh, DeviceMesh]]:
    """``(dp_mesh, tp_mesh)`` of a mesh named as :data:`TENSOR_PARALLEL_DIM_NAMES` says, else None; ``dp_mesh`` is
    the 2-D ``(replicate, shard)`` slice of an HSDP one, and ``("dp", "ep")`` flattened (1-D) for expert parallelism."""
    names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()
    if mesh is None or names not in TENSOR_PARALLEL_DIM_NAMES:
        return None
    if names == EXPERT_TENSOR_PARALLEL_DIM_NAMES:
        return mesh["dp", "ep"]._flatten(), mesh["tp"]
    dp = mesh[names[:-1]] if len(names) == 3 else mesh[names[0]]
    return dp, mesh[names[-1]]


def tensor_parallel_style(value: Union[str, Mapping[str, str]]) -> Any:  # a torch ParallelStyle, or None
    """The torch ``ParallelStyle`` for a plan's ``tp`` value (None for ``replicate``: nothing is split); the mapping
    form's ``input`` / ``output`` become the style's ``input_layouts`` / ``output_layouts``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence": SequenceParallel}
    style = tp_style_name(value)
    if style == "replicate":
        return None
    if style == "heads":
        # A per-head norm: its input (B, T, heads, K) holds this rank's heads; torch's SequenceParallel on dim 2 keeps
        # its weight a Replicate DTensor, so the gradient of the heads of every tp rank is summed.
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if style == "split_tokens":
        from torch.distributed.tensor.parallel import PrepareModuleInputOutput

        arrive = {"replicate": Replicate(), "sequence": Shard(1)}
        given = {} if isinstance(value, str) else value
        return PrepareModuleInputOutput(
            input_layouts=(arrive[given.get("input", "replicate")],), desired_input_layouts=(Shard(1),),
            use_local_input=True, output_layouts=(Shard(1),),
            desired_output_layouts=(arrive[given.get("output", "replicate")],), use_local_output=True)
    if style not in styles:
        raise ValueError(f"unknown tensor-parallel style {style!r}: expected colwise, rowwise, sequence, heads, "
                         f"split_tokens or replicate")
    layouts = {"replicate": Replicate(), "sequence": Shard(1), "split": Shard(-1)}
    kwargs = {}
    if not isinstance(value, str):
        for key, arg in (("input", "input_layouts"), ("output", "output_layouts")):
            if key in value:
                kwargs[arg] = layouts[value[key]]
    return styles[style](**kwargs)


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

    plan = {name: tensor_parallel_style(style) for name, style in styles.items() if tp_style_name(style) != "replicate"}
    if not plan:
        return 0
    check_tensor_parallel(model, styles, tp_mesh.size())
    tied = _tied_across(model, set(plan))
    if tied:
        raise ValueError(f"tensor parallelism would split tied parameters {tied[:3]}: untie them or mark those "
                         f"modules tp: replicate")
    parallelize_module(model, tp_mesh, plan)
    for name in token_split_modules(styles):
        # Read by the strategies' check that something runs tensor parallel (no parameter is split by this style).
        model.get_submodule(name)._vescale_split_tokens = True  # type: ignore[assignment]  # a flag, read with getattr
    return len(plan)

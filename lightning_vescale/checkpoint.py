"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), resharding on load, and full export.

[Note: what a sharded checkpoint holds]
A sharded parameter is this rank's piece of the global tensor: a contiguous flat range ``[start, end)``
of its row-major storage. In N-D that range is a union of at most ``2 * ndim - 1`` boxes
(:func:`~lightning_vescale.placement.flat_range_to_boxes`), so each piece is handed to DCP as a
``ShardedTensor`` of the *global* shape with one local shard per box (a view of the piece, no copy).
Every rank can compute every rank's boxes from ``plan.pieces(index)``, so the global shard metadata
needs no communication. DCP writes each box once (replicas of an HSDP mesh write identical boxes; DCP's
save planner keeps one copy of each) and records the boxes in ``.metadata``. A load on any world size
builds the same kind of ``ShardedTensor`` for the *new* pieces, and DCP reads exactly the overlaps of
the saved and requested boxes: an N -> M reshard is never a gather.

Optimizer states shaped like a piece (``exp_avg``, ``momentum_buffer`` ...) are saved the same way,
keyed by parameter FQN instead of integer ids, so they survive resharding and parameter reordering.
Scalar states (``step``) and ``param_groups`` hyperparameters are plain values. The layout::

    model/<fqn>                      ShardedTensor (sharded param) or tensor (buffer, unsharded param)
    optim/state/<fqn>/<key>          ShardedTensor, or a scalar tensor / value
    optim/param_groups/<i>/<key>     hyperparameters; "params" lists FQNs
    schedulers/<i>/...               each LR scheduler's state_dict()
    extra                            the caller's loop state (same on every rank), pickled whole
    rng/rank<r>/{torch,numpy,python} every rank's RNG states, each written by its own rank
    meta/{format,version,world_size,optimizer}

[Note: atomic save]
:func:`save` writes into ``<path>.tmp-<uuid>``. DCP's last step writes ``.metadata`` (atomically, after
every rank's data), so a directory with ``.metadata`` is complete. Then rank 0 renames the old
checkpoint to ``<path>.old``, the new one to ``<path>`` and deletes ``.old``. A failure before the
renames leaves the old checkpoint at ``<path>`` (rank 0 removes the unfinished ``.tmp-*`` directory if it
survives; nothing ever loads one); a crash between the two renames leaves ``<path>.old``, which
:func:`load` falls back to, and the next save replaces.

[Note: expert-parallel checkpoints]
An expert-parallel module (one with an ``ep_group``) keeps on ep rank e only experts
``[e * E/ep, (e+1) * E/ep)`` of each expert parameter, under the full parameter's name (and, with
``fully_shard_expert_parallel``, shards that local stack over dp). In a checkpoint such a parameter is
the *full* tensor of all E experts: a rank's local stack (or its dp piece of it) is the flat range of
its local stack shifted by ``e * E/ep`` rows of dim 0, which is again a flat range of the full tensor,
so the boxes are computed as above. Every rank's ep rank and piece are gathered once per state dict
(one ``all_gather_object``), so each rank lists every rank's boxes. A checkpoint of an EP model thus
loads into an EP model of any ep size dividing E, or into a model without expert parallelism, and
:func:`export_full_state_dict` gathers the experts of every ep rank.

A full export (:func:`export_full_state_dict`, :func:`save_full`) is an ordinary state dict of unsharded
tensors, loadable with ``safetensors.torch.load_file`` / ``torch.load`` and ``load_state_dict`` without
this library; :func:`load_full_state_dict` starts sharded training from one.
"""

from __future__ import annotations

import logging
import math
import os
import random
import shutil
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed.checkpoint._traverse import set_element, traverse_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX

from lightning_vescale._dtype_kinds import check_dtype_kinds
from lightning_vescale._param_group import ShardedParamInfo, TrainingState
from lightning_vescale.dbuffer import BufferState
from lightning_vescale.fully_shard import sharded_groups
from lightning_vescale.placement import flat_range_to_boxes, redistribute_flat

logger = logging.getLogger(__name__)

__all__ = [
    "get_model_state_dict",
    "set_model_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "save",
    "load",
    "export_full_state_dict",
    "export_full_optimizer_state_dict",
    "save_full",
    "load_full_state_dict",
]

FORMAT_VERSION = 1
_METADATA_FILE = ".metadata"  # what DCP's FileSystemWriter writes last
_MAX_LISTED = 20

PathLike = Union[str, os.PathLike]
Shape = tuple[int, ...]
Layout = dict[tuple, Optional[Shape]]
"""Object path -> tensor shape, or None for a non-tensor value."""


# --------------------------------------------------------------------------------------------------------
# Process-group helpers (everything also runs in one process without a process group)


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _world_size() -> int:
    return dist.get_world_size() if _dist_on() else 1


def _barrier() -> None:
    if _dist_on():
        dist.barrier()


def _from_rank0(obj: Any) -> Any:
    """``obj`` as rank 0 has it, on every rank."""
    if not _dist_on():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _run_on_rank0(fn: Callable[[], None]) -> None:
    """Run ``fn`` on rank 0 and raise its error on every rank (no rank is left waiting in a collective)."""
    error, cause = None, None
    if _rank() == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            if not _dist_on():
                raise
            error, cause = f"{type(e).__name__}: {e}", e
    error = _from_rank0(error)
    if error is not None:
        raise RuntimeError(f"rank 0 failed: {error}") from cause


# --------------------------------------------------------------------------------------------------------
# The model's tensors


def _info(t: Any) -> Optional[ShardedParamInfo]:
    return getattr(t, "_vescale", None)


@dataclass(frozen=True)
class _ExpertSlab:
    """Where an expert-parallel parameter's local expert stack sits in the full expert tensor.

    See [Note: expert-parallel checkpoints]. ``ranks`` (only when built with ``everyone``) lists, for
    every global rank, ``(global rank, ep rank, start, end)``: its flat range of its own local stack.
    """

    ep_rank: int
    num_local: int
    num_global: int
    ep_group: Any
    ranks: Optional[tuple[tuple[int, int, int, int], ...]] = None

    def full_shape(self, local_shape: Shape) -> Shape:
        return (self.num_global, *local_shape[1:])

    def offset(self, ep_rank: int, local_shape: Shape) -> int:
        """Flat offset of ep rank ``ep_rank``'s block in the full tensor."""
        return ep_rank * self.num_local * math.prod(local_shape[1:])


Slabs = dict[int, _ExpertSlab]
"""id(parameter) -> its expert slab, for the expert parameters of expert-parallel modules."""


def _expert_slabs(model: nn.Module, *, everyone: bool = False) -> Slabs:
    """The expert slabs of ``model``'s expert-parallel modules (those with an ``ep_group``).

    With ``everyone``, every rank's ep rank and piece are gathered too (one ``all_gather_object``, only if
    the model is expert parallel): collective, called in the same place on every rank.
    """
    from lightning_vescale.parallel.expert_parallel import _EXPERT_PARAMS

    found = []
    for module in model.modules():
        group = getattr(module, "ep_group", None)
        if group is None:
            continue
        for name in _EXPERT_PARAMS:
            p = getattr(module, name, None)
            if isinstance(p, torch.Tensor):
                found.append((module, p))
    if not found:
        return {}
    mine = []
    for module, p in found:
        info = _info(p)
        local_shape = tuple(info.global_shape) if info is not None else tuple(p.shape)
        if local_shape[0] != module.num_experts:
            raise RuntimeError(f"expert parameter of shape {local_shape} does not hold {module.num_experts} experts")
        start, end = info.piece if info is not None else (0, p.numel())
        mine.append((dist.get_rank(module.ep_group), start, end))
    table: list[list] = [mine]
    if everyone and _dist_on():
        table = [None] * _world_size()  # type: ignore[list-item]
        dist.all_gather_object(table, mine)
    out: Slabs = {}
    for i, (module, p) in enumerate(found):
        ranks = tuple((g, *row[i]) for g, row in enumerate(table)) if everyone else None
        out[id(p)] = _ExpertSlab(mine[i][0], module.num_experts, module.num_global_experts, module.ep_group, ranks)
    return out


def _check_idle(model: nn.Module) -> None:
    for group in sharded_groups(model):
        busy = group.training_state is not TrainingState.IDLE
        if busy or any(b.state is not BufferState.SHARDED for b in group.buffers.values()):
            raise RuntimeError(
                f"checkpointing needs the sharded model between steps, but the group of "
                f"{type(group.module).__name__} is gathered or in a training step (state "
                f"{group.training_state.name}). Save or load after backward and the optimizer step, not between "
                f"forward and backward; call model.reshard() after an explicit model.unshard()."
            )


def _model_entries(model: nn.Module, *, dedupe: bool) -> list[tuple[str, Any]]:
    """``model.state_dict()`` names and objects (parameters themselves, not detached), in its order.

    With ``dedupe``, a tensor used under several names (tied weights) appears once, under its first name.
    """
    seen: set[int] = set()
    out = []
    for name, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            if dedupe and id(value) in seen:
                continue
            seen.add(id(value))
        out.append((name, value))
    return out


def _global_shape(t: torch.Tensor, slabs: Optional[Slabs] = None) -> Shape:
    info = _info(t)
    shape = tuple(info.global_shape) if info is not None else tuple(t.shape)
    slab = (slabs or {}).get(id(t))
    return slab.full_shape(shape) if slab is not None else shape


def _piece(t: torch.Tensor, slabs: Optional[Slabs] = None) -> tuple[Shape, int, int]:
    """(global shape, start, end) of the flat range of the global tensor that ``t`` holds here.

    For an expert parameter (in ``slabs``), the global tensor holds all experts: the range of the local
    stack is shifted by the block of this rank's experts.
    """
    info = _info(t)
    shape = tuple(info.global_shape) if info is not None else tuple(t.shape)
    start, end = info.piece if info is not None else (0, t.numel())
    slab = (slabs or {}).get(id(t))
    if slab is None:
        return shape, start, end
    off = slab.offset(slab.ep_rank, shape)
    return slab.full_shape(shape), start + off, end + off


def _pieces_of(t: torch.Tensor, slabs: Slabs) -> Optional[tuple[Shape, list[tuple[int, int, int]], int]]:
    """(global shape, every rank's (global rank, start, end), index of this rank's entry) of ``t``, or None
    for an unsharded tensor that is not an expert parameter (a plain replicated tensor)."""
    info, slab = _info(t), slabs.get(id(t))
    if slab is not None:
        if slab.ranks is None:
            raise RuntimeError("internal: expert slabs built without every rank's pieces")
        local_shape = tuple(info.global_shape) if info is not None else tuple(t.shape)
        pieces = [(g, s + slab.offset(e, local_shape), x + slab.offset(e, local_shape)) for g, e, s, x in slab.ranks]
        return slab.full_shape(local_shape), pieces, _rank()
    if info is None:
        return None
    global_ranks = dist.get_process_group_ranks(info.shard_group) if _dist_on() else [0]
    pieces = [(global_ranks[r], s, e) for r, (s, e) in enumerate(info.buffer.plan.pieces(info.index))]
    return tuple(info.global_shape), pieces, info.buffer.rank


def _as_state(local: torch.Tensor, t: torch.Tensor, slabs: Slabs) -> Union[ShardedTensor, torch.Tensor]:
    """``local`` (placed like ``t``: the parameter itself or a per-element state of it) for DCP."""
    placed = _pieces_of(t, slabs)
    if placed is None:
        return local.detach()
    return _sharded_tensor(local.detach(), *placed, what=_info(t).fqn if _info(t) is not None else "an expert stack")


def _shape_of(value: Any) -> Optional[Shape]:
    """Global shape of a tensor or ShardedTensor (read from its metadata: ShardedTensor's torch functions
    are deprecated and warn), None for anything else."""
    if isinstance(value, ShardedTensor):
        return tuple(value.metadata().size)
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    return None


def _ravel(offsets: Sequence[int], shape: Shape) -> int:
    index = 0
    for o, d in zip(offsets, shape):
        index = index * d + o
    return index


def _sharded_tensor(
    local: torch.Tensor, shape: Shape, pieces: Sequence[tuple[int, int, int]], mine: int, *, what: str
) -> Union[ShardedTensor, torch.Tensor]:
    """``local`` (this rank's piece ``pieces[mine]`` of a tensor of global ``shape``) as a ShardedTensor.

    ``pieces`` lists every rank's ``(global rank, start, end)`` flat range. One shard per N-D box of each
    rank's flat range; the local shards are views of ``local``, so DCP writes from and loads into
    ``local`` in place. A tensor with no elements has no boxes: it is returned as an empty tensor of the
    global shape.
    """
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=local.dtype, device=local.device)
    if not local.is_contiguous():
        raise ValueError(
            f"the piece of {what} (shape {tuple(local.shape)}, strides {tuple(local.stride())}) is not "
            f"contiguous; checkpointing writes views of its flat storage. Keep optimizer states contiguous."
        )
    flat = local.detach().view(-1)
    device = str(local.device)
    shards_md, local_shards = [], []
    for r, (global_rank, start, end) in enumerate(pieces):
        pos = 0
        for offsets, sizes in flat_range_to_boxes(shape, start, end):
            md = ShardMetadata(list(offsets), list(sizes), f"rank:{global_rank}/{device}")
            shards_md.append(md)
            if r == mine:
                n = math.prod(sizes)
                local_shards.append(Shard(flat[pos : pos + n].view(sizes), md))
                pos += n
    props = TensorProperties(dtype=local.dtype, requires_grad=False)
    st_md = ShardedTensorMetadata(shards_md, torch.Size(shape), props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, st_md)


def _copy_piece(dst: torch.Tensor, src: Any, piece: tuple[Shape, int, int], what: str) -> None:
    """Copy the flat range ``piece = (global shape, start, end)`` of ``src`` into ``dst``.

    ``src`` is a ShardedTensor whose local shards cover exactly that range (as :func:`_sharded_tensor`
    builds them), or a full tensor of the global shape. Shards that are already views of ``dst`` (after an
    in-place ``dcp.load``) are not copied again.
    """
    shape, start, end = piece
    flat = dst.detach().view(-1)
    if isinstance(src, ShardedTensor):
        if _shape_of(src) != shape:
            raise ValueError(f"{what}: the state has global shape {_shape_of(src)}, the model {shape}.")
        covered = 0
        for shard in src.local_shards():
            offsets, sizes = tuple(shard.metadata.shard_offsets), tuple(shard.metadata.shard_sizes)
            a = _ravel(offsets, shape)
            n = math.prod(sizes)
            if not (start <= a and a + n <= end) or flat_range_to_boxes(shape, a, a + n) != [(offsets, sizes)]:
                raise ValueError(
                    f"{what}: a local shard (offsets {offsets}, sizes {sizes}) is not a contiguous part of this "
                    f"rank's piece, flat range [{start}, {end}) of shape {shape}. Build the state with "
                    f"get_model_state_dict / get_optimizer_state_dict on this model."
                )
            target = flat[a - start : a - start + n]
            if shard.tensor.data_ptr() != target.data_ptr() or shard.tensor.dtype != target.dtype:
                target.copy_(shard.tensor.reshape(-1))
            covered += n
        if covered != end - start:
            raise ValueError(
                f"{what}: the local shards hold {covered} of the {end - start} elements of this rank's piece "
                f"[{start}, {end}); build the state with get_model_state_dict / get_optimizer_state_dict."
            )
    elif isinstance(src, torch.Tensor):
        if tuple(src.shape) != shape:
            raise ValueError(f"{what}: the state has shape {tuple(src.shape)}, the model {shape}.")
        if src.data_ptr() != flat.data_ptr() or src.numel() != flat.numel() or src.dtype != flat.dtype:
            flat.copy_(src.detach().reshape(-1)[start:end])
    else:
        raise TypeError(f"{what}: expected a tensor or ShardedTensor, got {type(src).__name__}.")


# --------------------------------------------------------------------------------------------------------
# Comparing layouts (pure)


def _layout(state: Mapping[str, Any]) -> Layout:
    """Object path -> shape (global shape for ShardedTensors) or None, with DCP's own traversal."""
    out: Layout = {}

    def visit(path: tuple, value: Any) -> None:
        out[tuple(path)] = _shape_of(value)

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


def _diff(expected: Mapping[Any, Any], saved: Mapping[Any, Any]) -> tuple[list, list, list]:
    """(missing from saved, unexpected in saved, present in both with different values), in stable order."""
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    mismatched = [k for k in expected if k in saved and expected[k] != saved[k]]
    return missing, unexpected, mismatched


def _fmt_shape(shape: Optional[Shape]) -> str:
    return "(non-tensor)" if shape is None else str(tuple(shape))


def _listing(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    return shown + (f", ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else "")


def _mismatch_report(
    expected: Mapping[Any, Optional[Shape]],
    saved: Mapping[Any, Optional[Shape]],
    name: Callable[[Any], str],
    *,
    ours: str,
    theirs: str,
) -> Optional[str]:
    """Lines naming missing, unexpected and mismatched entries with their shapes, or None if they agree."""
    missing, unexpected, mismatched = _diff(expected, saved)
    if not (missing or unexpected or mismatched):
        return None
    lines = []
    if missing:
        lines.append(f"  missing from the {theirs} ({len(missing)}): "
                     + _listing([f"{name(k)} {_fmt_shape(expected[k])}" for k in missing]))
    if unexpected:
        lines.append(f"  unexpected in the {theirs}, not in the {ours} ({len(unexpected)}): "
                     + _listing([f"{name(k)} {_fmt_shape(saved[k])}" for k in unexpected]))
    if mismatched:
        lines.append(f"  shape mismatch ({len(mismatched)}): "
                     + _listing([f"{name(k)}: {theirs} {_fmt_shape(saved[k])}, {ours} {_fmt_shape(expected[k])}"
                                 for k in mismatched]))
    return "\n".join(lines)


def _section(layout: Layout, *prefix: Any) -> Layout:
    n = len(prefix)
    return {k: v for k, v in layout.items() if k[:n] == prefix}


def _model_name(path: tuple) -> str:
    return ".".join(map(str, path[1:]))


def _optim_name(path: tuple) -> str:
    if len(path) >= 4 and path[1] == "state":
        return f"{path[2]} [{'.'.join(map(str, path[3:]))}]"
    return ".".join(map(str, path[1:]))


# --------------------------------------------------------------------------------------------------------
# Model state


def get_model_state_dict(model: nn.Module) -> dict[str, Any]:
    """The model's state for ``torch.distributed.checkpoint``: every rank writes only its own pieces.

    Each sharded parameter is a ``ShardedTensor`` of its global shape whose local shards are views of
    this rank's piece (one per N-D box of its flat range); buffers and unsharded parameters are plain
    tensors (replicated: DCP writes them once). Tied parameters appear once, under their first name.
    ``dcp.save(sd)`` writes it; ``dcp.load(sd)`` loads into the model in place (on any world size), and
    :func:`set_model_state_dict` applies a state that was built elsewhere.

    Args:
        model: a model sharded with ``fully_shard`` (or an unsharded one), between training steps.
    """
    _check_idle(model)
    slabs = _expert_slabs(model, everyone=True)
    out: dict[str, Any] = {}
    for name, value in _model_entries(model, dedupe=True):
        if isinstance(value, torch.Tensor):
            out[name] = _as_state(value, value, slabs)
        else:
            out[name] = value  # get_extra_state()
    return out


def _apply_model_state(model: nn.Module, state: Mapping[str, Any], *, dedupe: bool, strict: bool, what: str) -> None:
    """Check ``state`` against the model's entries (names, global shapes), then copy each rank's pieces.

    Everything is checked before anything is copied. Tensors shared under several names are copied
    once; non-tensor entries go to their module's ``set_extra_state``.
    """
    entries = _model_entries(model, dedupe=dedupe)
    slabs = _expert_slabs(model)
    expected = {n: (_global_shape(v, slabs) if isinstance(v, torch.Tensor) else None) for n, v in entries}
    given = {n: _shape_of(v) for n, v in state.items()}
    if not strict:
        expected = {n: s for n, s in expected.items() if n in given}
        given = {n: s for n, s in given.items() if n in expected}
    report = _mismatch_report(expected, given, str, ours="model", theirs="state dict")
    if report:
        raise ValueError(f"the {what} does not match the model:\n{report}\nPass the state of the same model "
                         f"(strict=False skips missing and unexpected names, never a wrong shape).")
    done: set[int] = set()
    for name, value in entries:
        if name not in given or id(value) in done:
            continue
        done.add(id(value))
        if isinstance(value, torch.Tensor):
            _copy_piece(value, state[name], _piece(value, slabs), f"{what} entry {name}")
        else:
            prefix = name[: -len(_EXTRA_STATE_KEY_SUFFIX)].rstrip(".")
            model.get_submodule(prefix).set_extra_state(state[name])


@torch.no_grad()
def set_model_state_dict(model: nn.Module, state: Mapping[str, Any], *, strict: bool = True) -> None:
    """Copy ``state`` (from :func:`get_model_state_dict`, filled by ``dcp.load``) into the model.

    Values that already share the parameters' storage (the usual case after an in-place ``dcp.load``)
    are not copied again. A plain tensor of the global shape is accepted too: each rank copies its piece.

    Args:
        model: the sharded model, between training steps.
        state: name -> ShardedTensor or tensor, keyed like :func:`get_model_state_dict`.
        strict: require exactly the model's names (tied weights under their first name). Names and
            shapes are checked before anything is copied.
    """
    _check_idle(model)
    _apply_model_state(model, state, dedupe=True, strict=strict, what="state dict")


# --------------------------------------------------------------------------------------------------------
# Optimizer state


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[tuple[str, nn.Parameter]]]:
    names = _param_names(model)
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        named = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"optimizer param_groups[{i}] holds a tensor of shape {tuple(p.shape)} that is not a parameter "
                    f"of the model; build the optimizer on model.parameters() after fully_shard."
                )
            named.append((names[id(p)], p))
        groups.append(named)
    return groups


def _is_per_element(value: Any, p: nn.Parameter, name: str, key: str) -> bool:
    """Whether optimizer state ``value`` of ``p`` is per-element (shaped like the local piece)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    if value.shape == p.shape:
        return True
    raise ValueError(
        f"optimizer state {key!r} of {name} has shape {tuple(value.shape)}: neither the shape of the local piece "
        f"{tuple(p.shape)} nor a scalar. Only per-element and scalar optimizer states can be checkpointed."
    )


def get_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state for ``torch.distributed.checkpoint``, keyed by parameter FQN.

    ``{"state": {fqn: {key: value}}, "param_groups": [{hyperparameters..., "params": [fqn, ...]}]}``. A
    state tensor shaped like the parameter's local piece is a ``ShardedTensor`` of the global shape
    (views of the state tensor, as in :func:`get_model_state_dict`); scalar tensors (``step``) and other
    values are kept as they are. Keys are FQNs, not integer ids, so the state survives resharding.

    Args:
        model: the sharded model the optimizer was built on.
        optimizer: any ``torch.optim`` optimizer whose states are per-element or scalar (AdamW, SGD, ...).
    """
    _check_idle(model)
    slabs = _expert_slabs(model, everyone=True)
    state: dict[str, dict[str, Any]] = {}
    param_groups = []
    for group, named in zip(optimizer.param_groups, _optimizer_params(model, optimizer)):
        for name, p in named:
            entries = optimizer.state.get(p)
            if not entries:
                continue
            state[name] = {}
            for key, value in entries.items():
                if _is_per_element(value, p, name, str(key)):
                    value = _as_state(value, p, slabs)
                elif isinstance(value, torch.Tensor):
                    value = value.detach()
                state[name][str(key)] = value
        param_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": [n for n, _ in named]})
    return {"state": state, "param_groups": param_groups}


_SCHEDULER_KEYS = {"initial_lr"}  # added to param_groups by LR schedulers, not by the optimizer


def _optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _check_param_groups(
    optimizer: torch.optim.Optimizer, named: list, saved_groups: Sequence[Mapping], *, check_keys: bool = True
) -> None:
    """Same groups of the same parameter FQNs; with ``check_keys``, the same hyperparameter names too."""
    current = [[n for n, _ in g] for g in named]
    saved = [list(g.get("params", [])) for g in saved_groups]
    problems = []
    if len(saved) != len(current):
        problems.append(f"  the state has {len(saved)} param_groups, the optimizer {len(current)}")
    for i, (cur, sav, group, sgroup) in enumerate(zip(current, saved, optimizer.param_groups, saved_groups)):
        if cur != sav:
            problems.append(f"  param_groups[{i}] params differ: state {_listing(sav)}; optimizer {_listing(cur)}")
        keys, skeys = set(group) - {"params"} - _SCHEDULER_KEYS, set(sgroup) - {"params"} - _SCHEDULER_KEYS
        if check_keys and keys != skeys:
            problems.append(
                f"  param_groups[{i}] hyperparameters differ (another optimizer type?): only in the state "
                f"{sorted(skeys - keys)}, only in the optimizer {sorted(keys - skeys)}"
            )
    if problems:
        raise ValueError("the optimizer state does not match the optimizer:\n" + "\n".join(problems))


@torch.no_grad()
def set_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load ``state`` (from :func:`get_optimizer_state_dict` or :func:`export_full_optimizer_state_dict`).

    Per-element states may be ShardedTensors (each rank copies its local shards) or full tensors of the
    global shape (each rank copies its piece); missing state tensors are created. Hyperparameters of
    ``param_groups`` are set from ``state``. Param groups and names are checked before anything changes.
    """
    _check_idle(model)
    named = _optimizer_params(model, optimizer)
    _check_param_groups(optimizer, named, state["param_groups"])
    _apply_optimizer_state(optimizer, {n: p for g in named for n, p in g}, state, _expert_slabs(model))


def _apply_optimizer_state(
    optimizer: torch.optim.Optimizer, params: Mapping[str, nn.Parameter], state: Mapping[str, Any], slabs: Slabs
) -> None:
    """Check the state's names and shapes, then set each rank's pieces, scalars and hyperparameters."""
    unknown = [n for n in state["state"] if n not in params]
    if unknown:
        raise ValueError(
            f"the optimizer state has entries for parameters the optimizer does not hold: {_listing(unknown)}"
        )
    for name, entries in state["state"].items():
        for key, value in entries.items():
            if _shape_of(value) not in (None, _global_shape(params[name], slabs), ()):
                raise ValueError(
                    f"optimizer state {key!r} of {name} has shape {_shape_of(value)}; expected the parameter's "
                    f"global shape {_global_shape(params[name], slabs)} or a scalar."
                )
    for name, entries in state["state"].items():
        p = params[name]
        mine = optimizer.state[p]
        for key, value in entries.items():
            if _shape_of(value) == _global_shape(p, slabs) and len(_global_shape(p, slabs)) > 0:
                dst = mine.get(key)
                if not isinstance(dst, torch.Tensor) or dst.shape != p.shape:
                    st = isinstance(value, ShardedTensor)
                    dtype = value.metadata().tensor_properties.dtype if st else value.dtype
                    dst = torch.zeros(p.shape, dtype=dtype, device=p.device)
                    mine[key] = dst
                _copy_piece(dst, value, _piece(p, slabs), f"optimizer state {key!r} of {name}")
            elif isinstance(value, torch.Tensor):
                dst = mine.get(key)
                if isinstance(dst, torch.Tensor) and dst.shape == value.shape:
                    if dst.data_ptr() != value.data_ptr():
                        dst.copy_(value)
                else:
                    mine[key] = value.detach().clone()
            else:
                mine[key] = value
    for group, saved in zip(optimizer.param_groups, state["param_groups"]):
        for key, value in saved.items():
            if key != "params":
                group[key] = value


def _init_optimizer_state(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """Create missing optimizer states with one zero-lr step on zero gradients; returns the params it created.

    The step leaves the parameters unchanged (lr 0) and touches only the states of ``params`` that had
    none (every other parameter gets no gradient for the step).
    """
    missing = [p for p in params if not optimizer.state.get(p)]
    if not missing:
        return []
    missing_ids = {id(p) for p in missing}
    everything = [p for g in optimizer.param_groups for p in g["params"]]
    grads = [p.grad for p in everything]
    lrs = [g["lr"] for g in optimizer.param_groups]
    try:
        for p in everything:
            p.grad = torch.zeros_like(p) if id(p) in missing_ids else None
        for g in optimizer.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        optimizer.step()
    finally:
        for p, grad in zip(everything, grads):
            p.grad = grad
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
    return missing


# --------------------------------------------------------------------------------------------------------
# RNG


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --------------------------------------------------------------------------------------------------------
# Checkpoint directories


def _tmp_dir(path: str) -> str:
    return f"{path}.tmp-{_from_rank0(uuid.uuid4().hex[:12])}"


def _is_complete(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, _METADATA_FILE))


def _resolve_checkpoint_dir(path: PathLike) -> str:
    """The directory to load ``path`` from: ``path``, or ``path.old`` left by a save that crashed mid-commit."""
    path = os.fspath(path)
    if os.path.isdir(path):
        if not _is_complete(path):
            raise ValueError(
                f"checkpoint directory {path} is incomplete: it has no {_METADATA_FILE} file, which "
                f"torch.distributed.checkpoint writes last, after every rank's data. A save into it was "
                f"interrupted (or it is not a checkpoint); load an earlier checkpoint."
            )
        return path
    old = f"{path}.old"
    if _is_complete(old):
        logger.warning("no checkpoint at %s, but a complete previous one at %s (a save crashed while "
                       "replacing it): loading that one", path, old)
        return old
    parent = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    unfinished = sorted(f for f in os.listdir(parent) if f.startswith(f"{base}.tmp-")) if os.path.isdir(parent) else []
    hint = (f" Found unfinished saves that never completed: {unfinished}." if unfinished else "")
    raise FileNotFoundError(f"no checkpoint at {path}: the directory does not exist.{hint}")


def _check_save_target(path: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"cannot save a checkpoint to {path}: it exists and is not a directory.")
    if os.path.isdir(path) and os.listdir(path) and not _is_complete(path):
        raise ValueError(
            f"refusing to replace {path}: it is a non-empty directory without {_METADATA_FILE}, so not a complete "
            f"checkpoint (an interrupted non-atomic save, or another directory). Remove it or choose another path."
        )


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _commit(tmp: str, path: str) -> None:
    """Rank 0: put the complete checkpoint ``tmp`` at ``path``, keeping the previous one until it is there."""
    if not _is_complete(tmp):
        raise RuntimeError(f"the new checkpoint {tmp} has no {_METADATA_FILE}; {path} is left unchanged.")
    old = f"{path}.old"
    if os.path.isdir(path):
        if os.path.exists(old):
            shutil.rmtree(old)  # left by an earlier crash; path itself is complete
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    if os.path.exists(old):
        shutil.rmtree(old)


def _as_list(schedulers: Any) -> list[Any]:
    if schedulers is None:
        return []
    if hasattr(schedulers, "state_dict"):
        return [schedulers]
    return list(schedulers)


def _quiet_dcp() -> None:
    """Inside ``warnings.catch_warnings()``: silence what DCP says about our intended use of it."""
    # Without a process group DCP runs in one process: intended here.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    # DCP's planner calls torch functions on ShardedTensors, which warn that ShardedTensor is deprecated.
    warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating ShardedTensor")


def _dcp_save(state: dict, directory: str) -> None:
    with warnings.catch_warnings():
        _quiet_dcp()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(directory), no_dist=not _dist_on())


def _dcp_load(state: dict, reader: dcp.FileSystemReader) -> None:
    with warnings.catch_warnings():
        _quiet_dcp()
        dcp.load(state, storage_reader=reader, no_dist=not _dist_on())


# --------------------------------------------------------------------------------------------------------
# save / load


def save(
    path: PathLike,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    extra: Optional[Mapping[str, Any]] = None,
    schedulers: Any = None,
) -> None:
    """Save a sharded checkpoint to the directory ``path`` atomically; every rank writes its own pieces.

    Collective: every rank calls it with the same arguments. The checkpoint is written into
    ``<path>.tmp-<uuid>`` and moved to ``path`` only once it is complete; the previous checkpoint at
    ``path`` stays loadable until then (see [Note: atomic save]). It reloads on any world size.

    Args:
        path: the checkpoint directory, on a file system every rank can reach.
        model: the sharded model, between training steps.
        optimizer: its optimizer; states are keyed by parameter FQN.
        extra: loop state (step, epoch, data position ...), the same on every rank; returned by :func:`load`.
            Each rank's RNG states (torch, numpy, python ``random``, CUDA if used) are saved besides it.
        schedulers: an LR scheduler or a sequence of them (anything with ``state_dict()``).

    .. note::
        An existing non-empty directory at ``path`` that is not a complete checkpoint is never replaced
        (ValueError). When the save fails with an error (on any rank, or a rank dies), rank 0 removes
        ``<path>.tmp-*``; if rank 0 itself is killed, that directory stays behind (nothing reads it).
    """
    path = os.fspath(path)
    _check_save_target(path)
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    scheds = _as_list(schedulers)
    if scheds:
        state["schedulers"] = {str(i): s.state_dict() for i, s in enumerate(scheds)}
    if extra:
        # One opaque entry: DCP treats a tuple as a leaf and pickles it whole, so the dict comes back exactly
        # (non-str keys, empty containers) instead of being flattened into one entry per value.
        state["extra"] = (dict(extra),)
    state["rng"] = {f"rank{_rank()}": _rng_state()}
    state["meta"] = {"format": "lightning_vescale", "version": FORMAT_VERSION, "world_size": _world_size()}
    if optimizer is not None:
        state["meta"]["optimizer"] = _optimizer_kind(optimizer)
    tmp = _tmp_dir(path)
    try:
        _dcp_save(state, tmp)  # returns on every rank once .metadata is written
    except BaseException:
        if _rank() == 0:  # DCP raised on every rank (or a peer died): nothing will complete this directory
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier()
    _run_on_rank0(lambda: _commit(tmp, path))
    logger.debug("lightning_vescale: saved checkpoint %s", path)


def _small_template(saved: Layout, metadata: Metadata, want: Callable[[tuple], bool]) -> dict[str, Any]:
    """A state dict to load the saved entries whose path ``want`` selects, built from the metadata alone."""
    template: dict[str, Any] = {}
    keys = {tuple(v): k for k, v in (metadata.planner_data or {}).items()}
    for path, shape in saved.items():
        if not want(path):
            continue
        md = metadata.state_dict_metadata[keys.get(path, path[0])]
        value = torch.empty(shape, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
        set_element(template, path, value)
    return template


def load(
    path: PathLike,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    schedulers: Any = None,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save` (on any world size) into the sharded model and optimizer.

    Collective. Each rank reads exactly the saved boxes that overlap its pieces. Before any state
    changes, the checkpoint's metadata is checked against the model (names and global shapes), the
    optimizer (param groups, hyperparameter names, state names and shapes) and the schedulers; a
    mismatch raises ValueError listing what is missing, unexpected or of another shape. Missing optimizer
    states are created first (one zero-lr step on zero gradients; parameters are unchanged). RNG states
    are restored when the world size is the one that saved (otherwise a warning says they are not).

    Args:
        path: the checkpoint directory. If it is missing but ``<path>.old`` is complete (a save crashed
            between its renames), that one is loaded.
        model: the sharded model (any world size or mesh), between training steps.
        optimizer: its optimizer, built on ``model.parameters()``; its states may be absent.
        schedulers: the LR schedulers saved with the checkpoint, in the same order.

    Returns:
        The ``extra`` dict given to :func:`save` (empty if none).

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        ValueError: the directory is incomplete (no ``.metadata``), or the checkpoint does not match.
    """
    _check_idle(model)
    directory = _resolve_checkpoint_dir(path)
    reader = dcp.FileSystemReader(directory)
    metadata = reader.read_metadata()
    saved = _saved_layout(metadata)
    where = f"checkpoint {directory}"

    # 1. The model: names and global shapes against the metadata, before anything changes.
    model_sd = get_model_state_dict(model)
    report = _mismatch_report(_section(_layout({"model": model_sd}), "model"), _section(saved, "model"),
                              _model_name, ours="model", theirs="checkpoint")
    if report:
        raise ValueError(f"{where} does not match the model:\n{report}\n"
                         f"Load into the model that was saved (same modules and sizes), or convert the checkpoint.")
    scheds = _as_list(schedulers)
    saved_scheds = {p[1] for p in saved if p[0] == "schedulers"}
    if scheds and len(saved_scheds) != len(scheds):
        raise ValueError(f"{where} holds {len(saved_scheds)} LR scheduler(s), but {len(scheds)} were given; "
                         f"pass the schedulers that were saved, in the same order.")
    if optimizer is not None and not _section(saved, "optim"):
        raise ValueError(f"{where} has no optimizer state (it was saved without an optimizer); call load without one.")

    # 2. The small entries: param groups, schedulers, extra, meta and this rank's RNG.
    rng_key = f"rank{_rank()}"

    def small(p: tuple) -> bool:
        if p[0] == "optim":
            return optimizer is not None and p[1] == "param_groups"
        return p[0] in ("schedulers", "extra", "meta") or (p[0] == "rng" and p[1] == rng_key)

    small_sd = _small_template(saved, metadata, small)
    if small_sd:
        _dcp_load(small_sd, reader)
    for i, sched in enumerate(scheds):
        report = _mismatch_report({k: None for k in sched.state_dict()},
                                  {k: None for k in small_sd["schedulers"][str(i)]},
                                  str, ours="scheduler", theirs="checkpoint")
        if report:
            raise ValueError(f"{where}: LR scheduler {i} ({type(sched).__name__}) does not match:\n{report}")

    # 3. The optimizer: groups first, then create missing states and compare them with the checkpoint.
    created: list[nn.Parameter] = []
    if optimizer is not None:
        named = _optimizer_params(model, optimizer)
        saved_groups = small_sd["optim"]["param_groups"]
        saved_kind = small_sd.get("meta", {}).get("optimizer")
        if saved_kind is not None and saved_kind != _optimizer_kind(optimizer):
            raise ValueError(f"{where} holds the state of a {saved_kind} optimizer, not of a "
                             f"{_optimizer_kind(optimizer)}; build the optimizer that was saved.")
        try:
            # The optimizer class identifies the kind of state; hyperparameter names may change between
            # torch versions (the saved ones are set, others keep their values).
            _check_param_groups(optimizer, named, saved_groups, check_keys=saved_kind is None)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        params = {n: p for g in named for n, p in g}
        with_state = list(dict.fromkeys(p[2] for p in _section(saved, "optim", "state")))
        unknown = [n for n in with_state if n not in params]
        if unknown:
            raise ValueError(f"{where} has optimizer state for parameters the optimizer does not hold: "
                             f"{_listing(unknown)}")
        created = _init_optimizer_state(optimizer, [params[n] for n in with_state])
        optim_sd = get_optimizer_state_dict(model, optimizer)
        optim_sd["state"] = {n: optim_sd["state"].get(n, {}) for n in with_state}
        report = _mismatch_report(_section(_layout({"optim": {"state": optim_sd["state"]}}), "optim", "state"),
                                  _section(saved, "optim", "state"), _optim_name, ours="optimizer", theirs="checkpoint")
        if report:
            for p in created:
                optimizer.state.pop(p, None)
            raise ValueError(f"{where} does not match the optimizer's states (another optimizer type or "
                             f"settings?):\n{report}")

    # 4. The tensors, in place: each rank reads the saved boxes overlapping its pieces.
    big_sd: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        big_sd["optim"] = {"state": optim_sd["state"]}
    _dcp_load(big_sd, reader)
    _apply_model_state(model, model_sd, dedupe=True, strict=True, what="checkpoint")
    if optimizer is not None:
        for name, p in params.items():
            if name not in optim_sd["state"]:
                optimizer.state.pop(p, None)  # as after the save: no state where the checkpoint has none
        _apply_optimizer_state(optimizer, params, {"state": optim_sd["state"], "param_groups": saved_groups},
                               _expert_slabs(model))
    for i, sched in enumerate(scheds):
        sched.load_state_dict(small_sd["schedulers"][str(i)])
    saved_world = small_sd.get("meta", {}).get("world_size")
    if saved_world == _world_size() and rng_key in small_sd.get("rng", {}):
        _set_rng_state(small_sd["rng"][rng_key])
    else:
        logger.warning("checkpoint %s was saved on %s rank(s) and is loaded on %d: RNG states are not restored",
                       directory, saved_world, _world_size())
    return dict(small_sd["extra"][0]) if "extra" in small_sd else {}


# --------------------------------------------------------------------------------------------------------
# Full (unsharded) state dicts


def _gather(local: torch.Tensor, info: ShardedParamInfo, rank0_only: bool) -> Optional[torch.Tensor]:
    """The full tensor from every rank's piece: on the shard-group member that is global rank 0, or on all.

    One ``all_to_all_single`` over the shard group; with ``rank0_only`` only that member receives data,
    and groups without global rank 0 (other HSDP replicas) skip the collective.
    """
    shape = tuple(info.global_shape)
    group = info.shard_group
    ranks = dist.get_process_group_ranks(group)
    numel = math.prod(shape)
    if rank0_only:
        if 0 not in ranks:
            return None
        dst = ranks.index(0)
        dst_ranges = [(0, numel) if r == dst else (0, 0) for r in range(len(ranks))]
    else:
        dst_ranges = [(0, numel)] * len(ranks)
    full = redistribute_flat(local.detach().reshape(-1), info.buffer.plan.pieces(info.index), dst_ranges, group)
    if rank0_only and _rank() != 0:
        return None
    return full.view(shape)


def _full(local: torch.Tensor, t: torch.Tensor, slabs: Slabs, rank0_only: bool) -> Optional[torch.Tensor]:
    """The full tensor of ``local`` (placed like ``t``): gathered over the shard group, and for an expert
    parameter over its ep group too (every expert block, in ep-rank order). Collective."""
    info, slab = _info(t), slabs.get(id(t))
    if slab is None:
        return _gather(local, info, rank0_only) if info is not None else local.detach().clone()
    stack = _gather(local, info, False) if info is not None else local.detach().contiguous()
    blocks = [torch.empty_like(stack) for _ in range(dist.get_world_size(slab.ep_group))]
    dist.all_gather(blocks, stack, group=slab.ep_group)
    if rank0_only and _rank() != 0:
        return None
    return torch.cat(blocks, dim=0)


def export_full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, Any]:
    """The model's ordinary state dict of unsharded tensors, as ``model.state_dict()`` of the unsharded model.

    Collective. Same names and order as the unsharded model (tied weights under each name, persistent
    buffers included), master dtype, on the parameters' device. Each sharded tensor is gathered with one
    collective over its shard group, one tensor at a time.

    Args:
        model: the sharded model, between training steps.
        rank0_only: gather onto global rank 0 only (other ranks get ``{}``); False gives every rank all.
    """
    _check_idle(model)
    slabs = _expert_slabs(model)
    exporting = not rank0_only or _rank() == 0
    out: dict[str, Any] = {}
    done: dict[int, Any] = {}
    for name, value in _model_entries(model, dedupe=False):
        if isinstance(value, torch.Tensor) and id(value) in done:
            full = done[id(value)]
        elif isinstance(value, torch.Tensor):
            full = _full(value, value, slabs, rank0_only)
            done[id(value)] = full
        else:
            full = value
        if exporting:
            out[name] = full
    return out


def export_full_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, rank0_only: bool = True
) -> dict[str, Any]:
    """The optimizer state with every per-element state gathered to the parameter's global shape.

    Collective. Keyed by FQN like :func:`get_optimizer_state_dict`; :func:`set_optimizer_state_dict`
    loads it back into a sharded optimizer on any world size.

    Args:
        model: the sharded model the optimizer was built on.
        optimizer: the optimizer.
        rank0_only: gather onto global rank 0 only (other ranks get ``{}``); False gives every rank all.
    """
    _check_idle(model)
    slabs = _expert_slabs(model)
    exporting = not rank0_only or _rank() == 0
    state: dict[str, dict[str, Any]] = {}
    param_groups = []
    for group, named in zip(optimizer.param_groups, _optimizer_params(model, optimizer)):
        for name, p in named:
            entries = optimizer.state.get(p) or {}
            full_entries = {}
            for key in sorted(entries, key=str):  # the same order on every rank: one collective each
                value = entries[key]
                if _is_per_element(value, p, name, str(key)) and (_info(p) is not None or id(p) in slabs):
                    value = _full(value, p, slabs, rank0_only)
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


def save_full(path: PathLike, model: nn.Module, *, format: str = "safetensors") -> None:
    """Gather the full state dict onto rank 0 and write it as one ordinary file, atomically.

    Collective. The file loads without this library: ``safetensors.torch.load_file(path)`` or
    ``torch.load(path)``, then ``load_state_dict`` into the unsharded model (tied weights appear under
    each of their names; in safetensors as separate copies, since it refuses shared storage).

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

    _run_on_rank0(write)


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
    """Start sharded training from an ordinary full state dict: each rank copies its own pieces.

    No communication: every rank needs ``state_dict`` (e.g. each loads the same safetensors file).
    Names and global shapes are checked before anything is copied; values are cast to the parameters'
    dtype and device.

    Args:
        model: the sharded model (or an unsharded one), between training steps.
        state_dict: names as ``model.state_dict()`` of the unsharded model, full tensors.
        strict: require exactly the model's names (tied weights under each name, persistent buffers);
            with False, missing and unexpected names are skipped, but shapes must still match.
    """
    _check_idle(model)
    check_dtype_kinds(model, state_dict, what="full state dict")
    _apply_model_state(model, state_dict, dedupe=False, strict=strict, what="full state dict")

"""State dicts of a sharded model and its optimizer, keyed by parameter name, for DCP and for loading.

A sharded parameter is a :class:`~lightning_vescale.engine.tensor.RaggedTensor`: DCP asks it for its chunks
(``__create_write_items__`` / ``__create_chunk_list__``) and writes or reads its pieces in place
(``__get_tensor_shard__``), so a state dict is simply the parameters themselves and the optimizer's
states shaped like them (which elementwise ops keep as RaggedTensors of the parameter's layout).
Optimizer states are keyed by parameter name instead of integer ids, so they survive resharding and
reordering.

An optimizer may keep states that are not shaped like their parameter, sharded with it (AdamW8bit's one scale
per block of elements): it declares their layout with a method ``state_layout(param, key)`` returning a
:class:`~lightning_vescale.engine.tensor.RaggedLayout` (for a sharded parameter) or a shape (for a plain one), None for
per-element and scalar states. Such states are saved as they are (RaggedTensors of that layout), staged in the
layout the optimizer declares on the loading world size, gathered whole by the full export, and given whole to
the optimizer's ``load_state_dict`` by a full load (it takes its piece).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX

from lightning_vescale.engine.dbuffer import BufferState
from lightning_vescale.engine.fully_shard import sharded_groups
from lightning_vescale.engine.param_group import TrainingState
from lightning_vescale.engine.tensor import RaggedLayout, RaggedTensor, block_layout, is_ragged, local_tensor
from lightning_vescale.state_dict.dtype_kinds import check_dtype_kinds
from lightning_vescale.state_dict.report import listing, mismatch_report

__all__ = [
    "check_idle", "get_model_state_dict", "get_optimizer_state_dict", "model_entries", "optimizer_params",
    "set_model_state_dict", "set_optimizer_state_dict", "load_into_optimizer", "is_per_element", "optimizer_kind",
    "check_param_groups", "piece_from", "as_global", "apply_model_state", "declared_state_layout",
]

Shape = tuple[int, ...]


def check_idle(model: nn.Module) -> None:
    """The model must be between steps. A group left gathered outside a step (a forward whose output no backward
    used, as a GAN's discriminator on detached samples, or an explicit ``unshard()``) is resharded: backward gathers
    again if it comes."""
    for group in sharded_groups(model):
        gathered = any(b.state is not BufferState.SHARDED for b in group.buffers.values())
        if group.training_state is not TrainingState.IDLE or (gathered and group.awaits_backward()):
            raise RuntimeError(
                f"checkpointing needs the sharded model between steps, but the group of "
                f"{type(group.module).__name__} is in a training step (state {group.training_state.name}"
                f"{', its forward output awaits backward' if gathered else ''}). Save or load after backward and "
                f"the optimizer step, not between forward and backward."
            )
        if gathered:
            group.reshard()


def as_global(t: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """``t`` (the tensor ``owner`` or a per-element state of it) as a checkpoint stores it.

    A plain tensor declared a block of a larger tensor (``owner._vescale_global_extent``, e.g. an expert stack
    of expert parallelism without ``fully_shard``) becomes a RaggedTensor view of the larger tensor sharing
    its storage, so it is saved, loaded and exported whole; anything else is returned as it is.
    """
    extent = getattr(owner, "_vescale_global_extent", None)
    if extent is None or is_ragged(t) or is_ragged(owner) or tuple(t.shape) != tuple(owner.shape):
        return t
    return RaggedTensor(t.detach(), block_layout(owner, extent))


def model_entries(model: nn.Module, *, dedupe: bool) -> list[tuple[str, Any]]:
    """``model.state_dict()`` names and objects (parameters themselves, not detached; see :func:`as_global`),
    in its order. With ``dedupe``, a tensor used under several names (tied weights) appears once, under its
    first name.
    """
    seen: dict[int, Any] = {}
    out = []
    for name, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            if id(value) in seen:
                if dedupe:
                    continue
                out.append((name, seen[id(value)]))
                continue
            seen[id(value)] = value = as_global(value, value)
        out.append((name, value))
    return out


def get_model_state_dict(model: nn.Module) -> dict[str, Any]:
    """The model's state for ``torch.distributed.checkpoint``: every rank writes only its own pieces.

    Sharded parameters are their RaggedTensors (detached views of the DBuffer pieces), buffers and
    unsharded parameters plain tensors (replicated: DCP writes them once). Tied parameters appear once,
    under their first name. ``dcp.save(sd)`` writes it; ``dcp.load(sd)`` loads into the model in place, on
    any world size.

    Args:
        model: a model sharded with ``fully_shard`` (or an unsharded one), between training steps.
    """
    check_idle(model)
    return {n: (v.detach() if isinstance(v, torch.Tensor) else v) for n, v in model_entries(model, dedupe=True)}


def piece_from(value: Any, like: torch.Tensor, what: str) -> torch.Tensor:
    """``value`` laid out like ``like``: a RaggedTensor of ``like``'s layout, or a plain tensor of its shape.

    ``value`` may be a RaggedTensor of the same layout, or a full tensor of the global shape (each rank
    takes its piece). Raises ``ValueError`` naming ``what`` otherwise.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(like.shape):
        raise ValueError(f"{what}: the state has shape {tuple(value.shape)}, the model {tuple(like.shape)}.")
    if not is_ragged(like):
        return value.full_tensor() if is_ragged(value) else value
    if is_ragged(value):
        if value.layout_info != like.layout_info:
            raise ValueError(
                f"{what}: the state is sharded as {value.layout_info}, the model as {like.layout_info}; load a full "
                f"tensor (full_tensor()) or a checkpoint, which reshards"
            )
        return value
    return RaggedTensor.from_full(value.detach().to(like.device), like.layout_info)


@torch.no_grad()
def apply_model_state(model: nn.Module, state: Mapping[str, Any], *, dedupe: bool, strict: bool, what: str) -> None:
    """Check ``state`` against the model's entries (names, global shapes), then copy each rank's pieces.

    Everything is checked before anything is copied. Tensors shared under several names are copied
    once; non-tensor entries go to their module's ``set_extra_state``.
    """
    entries = model_entries(model, dedupe=dedupe)
    expected = {n: (tuple(v.shape) if isinstance(v, torch.Tensor) else None) for n, v in entries}
    given = {n: (tuple(v.shape) if isinstance(v, torch.Tensor) else None) for n, v in state.items()}
    if not strict:
        expected = {n: s for n, s in expected.items() if n in given}
        given = {n: s for n, s in given.items() if n in expected}
    report = mismatch_report(expected, given, ours="model", theirs="state dict")
    if report:
        raise ValueError(f"the {what} does not match the model:\n{report}\nPass the state of the same model "
                         f"(strict=False skips missing and unexpected names, never a wrong shape).")
    check_dtype_kinds(model, state, what=what)
    pieces = {}
    for name, value in entries:
        if name in given and isinstance(value, torch.Tensor):
            pieces[name] = piece_from(state[name], value, f"{what} entry {name}")
    done: set[int] = set()
    for name, value in entries:
        if name not in given or id(value) in done:
            continue
        done.add(id(value))
        if isinstance(value, torch.Tensor):
            if pieces[name] is not value and not _same_storage(pieces[name], value):
                value.detach().copy_(pieces[name])
        else:
            prefix = name[: -len(_EXTRA_STATE_KEY_SUFFIX)].rstrip(".")
            model.get_submodule(prefix).set_extra_state(state[name])


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    la, lb = local_tensor(a), local_tensor(b)
    return la.data_ptr() == lb.data_ptr() and la.dtype == lb.dtype and la.numel() == lb.numel()


def set_model_state_dict(model: nn.Module, state: Mapping[str, Any], *, strict: bool = True) -> None:
    """Copy ``state`` into the model: RaggedTensors of the model's layout, or full tensors (each rank takes
    its piece). Names and shapes are checked before anything is copied.

    Args:
        model: the sharded model, between training steps.
        state: name -> tensor, keyed like :func:`get_model_state_dict`.
        strict: require exactly the model's names (tied weights under their first name).
    """
    check_idle(model)
    apply_model_state(model, state, dedupe=True, strict=strict, what="state dict")


# --------------------------------------------------------------------------------------------------------
# Optimizer state


def optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[tuple[str, nn.Parameter]]]:
    """The optimizer's parameters by group, with their names in ``model``."""
    names = {id(p): name for name, p in model.named_parameters()}
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


def is_per_element(value: Any, p: torch.Tensor, name: str, key: str) -> bool:
    """Whether optimizer state ``value`` of ``p`` is per-element (laid out like the parameter)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    if tuple(value.shape) == tuple(p.shape) and (is_ragged(value) == is_ragged(p)):
        return True
    raise ValueError(
        f"optimizer state {key!r} of {name} is {value!r}: neither laid out like the parameter (shape "
        f"{tuple(p.shape)}) nor a scalar. Only per-element and scalar optimizer states can be checkpointed; make "
        f"per-element states with torch.zeros_like(param)."
    )


def declared_state_layout(optimizer: torch.optim.Optimizer, p: torch.Tensor, key: str) -> Any:
    """The layout ``optimizer`` declares for its state ``key`` of ``p`` when that state is not shaped like ``p``
    (``optimizer.state_layout(p, key)``: a RaggedLayout or a shape), or None (per-element and scalar states)."""
    declare = getattr(optimizer, "state_layout", None)
    return declare(p, key) if callable(declare) else None


def _check_declared(value: torch.Tensor, layout: Any, name: str, key: str) -> None:
    ragged = isinstance(layout, RaggedLayout)
    if (is_ragged(value) != ragged or (ragged and is_ragged(value) and value.layout_info != layout)
            or (not ragged and tuple(value.shape) != tuple(layout))):
        raise ValueError(f"optimizer state {key!r} of {name} is {value!r}, not laid out as its optimizer declares "
                         f"({layout})")


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def get_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state for ``torch.distributed.checkpoint``, keyed by parameter FQN.

    ``{"state": {fqn: {key: value}}, "param_groups": [{hyperparameters..., "params": [fqn, ...]}]}``.
    Per-element states are RaggedTensors of their parameter's layout; scalar tensors (``step``) and other
    values are kept as they are.

    Args:
        model: the sharded model the optimizer was built on.
        optimizer: any ``torch.optim`` optimizer whose states are per-element or scalar (AdamW, SGD, ...).
    """
    check_idle(model)
    state: dict[str, dict[str, Any]] = {}
    param_groups = []
    for group, named in zip(optimizer.param_groups, optimizer_params(model, optimizer)):
        for name, p in named:
            entries = optimizer.state.get(p)
            if not entries:
                continue
            state[name] = {}
            for key, value in entries.items():
                declared = declared_state_layout(optimizer, p, str(key)) if isinstance(value, torch.Tensor) else None
                if declared is not None:
                    value = value.detach()
                    _check_declared(value, declared, name, str(key))
                elif isinstance(value, torch.Tensor):
                    value = as_global(value.detach(), p)
                    is_per_element(value, as_global(p, p), name, str(key))  # raises for states of another layout
                state[name][str(key)] = value
        param_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": [n for n, _ in named]})
    return {"state": state, "param_groups": param_groups}


_SCHEDULER_KEYS = {"initial_lr"}  # added to param_groups by LR schedulers, not by the optimizer


def check_param_groups(
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
            problems.append(f"  param_groups[{i}] params differ: state {listing(sav)}; optimizer {listing(cur)}")
        keys, skeys = set(group) - {"params"} - _SCHEDULER_KEYS, set(sgroup) - {"params"} - _SCHEDULER_KEYS
        if check_keys and keys != skeys:
            problems.append(
                f"  param_groups[{i}] hyperparameters differ (another optimizer type?): only in the state "
                f"{sorted(skeys - keys)}, only in the optimizer {sorted(keys - skeys)}"
            )
    if problems:
        raise ValueError("the optimizer state does not match the optimizer:\n" + "\n".join(problems))


def load_into_optimizer(
    optimizer: torch.optim.Optimizer, named: list, state: Mapping[str, Mapping[str, Any]], param_groups: Sequence[Mapping]
) -> None:
    """``optimizer.load_state_dict`` from FQN-keyed ``state`` (values already laid out like their parameters).

    The optimizer's own ``load_state_dict`` runs (its dtype/device policy for ``step``, Muon's layout check),
    so the result is what the optimizer itself would have restored.
    """
    index: dict[str, int] = {}
    params: dict[str, torch.Tensor] = {}
    for group in named:
        for name, p in group:
            index[name] = len(index)
            params[name] = p
    # A plain parameter's states are plain (the RaggedTensor views of as_global share their storage).
    state = {n: {k: (local_tensor(v) if is_ragged(v) and not is_ragged(params[n]) else v) for k, v in entries.items()}
             for n, entries in state.items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n, _ in cur]}
              for g, cur in zip(param_groups, named)]
    optimizer.load_state_dict({"state": {index[n]: dict(v) for n, v in state.items()}, "param_groups": groups})


@torch.no_grad()
def set_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load ``state`` (from :func:`get_optimizer_state_dict` or :func:`export_full_optimizer_state_dict`).

    Per-element states may be RaggedTensors of the parameter's layout or full tensors of its global shape
    (each rank takes its piece). Param groups, names and shapes are checked before anything changes;
    hyperparameters are set from ``state``.
    """
    check_idle(model)
    named = optimizer_params(model, optimizer)
    check_param_groups(optimizer, named, state["param_groups"])
    raw = {n: p for g in named for n, p in g}
    params = {n: as_global(p, p) for n, p in raw.items()}
    unknown = [n for n in state["state"] if n not in params]
    if unknown:
        raise ValueError(f"the optimizer state has entries for parameters the optimizer does not hold: "
                         f"{listing(unknown)}")
    laid_out: dict[str, dict[str, Any]] = {}
    for name, entries in state["state"].items():
        p = params[name]
        laid_out[name] = {}
        for key, value in entries.items():
            declared = declared_state_layout(optimizer, raw[name], str(key)) if isinstance(value, torch.Tensor) else None
            if declared is not None:
                want = declared.global_shape if isinstance(declared, RaggedLayout) else tuple(declared)
                if tuple(value.shape) != tuple(want):
                    raise ValueError(f"optimizer state {key!r} of {name} has shape {tuple(value.shape)}; its optimizer "
                                     f"expects {tuple(want)} (saved with another block size?)")
                # Whole or laid out as declared: the optimizer's load_state_dict takes its piece.
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                if tuple(value.shape) != tuple(p.shape):
                    raise ValueError(f"optimizer state {key!r} of {name} has shape {tuple(value.shape)}; expected the "
                                     f"parameter's global shape {tuple(p.shape)} or a scalar.")
                value = piece_from(value, p, f"optimizer state {key!r} of {name}")
            laid_out[name][key] = value
    load_into_optimizer(optimizer, named, laid_out, state["param_groups"])

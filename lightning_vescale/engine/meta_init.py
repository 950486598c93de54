"""Materialize meta-device parameters of a sharded model, one group at a time.

Every rank replays the same initialization, module by module in ``model.modules()`` order — the order
in which an unsharded model's constructors (or a meta model's ``reset_parameters`` sweep) draw random
numbers — on a transient full-size buffer of the group being initialized, and keeps only its piece.
So the values are exactly those of an unsharded init with the same seed, while at most the groups
still in use by later modules (usually the root and one block) are ever whole in memory.

[Note: tied parameters at init]
A parameter tied after construction (LitGPT: ``wte.weight = lm_head.weight`` once the model exists) keeps the
values of the module that created it: an unsharded model initialized before the tie has ``lm_head``'s values in
both places. On the meta device the initialization runs only later, here, over the tied model, so each meta
parameter remembers the first module it was registered on (a parameter registration hook, meta parameters only);
every module's ``init_fn`` still runs in order (the random numbers drawn stay those of the unsharded init), but only
that first module's writes are kept, the others' go to a scratch tensor.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, cast

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from lightning_vescale.engine.fully_shard import get_state
from lightning_vescale.engine.param_group import ParamGroup, _set_param

__all__ = ["init_sharded_weights"]


def _owning_groups(root: nn.Module) -> dict[int, ParamGroup]:
    """Map id(module) -> the group that manages that module's direct parameters."""
    owner: dict[int, ParamGroup] = {}
    for m in root.modules():
        state = get_state(m)
        if state is None or state.group is None:
            continue
        for mp in state.group.managed:
            for user, _ in mp.uses:
                owner.setdefault(id(user), state.group)
    return owner


def _record_first_owner(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    # Read by init_sharded_weights (see [Note: tied parameters at init]); fully_shard copies it to the sharded one.
    if param is not None and param.is_meta and not hasattr(param, "_vescale_first_owner"):
        param._vescale_first_owner = weakref.ref(module)  # type: ignore[attr-defined]  # read with getattr


_OWNER_HOOK = register_module_parameter_registration_hook(_record_first_owner)


def _discarded_writes(owner: dict[int, ParamGroup]) -> dict[int, list[tuple[str, nn.Parameter]]]:
    """id(module) -> the (attribute, sharded parameter) of tied parameters whose values another module's init
    writes: the module that created the parameter, when it is among the users (see the note above)."""
    out: dict[int, list[tuple[str, nn.Parameter]]] = {}
    for group in {id(g): g for g in owner.values()}.values():
        for mp in group.managed:
            users = {id(u) for u, _ in mp.uses}
            creator_ref = getattr(mp.sharded, "_vescale_first_owner", None)
            creator = creator_ref() if creator_ref is not None else None
            if len(users) < 2 or creator is None or id(creator) not in users:
                continue
            for user, name in mp.uses:
                if user is not creator:
                    out.setdefault(id(user), []).append((name, mp.sharded))
    return out


def _default_init(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if reset is None:
        raise ValueError(
            f"{type(module).__name__} has parameters or buffers on the meta device but no reset_parameters(): "
            f"define reset_parameters() that initializes its own parameters and buffers, or pass "
            f"init_fn=... to init_sharded_weights"
        )
    reset()


@torch.no_grad()
def init_sharded_weights(model: nn.Module, init_fn: Optional[Callable[[nn.Module], None]] = None) -> None:
    """(Re-)initialize every parameter, and every meta-device buffer, of a sharded model.

    Use it after ``fully_shard`` on a model built on the meta device (each rank allocates only its
    pieces), or to re-initialize a sharded model. Values equal those of the unsharded model running the
    same ``init_fn`` over ``model.modules()`` in order with the same seed.

    Args:
        model: the root of the sharded model.
        init_fn: called on each module that directly holds parameters or meta buffers, in
            ``model.modules()`` order; it must initialize all of that module's own parameters and buffers.
            Defaults to ``module.reset_parameters()``.
    """
    init_fn = init_fn or _default_init
    owner = _owning_groups(model)
    modules = list(model.modules())
    # The last module index that uses each group, so a group's full buffer is dropped as soon as possible.
    last_use: dict[int, int] = {}
    for i, m in enumerate(modules):
        if id(m) in owner:
            last_use[id(owner[id(m)])] = i
    open_buffers: dict[int, dict] = {}  # id(group) -> {key: full master-dtype buffer}
    discarded = _discarded_writes(owner)
    any_device = next((g.device for g in owner.values()), torch.device("cpu"))

    # Tensor-parallel parameters: the buffer holds only this rank's tp piece, but init draws the whole tensor
    # (as the unsharded model would), and the piece is copied in when the group closes.
    tp_pieces: dict[int, list[tuple[torch.Tensor, torch.Tensor, Any]]] = {}

    def open_group(group: ParamGroup) -> None:
        if id(group) in open_buffers:
            return
        fulls = {key: buf.materialize_unsharded_for_init() for key, buf in group.buffers.items()}
        for mp in group.managed:
            # The buffer's own layout of its full values (row-major weights a quantized storage quantizes on close).
            full_view = group.buffers[mp.key].init_view(fulls[mp.key], mp.index)
            if mp.outer is not None:
                whole = torch.empty(mp.outer.global_shape, dtype=full_view.dtype, device=full_view.device)
                tp_pieces.setdefault(id(group), []).append((full_view, whole, mp.outer))
                full_view = whole
            tmp = nn.Parameter(full_view, requires_grad=mp.sharded.requires_grad)
            for user, name in mp.uses:
                _set_param(user, name, tmp)
        open_buffers[id(group)] = fulls

    def close_group(group: ParamGroup) -> None:
        for piece, whole, outer in tp_pieces.pop(id(group), []):
            piece.copy_(outer.local_slice(whole, piece.shape))
        fulls = open_buffers.pop(id(group))
        for key, buf in group.buffers.items():
            buf.finish_init(fulls[key], {mp.index: mp.sharded for mp in group.managed if mp.key == key})
        for mp in group.managed:
            group._use_sharded(mp)
        group.needs_init = False

    groups_by_id = {id(g): g for g in owner.values()}
    for i, m in enumerate(modules):
        has_meta_buffers = any(b is not None and b.is_meta for b in m._buffers.values())
        group = owner.get(id(m))
        if group is None and not has_meta_buffers:
            continue
        if has_meta_buffers:
            for name, b in list(m._buffers.items()):
                if b is not None and b.is_meta:
                    m._buffers[name] = torch.empty_like(b, device=group.device if group else any_device)
        if group is not None:
            open_group(group)
        # (the discarded names are parameters of m: their entries are not None)
        kept = [(name, cast(nn.Parameter, m._parameters[name])) for name, _ in discarded.get(id(m), [])]
        for name, full in kept:  # this module's init draws its values, the creator's are kept
            _set_param(m, name, nn.Parameter(torch.empty_like(full), requires_grad=full.requires_grad))
        init_fn(m)
        for name, full in kept:
            _set_param(m, name, full)
        if group is not None and last_use[id(group)] == i:
            close_group(group)
    for gid in list(open_buffers):
        close_group(groups_by_id[gid])


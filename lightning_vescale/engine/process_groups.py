"""The process group of a sharded model: every rank of the meshes its groups were sharded over.

Collectives that concern a whole model (checkpoint barriers, object gathers, the rank that writes metadata)
run over these ranks, never over the default group: a model sharded over a sub-mesh (sub-models placed on
different ranks) must not wait for ranks that do not hold it.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
import torch.nn as nn

__all__ = ["model_process_group", "model_ranks", "ranks_process_group"]

_CREATED: dict[tuple[int, ...], tuple[object, dist.ProcessGroup]] = {}


def _known_groups(model: nn.Module) -> list[dist.ProcessGroup]:
    from lightning_vescale.engine.fully_shard import get_state
    from lightning_vescale.engine.tensor import is_ragged

    groups = []
    for m in model.modules():
        state = get_state(m)
        if state is not None:
            groups += [state.mesh.get_group(d) for d in range(state.mesh.ndim)]
    for p in model.parameters():
        if is_ragged(p) and p.layout_info.group is not None:
            groups.append(p.layout_info.group)
    return groups


def model_ranks(model: nn.Module) -> Optional[list[int]]:
    """The global ranks holding a piece of ``model`` (its meshes' ranks, sorted); None if nothing is sharded."""
    from lightning_vescale.engine.fully_shard import get_state

    ranks: set[int] = set()
    for m in model.modules():
        state = get_state(m)
        if state is not None:
            ranks.update(int(r) for r in state.mesh.mesh.flatten().tolist())
    for g in _known_groups(model):
        ranks.update(dist.get_process_group_ranks(g))
    from lightning_vescale.engine.tensor import is_ragged

    for p in model.parameters():  # a tensor-parallel parameter's (dp, tp) mesh: every rank of it holds the model
        if is_ragged(p) and p.layout_info.outer is not None and p.layout_info.mesh is not None:
            ranks.update(int(r) for r in p.layout_info.mesh.mesh.flatten().tolist())
    return sorted(ranks) if ranks else None


def model_process_group(model: nn.Module) -> Optional[dist.ProcessGroup]:
    """A process group of exactly :func:`model_ranks` (None: the default group, when they are every rank or
    nothing is sharded). A group of the model's meshes is reused when it has those ranks; otherwise one is
    created once, by the model's ranks only (``use_local_synchronization``: the other ranks are not involved)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    ranks = model_ranks(model)
    if ranks is None or len(ranks) == dist.get_world_size():
        return None
    for g in _known_groups(model):
        if sorted(dist.get_process_group_ranks(g)) == ranks:
            return g
    return ranks_process_group(ranks)


def ranks_process_group(ranks: list[int]) -> dist.ProcessGroup:
    """A process group of exactly ``ranks`` (global ranks; its rank order is theirs sorted): the default group
    when they are every rank, else one created once by those ranks only (``use_local_synchronization``), so
    every one of them must call this with the same ranks, and no other rank needs to."""
    ranks = sorted(int(r) for r in ranks)
    world = dist.group.WORLD
    assert world is not None, "ranks_process_group needs an initialized default process group"
    if len(ranks) == dist.get_world_size():
        return world
    key = tuple(ranks)
    cached = _CREATED.get(key)
    if cached is None or cached[0] is not world:  # a group of a destroyed default group is gone with it
        _CREATED[key] = (world, dist.new_group(ranks, use_local_synchronization=True))
    return _CREATED[key][1]

"""Process-group helpers for checkpointing; everything also runs in one process without a process group.

Every collective here runs over the checkpointed model's own ranks (:func:`over` sets them for a save or a
load, from :func:`lightning_vescale.engine.process_groups.model_process_group`): ``rank()`` and ``world_size()`` are within
that group, "rank 0" is its first rank, and ranks that do not hold the model take no part.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Optional, TypeVar

import torch.distributed as dist

__all__ = [
    "agree", "barrier", "dist_on", "from_rank0", "group", "in_this_process", "local", "over", "over_model", "rank",
    "run_on_rank0",
    "world_size",
]

F = TypeVar("F", bound=Callable[..., Any])

_GROUP: ContextVar[Optional[dist.ProcessGroup]] = ContextVar("lightning_vescale_checkpoint_group", default=None)
_ALONE: ContextVar[bool] = ContextVar("lightning_vescale_checkpoint_alone", default=False)


@contextlib.contextmanager
def over(process_group: Optional[dist.ProcessGroup]) -> Iterator[None]:
    """Run the block's collectives over ``process_group`` (None: the default group)."""
    token = _GROUP.set(process_group)
    try:
        yield
    finally:
        _GROUP.reset(token)


@contextlib.contextmanager
def in_this_process() -> Iterator[None]:
    """Run the block as if no process group existed: no collective, this process is rank 0 of 1. For reads that
    one rank does alone (an export on rank 0 while the others wait elsewhere)."""
    token = _ALONE.set(True)
    try:
        yield
    finally:
        _ALONE.reset(token)


local = in_this_process
"""The same context manager (the name the checkpoint readers use)."""


def over_model(fn: F) -> F:
    """Run ``fn`` (whose argument ``model`` is a sharded model) over the model's own ranks."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from lightning_vescale.engine.process_groups import model_process_group

        model = signature.bind(*args, **kwargs).arguments["model"]
        with over(model_process_group(model)):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def group() -> Optional[dist.ProcessGroup]:
    return _GROUP.get()


def dist_on() -> bool:
    return not _ALONE.get() and dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank(group()) if dist_on() else 0


def world_size() -> int:
    return dist.get_world_size(group()) if dist_on() else 1


def barrier() -> None:
    if dist_on():
        dist.barrier(group=group())


def from_rank0(obj: Any) -> Any:
    """``obj`` as rank 0 (of the group) has it, on every rank of the group."""
    if not dist_on():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=group(), group_src=0)
    return box[0]


def all_gather_object(obj: Any) -> list:
    if not dist_on():
        return [obj]
    everyone: list = [None] * world_size()
    dist.all_gather_object(everyone, obj, group=group())
    return everyone


def agree(error: Optional[str]) -> Optional[str]:
    """Every rank's error (None if it succeeded) -> the first one, on every rank: so all ranks raise together."""
    if not dist_on():
        return error
    errors = all_gather_object(error)
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not bad:
        return None
    r, e = bad[0]
    return e if r == rank() else f"rank {r}: {e}"


def run_on_rank0(fn: Callable[[], None]) -> None:
    """Run ``fn`` on rank 0 and raise its error on every rank (no rank is left waiting in a collective)."""
    error, cause = None, None
    if rank() == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            if not dist_on():
                raise
            error, cause = f"{type(e).__name__}: {e}", e
    error = from_rank0(error)
    if error is not None:
        raise RuntimeError(f"rank 0 failed: {error}") from cause

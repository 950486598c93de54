"""Process-group helpers for checkpointing; everything also runs in one process without a process group."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch.distributed as dist

__all__ = ["agree", "barrier", "dist_on", "from_rank0", "rank", "run_on_rank0", "world_size"]


def dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if dist_on() else 0


def world_size() -> int:
    return dist.get_world_size() if dist_on() else 1


def barrier() -> None:
    if dist_on():
        dist.barrier()


def from_rank0(obj: Any) -> Any:
    """``obj`` as rank 0 has it, on every rank."""
    if not dist_on():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree(error: Optional[str]) -> Optional[str]:
    """Every rank's error (None if it succeeded) -> the first one, on every rank: so all ranks raise together."""
    if not dist_on():
        return error
    errors: list = [None] * world_size()
    dist.all_gather_object(errors, error)
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

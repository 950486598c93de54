"""Run a function on N gloo ranks in spawned processes (one process group per call).

Starting a process group costs seconds, so a test should check many things inside one call.
Each rank's exception is re-raised in the parent with the rank's traceback.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple, errors, pg_timeout) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        kwargs = {} if pg_timeout is None else {"timeout": timedelta(seconds=pg_timeout)}
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, **kwargs)
        try:
            fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent re-raises it
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1) from None


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600, pg_timeout: Optional[float] = None
) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raise if any rank fails.

    ``fn`` must be a module-level function (it is pickled for the spawned processes). ``pg_timeout``: seconds a
    collective of the default group waits for the other ranks (torch's default if None), so a test of something
    that must not wait on the default group fails in that time instead of hanging.
    """
    # forkserver: ranks fork from a clean server process that imported torch and this package once, so
    # each rank starts in a fraction of a second instead of re-importing everything (as spawn does),
    # without fork's hazards (the server runs no threads and no collectives).
    ctx = mp.get_context("forkserver")
    from tests.dist_pool import FORKSERVER_PRELOAD

    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg_init")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, errors, pg_timeout), daemon=False)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        failures = []
        while not errors.empty():
            failures.append(errors.get())
        if failures:
            # A rank that failed first makes its peers fail in their next collective: report the cause.
            secondary = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
            rank, tb = sorted(failures, key=lambda f: (any(s in f[1] for s in secondary), f[0]))[0]
            raise AssertionError(f"rank {rank} of {world_size} failed:\n{tb}")
        if alive:
            raise AssertionError(f"{len(alive)} rank(s) timed out after {timeout}s")
        bad = [p.exitcode for p in procs if p.exitcode != 0]
        if bad:
            raise AssertionError(f"ranks exited with codes {bad}")


def max_piece_diff(model: torch.nn.Module, ref: torch.nn.Module, group=None) -> float:
    """Largest difference between this rank's pieces of ``model``'s sharded parameters and the same elements
    of ``ref``'s full parameters, over every rank of ``group``."""
    import torch.distributed as dist

    ref_params = dict(ref.named_parameters())
    worst = torch.zeros(())
    for name, p in getattr(model, "module", model).named_parameters():  # unwraps Fabric's _FabricModule
        start, end = p.local_range
        if end > start:
            full = ref_params[name].detach().reshape(-1)[start:end]
            worst = torch.maximum(worst, (p.to_local().reshape(-1) - full).abs().max())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return worst.item()

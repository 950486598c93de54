"""A distributed test base: ``world_size`` gloo ranks started once per test class, one test per behaviour.

Starting a process group costs seconds, and one process group per behaviour would multiply that; one call that
checks many behaviours hides every failure after the first. :class:`DistributedTest` keeps the ranks of a class
alive across its tests: each test sends a module-level function to every rank (:meth:`DistributedTest.run_ranks`)
and fails alone, with the failing rank's traceback. A failure may leave the other ranks inside a collective, so
the pool is restarted before the next test (its cost is paid only after a failure).

For checks of initialization or planning logic, two cheaper worlds in one process: :func:`fake_world` plays one rank
of a fake ``world_size``-rank process group (torch's ``fake`` backend: collectives return at once), and
:func:`threaded_world` runs every rank as a thread of this process on torch's ``threaded`` backend (collectives
move data between the threads), for checks that the ranks agree.

Run with ``pytest -n 2 --dist loadgroup``: ``tests/conftest.py`` puts a class's tests in one pytest-xdist group
(one pool).
"""

from __future__ import annotations

import contextlib
import os
import queue
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable, ClassVar, Iterator, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["FORKSERVER_PRELOAD", "DistributedPool", "DistributedPools", "DistributedTest", "ModuleRanksTest", "fake_world", "threaded_world",
           "ranks"]

FORKSERVER_PRELOAD = ["torch", "lightning.pytorch", "lightning_vescale", "tests.dist_pool", "tests.dist_utils",
                      "tests.toy_models"]
"""What the forkserver imports once, so every rank forked from it starts with it imported. One list for every
launcher of the tests (the first to start the server decides); Lightning is in it because a third of the
distributed classes import it in their ranks (seconds each, on every rank, otherwise)."""


def _serve(rank: int, world_size: int, init_file: str, tasks, results, pg_timeout: Optional[float]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    kwargs = {} if pg_timeout is None else {"timeout": timedelta(seconds=pg_timeout)}
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, **kwargs)
    try:
        while True:
            task = tasks.get()
            if task is None:
                return
            fn, args = task
            try:
                torch.manual_seed(0)  # every test starts from the same RNG state, whatever ran before it
                fn(rank, world_size, *args)
                dist.barrier()  # a test ends when every rank is done with its collectives
                results.put((rank, None))
            except BaseException:  # noqa: BLE001 - sent to the parent, which raises it
                results.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class DistributedPool:
    """``world_size`` gloo ranks in forkserver processes that run one function at a time on every rank."""

    def __init__(self, world_size: int, pg_timeout: Optional[float] = 120) -> None:
        self.world_size, self.pg_timeout = world_size, pg_timeout
        self._procs: list = []
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        self._tmp = tempfile.TemporaryDirectory()
        init_file = os.path.join(self._tmp.name, "pg_init")
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_serve, args=(r, self.world_size, init_file, self._tasks[r], self._results,
                                             self.pg_timeout), daemon=True)
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300) -> None:
        """Call ``fn(rank, world_size, *args)`` on every rank; raise ``AssertionError`` with the first failing rank's
        traceback (a rank that failed first makes its peers fail in their next collective: that cause is shown)."""
        for tasks in self._tasks:
            tasks.put((fn, args))
        outcomes: list[tuple[int, Optional[str]]] = []
        try:
            while len(outcomes) < self.world_size:
                outcomes.append(self._results.get(timeout=timeout))
                if outcomes[-1][1] is not None:
                    # The others may wait in a collective until the process group times out: give them a moment
                    # to report a failure of their own (maybe the cause), then restart.
                    with contextlib.suppress(queue.Empty):
                        while len(outcomes) < self.world_size:
                            outcomes.append(self._results.get(timeout=2))
                    break
        except queue.Empty:
            self.restart()
            raise AssertionError(f"{self.world_size - len(outcomes)} rank(s) did not finish {fn.__name__} in "
                                 f"{timeout}s") from None
        failures = [(r, tb) for r, tb in outcomes if tb is not None]
        if failures:
            self.restart()
            secondary = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Timed out")
            rank, tb = sorted(failures, key=lambda f: (any(s in f[1] for s in secondary), f[0]))[0]
            raise AssertionError(f"rank {rank} of {self.world_size} failed:\n{tb}")

    def restart(self) -> None:
        self.close(graceful=False)
        self._start()

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for tasks in self._tasks:
                tasks.put(None)
            for p in self._procs:
                p.join(30)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        self._procs = []
        self._tmp.cleanup()


class DistributedTest:
    """Base class of a group of distributed tests sharing ``world_size`` ranks (see the module note).

    Subclasses set ``world_size`` (a class attribute, or several subclasses for several world sizes) and call
    ``self.run_ranks(fn, *args)`` with a module-level ``fn(rank, world_size, *args)``.
    """

    world_size: ClassVar[int] = 2
    pg_timeout: ClassVar[Optional[float]] = 120
    _pool: ClassVar[Optional[DistributedPool]] = None

    @pytest.fixture(scope="class", autouse=True)
    def _ranks(self, request: pytest.FixtureRequest) -> Iterator[None]:
        cls = request.cls
        cls._pool = DistributedPool(cls.world_size, cls.pg_timeout)
        yield
        cls._pool.close()
        cls._pool = None

    def run_ranks(self, fn: Callable[..., Any], *args: Any, timeout: float = 300) -> None:
        assert self._pool is not None, "run_ranks runs inside a test of the class"
        self._pool.run(fn, *args, timeout=timeout)


class DistributedPools:
    """One :class:`DistributedPool` per world size, started on first use: the ranks a module's world sizes share
    with its fixtures (a checkpoint saved on N ranks for the tests that load it on M)."""

    def __init__(self) -> None:
        self._open: dict[int, DistributedPool] = {}

    def __call__(self, world_size: int) -> DistributedPool:
        if world_size not in self._open:
            self._open[world_size] = DistributedPool(world_size)
        return self._open[world_size]

    def close(self) -> None:
        for pool in self._open.values():
            pool.close()


@pytest.fixture(scope="module")
def ranks() -> Iterator[DistributedPools]:
    """The module's ranks, per world size (``tests/conftest.py`` offers it to every module)."""
    pools = DistributedPools()
    yield pools
    pools.close()


class ModuleRanksTest(DistributedTest):
    """A :class:`DistributedTest` on the module's ranks of its world size (the ``ranks`` fixture) instead of a pool of
    its own, so a fixture of the module can run on the same ranks first."""

    @pytest.fixture(scope="class", autouse=True)
    def _ranks(self, request: pytest.FixtureRequest, ranks: DistributedPools) -> Iterator[None]:
        request.cls._pool = ranks(request.cls.world_size)
        yield
        request.cls._pool = None


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """A fake ``world_size``-rank default process group in this process, as rank ``rank``: meshes, groups and
    plans are built as on a real one, and collectives return without moving data (torch's ``fake`` backend)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def threaded_world(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` threads of this process, each the rank of a real
    ``threaded`` process group; their results by rank. A rank that raises fails the call with its traceback (its
    peers are released from their collectives)."""
    import threading

    from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup, _install_threaded_pg

    world = _install_threaded_pg()
    store = dist.HashStore()
    results: list[Any] = [None] * world_size
    failures: list[tuple[int, str]] = []

    def rank_main(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        try:
            results[rank] = fn(rank, world_size, *args)
        except BaseException as error:  # noqa: BLE001 - reported with its rank below
            failures.append((rank, traceback.format_exc()))
            ProcessLocalGroup.exception_handle(error)  # wakes the peers waiting in a collective
        finally:
            if world == dist.distributed_c10d._world:
                dist.destroy_process_group()

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    try:
        threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank{r}") for r in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        if any(t.is_alive() for t in threads):
            raise AssertionError(f"rank threads did not finish {fn.__name__} in {timeout:.0f} s")
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        ProcessLocalGroup.reset()
    if failures:
        rank, tb = failures[0]  # the first to fail: its peers fail after it, released from their collectives
        raise AssertionError(f"rank {rank} of {world_size} failed:\n{tb}")
    return results

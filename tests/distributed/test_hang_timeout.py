"""A stopped peer: the other ranks fail within the configured timeout, naming their rank and the collective.

One rank stops itself with SIGSTOP (as a debugger, a swapped-out VM or a stuck filesystem would stop it);
the others must not wait for torch's 30-minute default but fail after ``timeout`` with a
:class:`~lightning_vescale.engine.collectives.CollectiveError`. The ranks run in processes of their own (the
stopped one is killed at the end), so this file has its own small launcher instead of ``run_distributed``.
Without the timeout reaching the process groups, the waiting ranks would outlive the launcher's join
limit and the test fails.
"""

from __future__ import annotations

import os
import signal
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = timedelta(seconds=10)  # long enough for ranks starting on a loaded machine, short for a test
JOIN_S = 240  # far below torch's 30-minute default, far above TIMEOUT plus start-up


def _child(rank: int, world: int, env: dict[str, str], fn: Callable, results) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    torch.set_num_threads(1)
    try:
        fn(rank, world)
        results.put((rank, "ok"))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        results.put((rank, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


def run_with_stopped_rank(fn: Callable[[int, int], Any], world: int, stopped: int) -> dict[int, str]:
    """Run ``fn(rank, world)`` on ``world`` processes, of which rank ``stopped`` stops itself; return what the
    other ranks reported ("ok" or their error). The stopped rank is killed once the others are done."""
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "lightning_vescale", "tests.distributed.test_hang_timeout"])
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_network_port()), "OMP_NUM_THREADS": "1",
               "PG_INIT_FILE": os.path.join(tmp, "pg_init")}
        procs = [ctx.Process(target=_child, args=(r, world, env, fn, results)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            for r, p in enumerate(procs):
                if r != stopped:
                    p.join(JOIN_S)
            waiting = [r for r, p in enumerate(procs) if r != stopped and p.is_alive()]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()  # SIGKILL ends a stopped process too
                    p.join()
        reports = {}
        while not results.empty():
            rank, report = results.get()
            reports[rank] = report
    assert not waiting, f"ranks {waiting} still waited after {JOIN_S}s: the timeout did not reach their process group"
    return reports


def _stop_here() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


# --------------------------------------------------------------------------------------------------------
# The Trainer strategy creates the process group with strategy timeout


def _trainer_rank(rank: int, world: int) -> None:
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_vescale.lightning import VeScaleStrategy

    class Stops(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))

        def training_step(self, batch, batch_idx: int) -> torch.Tensor:
            if batch_idx == 1 and self.global_rank == 1:
                _stop_here()
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 2))
    trainer = Trainer(strategy=VeScaleStrategy(timeout=TIMEOUT), accelerator="cpu", devices=world, max_steps=4,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Stops(), DataLoader(data, batch_size=4))


def test_a_stopped_peer_stops_training_with_the_rank_and_the_collective() -> None:
    reports = run_with_stopped_rank(_trainer_rank, 2, stopped=1)
    assert set(reports) == {0}, reports
    # Rank 0 waits in the next AllGather of forward (or the ReduceScatter of backward) for rank 1.
    assert reports[0].startswith("CollectiveError: rank 0: collective '"), reports[0]
    assert "over ranks [0, 1] failed" in reports[0] and "Timed out" in reports[0], reports[0]
    assert "another rank of the group ([1]) stopped, crashed or fell behind" in reports[0], reports[0]
    assert "raise the timeout" in reports[0], reports[0]


# --------------------------------------------------------------------------------------------------------
# HSDP: the groups the mesh creates carry the timeout too (torch gives new groups its 30-minute default)


def _hsdp_mesh_rank(rank: int, world: int) -> None:
    from lightning_vescale.engine import collectives
    from lightning_vescale.lightning._common import build_mesh

    # The default group waits long, so only the mesh's own groups can end the wait within the test.
    dist.init_process_group("gloo", init_method=f"file://{os.environ['PG_INIT_FILE']}", rank=rank,
                            world_size=world, timeout=timedelta(minutes=30))
    mesh = build_mesh(torch.device("cpu"), world, 2, timeout=TIMEOUT)
    shard = mesh["shard"].get_group()  # ranks [0, 1] and [2, 3]
    if rank == 3:
        _stop_here()
    out = torch.empty(4)
    collectives.all_gather_into_tensor(out, torch.full((2,), float(rank)), shard, async_op=True).wait()
    assert out.tolist() == [rank - rank % 2] * 2 + [rank - rank % 2 + 1] * 2


def test_hsdp_mesh_groups_fail_within_the_timeout() -> None:
    reports = run_with_stopped_rank(_hsdp_mesh_rank, 4, stopped=3)
    assert reports[0] == reports[1] == "ok", reports
    assert reports[2].startswith("CollectiveError: rank 2: collective 'all_gather' over ranks [2, 3] failed"), reports[2]
    assert "another rank of the group ([3])" in reports[2], reports[2]


# --------------------------------------------------------------------------------------------------------
# Lightning's own collectives through the strategies (barrier, broadcast, reduce) and the recipes' SIGTERM
# agreement name themselves too


def _sigterm_connector():
    """The recipes' SIGTERM connector on a stand-in Trainer at batch 0 (its agreement is one all-reduce)."""
    from types import SimpleNamespace

    from lightning_vescale.lightning._signals import _DeferredSigtermConnector

    trainer = SimpleNamespace(fit_loop=SimpleNamespace(total_batch_idx=0),
                              strategy=SimpleNamespace(root_device=torch.device("cpu")))
    return _DeferredSigtermConnector(trainer)


def _lightning_collectives_rank(rank: int, world: int) -> None:
    from lightning_vescale.engine.collectives import CollectiveError
    from lightning_vescale.lightning import VeScaleFabricStrategy, VeScaleStrategy

    dist.init_process_group("gloo", init_method=f"file://{os.environ['PG_INIT_FILE']}", rank=rank,
                            world_size=world, timeout=TIMEOUT)
    if rank == 1:
        _stop_here()
    # The first call times out; the others fail at once on the broken connection, still naming themselves.
    calls = {
        "all_reduce (SIGTERM agreement)": lambda: _sigterm_connector().agree(),  # issue 25
        "barrier (Lightning)": lambda: VeScaleStrategy().barrier(),
        "broadcast (Lightning)": lambda: VeScaleFabricStrategy().broadcast("x"),
        "reduce (Lightning)": lambda: VeScaleStrategy().reduce(torch.ones(1)),
        "all_reduce (Lightning)": lambda: VeScaleFabricStrategy().all_reduce(torch.ones(1)),
    }
    for kind, call in calls.items():
        try:
            call()
        except CollectiveError as err:
            assert str(err).startswith(f"rank 0: collective '{kind}' over ranks [0, 1] failed"), str(err)  # noqa: PT017 - pytest.raises is not available in the spawned rank's loop
        else:
            raise AssertionError(f"{kind} returned although rank 1 is stopped")


def test_lightning_collectives_of_the_strategies_name_themselves() -> None:
    assert run_with_stopped_rank(_lightning_collectives_rank, 2, stopped=1) == {0: "ok"}

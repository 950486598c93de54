"""The strategies across repeated runs in one process, and resuming from the ``.old`` fallback.

One class of tests sharing 2 gloo ranks (:class:`tests.dist_pool.DistributedTest`), one test per behaviour:

* repeated HSDP ``Trainer.fit`` calls add no process groups, file descriptors or threads after the first;
* repeated HSDP Fabric launches add none either;
* ``Trainer.fit(ckpt_path=p)`` resumes from ``p.old`` when a save crashed between its renames (as
  ``checkpoint.load`` does).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

import lightning_vescale.lightning  # noqa: F401 - registers strategy="vescale"
from lightning_vescale.lightning import VeScaleFabricStrategy, VeScaleStrategy
from tests.dist_pool import DistributedTest

FITS = 4


class Regressor(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        self.first_step = None

    def on_train_start(self) -> None:
        self.first_step = self.trainer.global_step

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 2, generator=g)), batch_size=4)


def _trainer(world: int, max_steps: int, **strategy_kwargs) -> Trainer:
    return Trainer(strategy=VeScaleStrategy(**strategy_kwargs), accelerator="cpu", devices=world, max_steps=max_steps,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _resources() -> tuple[int, int, int]:
    """(process groups, open file descriptors, threads) of this process."""
    groups = len(dist.distributed_c10d._world.pg_map)
    return groups, len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def _repeated_fits_hold_no_new_resources(rank: int, world: int) -> None:
    seen = []
    for _ in range(FITS):
        # replicate_size=2 on 2 ranks: a (2, 1) mesh, whose shard dimension is a group of its own per rank.
        _trainer(world, 2, replicate_size=2).fit(Regressor(), _data())
        seen.append(_resources())
    assert seen[1:] == seen[:1] * (FITS - 1), f"(groups, fds, threads) after each fit: {seen}"


def _repeated_fabric_launches_hold_no_new_resources(rank: int, world: int) -> None:
    seen = []
    for _ in range(FITS):
        fabric = Fabric(strategy=VeScaleFabricStrategy(replicate_size=2), accelerator="cpu", devices=world)
        fabric.launch()
        model = fabric.setup_module(torch.nn.Linear(4, 2))
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
        fabric.backward(model(torch.randn(3, 4)).sum())
        optimizer.step()
        seen.append(_resources())
    assert seen[1:] == seen[:1] * (FITS - 1), f"(groups, fds, threads) after each launch: {seen}"


def _resume_from_the_old_fallback(rank: int, world: int, tmp: str) -> None:
    path = os.path.join(tmp, "step-2.ckpt")
    trainer = _trainer(world, 2)
    trainer.fit(Regressor(), _data())
    trainer.save_checkpoint(path)
    if rank == 0:
        os.rename(path, f"{path}.old")  # a save that crashed after moving the previous checkpoint aside
    dist.barrier()
    resumed = Regressor()
    _trainer(world, 4).fit(resumed, _data(), ckpt_path=path)
    assert resumed.first_step == 2


class TestStrategyLifecycle(DistributedTest):
    """Repeated runs in the same 2 ranks."""

    world_size = 2

    def test_repeated_hsdp_trainer_fits_hold_no_new_resources(self) -> None:
        self.run_ranks(_repeated_fits_hold_no_new_resources)

    def test_repeated_hsdp_fabric_launches_hold_no_new_resources(self) -> None:
        self.run_ranks(_repeated_fabric_launches_hold_no_new_resources)

    def test_fit_resumes_from_the_old_fallback_of_a_crashed_save(self, tmp_path) -> None:
        self.run_ranks(_resume_from_the_old_fallback, str(tmp_path))

"""Pieces of the recipe runner that need no processes: the precision it announces, the resumable data order."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from lightning_vescale.data import TextDataModule
from lightning_vescale.lightning import VeScalePrecision, VeScaleStrategy
from lightning_vescale.recipe import precision_line, trainer_precision


def _trainer_log(caplog, **kwargs) -> str:
    caplog.clear()
    with caplog.at_level(logging.INFO):
        Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, **kwargs)
    return caplog.text


def test_bf16_mixed_under_vescale_is_announced_as_what_runs(caplog):
    strategy = VeScaleStrategy()
    args = trainer_precision(strategy, "bf16-mixed")
    assert "Automatic Mixed Precision" not in _trainer_log(caplog, strategy=strategy, **args)
    assert isinstance(args["plugins"][0], VeScalePrecision) and args["plugins"][0].precision == "bf16-mixed"
    line = precision_line(strategy, "bf16-mixed")
    assert "no autocast" in line and "fp32 master weights" in line
    # The line Lightning prints for precision="bf16-mixed" itself (what the recipe avoids under vescale) ...
    assert "Automatic Mixed Precision" in _trainer_log(caplog, strategy=VeScaleStrategy(), precision="bf16-mixed")
    # ... is true under DDP, where Lightning's autocast runs.
    assert trainer_precision(DDPStrategy(), "bf16-mixed") == {"precision": "bf16-mixed"}
    assert "autocast" in precision_line(DDPStrategy(), "bf16-mixed")


@pytest.fixture(scope="module")
def datamodule() -> TextDataModule:
    dm = TextDataModule(seq_len=32, batch_size=4, seed=1234)
    dm.setup()
    return dm


def test_train_loader_under_a_distributed_strategy_is_stateful_with_lightnings_order(datamodule):
    trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 1}),
                              world_size=2)
    datamodule.trainer = trainer
    try:
        loader = datamodule.train_dataloader()
    finally:
        datamodule.trainer = None
    assert isinstance(loader, StatefulDataLoader) and isinstance(loader.sampler, StatefulDistributedSampler)
    # Lightning's own sampler would have been DistributedSampler(seed=PL_GLOBAL_SEED): the same windows, in order.
    reference = DistributedSampler(datamodule.train_set, num_replicas=2, rank=1, shuffle=True, seed=1234)
    assert list(loader.sampler) == list(reference)
    # A loader restored from a state continues where the first one was, whatever the global RNG says.
    first = iter(loader)
    [next(first) for _ in range(3)]
    state, expected = loader.state_dict(), [next(first)[0] for _ in range(2)]
    datamodule.trainer = trainer
    try:
        restored = datamodule.train_dataloader()
    finally:
        datamodule.trainer = None
    restored.load_state_dict(state)
    torch.manual_seed(99)
    got = iter(restored)
    assert all(torch.equal(next(got)[0], want) for want in expected)


def test_train_loader_in_one_process_resumes_exactly(datamodule):
    loader = datamodule.train_dataloader()
    assert isinstance(loader, StatefulDataLoader)
    it = iter(loader)
    [next(it) for _ in range(3)]
    state, expected = loader.state_dict(), [next(it)[0] for _ in range(2)]
    restored = datamodule.train_dataloader()
    restored.load_state_dict(state)
    torch.manual_seed(7)
    got = iter(restored)
    assert all(torch.equal(next(got)[0], want) for want in expected)

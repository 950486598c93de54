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


# ---------------------------------------------------------------------------------------------------------
# What a run prints


def _fit_with_bar(capsys, *, max_steps: int, batches_per_epoch: int) -> str:
    from lightning.pytorch import LightningModule

    from lightning_vescale.recipe.callbacks import RecipeProgressBar

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            loss = self.layer(batch[0]).pow(2).mean()
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            data = torch.utils.data.TensorDataset(torch.randn(batches_per_epoch * 2, 2))
            return torch.utils.data.DataLoader(data, batch_size=2)

    capsys.readouterr()
    Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_model_summary=False,
            max_steps=max_steps, limit_val_batches=0, callbacks=[RecipeProgressBar()]).fit(Module())
    return capsys.readouterr().out


def test_the_progress_bar_counts_optimizer_steps_of_max_steps_and_prints_its_end_once(capsys):
    out = _fit_with_bar(capsys, max_steps=7, batches_per_epoch=3)  # three epochs
    states = [s.strip() for s in out.replace("\n", "\r").split("\r") if s.strip().startswith("train:")]
    assert states and all("/7 [" in s for s in states), states  # never an epoch's 3 batches
    assert "Epoch" not in out
    assert [int(s.split("|")[2].split("/")[0]) for s in states] == sorted(
        int(s.split("|")[2].split("/")[0]) for s in states)  # it never goes back to 0 at an epoch
    assert "7/7" in states[-1] and "loss=" in states[-1]
    assert out.count("\n") == 1  # the bar's last line, once
    loss = states[-1].split("loss=")[1].split(",")[0].split("]")[0]
    assert len(loss.split(".")[1]) == 4  # four decimals, always


def test_lightnings_cloud_logger_tip_and_pytree_deprecation_are_not_printed():
    import warnings

    from lightning.pytorch.utilities._pytree import _tree_flatten

    from lightning_vescale.recipe.logs import tidy_lightning_output as _tidy_lightning_output

    tip = logging.LogRecord("lightning.pytorch.utilities.rank_zero", logging.INFO, __file__, 1,
                            "💡 Tip: For seamless cloud logging, try installing [litlogger](...)", None, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _tree_flatten(1.0)
        if not any("LeafSpec" in str(w.message) for w in caught):
            pytest.skip("this torch does not deprecate LeafSpec (torch 2.13 does, and Lightning 2.6 uses it)")
        caught.clear()
        _tidy_lightning_output()
        _tree_flatten(1.0)
        assert not any("LeafSpec" in str(w.message) for w in caught)
    assert not logging.getLogger("lightning.pytorch.utilities.rank_zero").filter(tip)


def test_numbers_are_printed_in_readable_units():
    from lightning_vescale.recipe.numbers import format_bytes, format_count, format_loss

    assert format_bytes(1_024_620) == "0.977 MiB" and format_bytes(575_488) == "562 KiB"
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.50 KiB" and format_bytes(517 * 2**20) == "517 MiB"
    assert format_count(671_026_404_352) == "671B" and format_count(1_235_814_400) == "1.24B"
    assert format_count(1_240_000) == "1.24M" and format_count(106_816) == "107K" and format_count(999) == "999"
    assert format_loss(6.08) == "6.0800" and format_loss(0.49231) == "0.4923"


@pytest.mark.parametrize("new_world", [1, 3])
def test_a_data_position_saved_on_two_ranks_resumes_on_another_world_size(datamodule, new_world):
    from lightning_vescale.data.datamodule import ResumableDistributedSampler

    data = datamodule.train_set
    saved = [ResumableDistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=7) for r in range(2)]
    drawn = []
    for sampler in saved:
        it = iter(sampler)
        drawn += [next(it) for _ in range(12)]
    state = saved[0].state_dict()
    assert state == {"yielded": 12, "num_replicas": 2}
    resumed = [ResumableDistributedSampler(data, num_replicas=new_world, rank=r, shuffle=True, seed=7)
               for r in range(new_world)]
    rest = []
    for sampler in resumed:
        sampler.load_state_dict(state)
        rest += list(sampler)
    epoch = list(ResumableDistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=7))
    assert sorted(drawn) == sorted(epoch[:24]), "two ranks drew the permutation's first 24 windows"
    # None of the windows drawn before, but DistributedSampler's padding (the epoch's first windows again, to make
    # every rank's share equal): fewer than new_world.
    assert len(set(rest) & set(drawn)) < new_world, "the resumed ranks skip the windows drawn before the checkpoint"
    assert set(rest) | set(drawn) == set(epoch), "and together they cover the epoch"

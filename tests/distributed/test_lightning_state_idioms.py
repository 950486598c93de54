"""The Trainer's state idioms under ``strategy="vescale"`` give what ``strategy="ddp"`` gives for the same calls.

Each idiom is one test on 2 gloo ranks (``tests.dist_pool.DistributedTest``, sharing the ranks): a GAN-style
LightningModule (manual optimization, two optimizers, noise drawn from the global RNG) trained with DDP and with the
engine, each rank checking:

* the two-optimizer training equals DDP's;
* ``trainer.save_checkpoint`` saves both optimizers, and resuming with ``restore_rng_states=True`` equals the
  uninterrupted run;
* resuming with the defaults draws the same noise as DDP resuming from its own checkpoint (neither restores the
  global RNG: Lightning's strategies save none);
* ``LightningModule.load_from_checkpoint`` of the engine's checkpoint directory gives the weights and
  hyperparameters DDP's ``.ckpt`` gives;
* ``fit(ckpt_path=<a .ckpt written by DDP>)`` continues like DDP continuing from it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

import lightning_vescale.lightning  # noqa: F401 - registers strategy="vescale"
from lightning_vescale.engine.tensor import is_ragged
from lightning_vescale.lightning import ProcessGroupEnvironment, VeScaleStrategy
from tests.dist_pool import DistributedTest


class GAN(LightningModule):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 7))
        self.discriminator = nn.Sequential(nn.Linear(7, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.losses: list[float] = []
        self.noise: list[float] = []

    def training_step(self, batch, batch_idx):
        g_opt, d_opt = self.optimizers()
        (real,) = batch
        z = torch.randn(real.shape[0], 4)  # the global RNG, as GAN examples draw it
        self.noise.append(z.sum().item())
        fake = self.generator(z)
        d_loss = F.softplus(-self.discriminator(real)).mean() + F.softplus(self.discriminator(fake.detach())).mean()
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        g_loss = F.softplus(-self.discriminator(fake)).mean()
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        for loss in (d_loss, g_loss):
            self.losses.append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())

    def configure_optimizers(self):
        return (torch.optim.Adam(self.generator.parameters(), lr=1e-2),
                torch.optim.Adam(self.discriminator.parameters(), lr=2e-2, betas=(0.5, 0.9)))

    def train_dataloader(self):
        g = torch.Generator().manual_seed(3)
        # Its own generator: a loader without one draws its iterator's seed from the global RNG when a (resumed)
        # epoch starts, which the uninterrupted run did not do at that point.
        # Every sample the same: Lightning restarts an interrupted epoch from its first (shuffled) batch, as the
        # loader keeps no position, so only then does a resumed run see what the uninterrupted one saw.
        return DataLoader(TensorDataset(torch.randn(1, 7, generator=g).repeat(64, 1)), batch_size=4,
                          generator=torch.Generator().manual_seed(4))


def _strategy(name: str, **kwargs: Any):
    if name == "ddp":
        # The discriminator's backward leaves the generator's parameters without gradients.
        return DDPStrategy(cluster_environment=ProcessGroupEnvironment(), find_unused_parameters=True)
    return VeScaleStrategy(**kwargs)


def _fit(strategy, *, max_steps: int, ckpt_path=None) -> tuple[GAN, Trainer]:
    seed_everything(0)
    module = GAN()
    seed_everything(1)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=dist.get_world_size(), max_steps=max_steps,
                      logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, ckpt_path=ckpt_path)
    # The comparisons mean something only if the engine's runs are sharded (DDP's are not).
    sharded = isinstance(strategy, VeScaleStrategy)
    assert all(is_ragged(p) == sharded for p in module.parameters()), (type(strategy).__name__, sharded)
    return module, trainer


def _close(a: list[float], b: list[float], tol: float = 1e-5) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(a, b))


def _full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in module.state_dict().items()}


# -- the idioms: each returns {name: value} compared in its test ----------------------------------------------


def two_optimizers_train_like_ddp(tmp: str) -> dict:
    ref, _ = _fit(_strategy("ddp"), max_steps=4)
    mine, _ = _fit(_strategy("vescale"), max_steps=4)
    return {"max_rel_diff": _close(mine.losses, ref.losses), "steps": len(mine.losses)}


def save_checkpoint_keeps_both_optimizers(tmp: str) -> dict:
    whole, _ = _fit(_strategy("vescale"), max_steps=8)
    half, trainer = _fit(_strategy("vescale"), max_steps=4)
    path = os.path.join(tmp, "gan_vescale.ckpt")
    trainer.save_checkpoint(path)
    resumed, _ = _fit(_strategy("vescale", restore_rng_states=True), max_steps=8, ckpt_path=path)
    return {"max_rel_diff": _close(resumed.losses, whole.losses[len(half.losses):]),
            "noise_diff": _close(resumed.noise, whole.noise[len(half.noise):])}


def resume_leaves_the_global_rng_like_ddp(tmp: str) -> dict:
    ddp_path, mine_path = os.path.join(tmp, "rng_ddp.ckpt"), os.path.join(tmp, "rng_vescale.ckpt")
    _, trainer = _fit(_strategy("ddp"), max_steps=2)
    trainer.save_checkpoint(ddp_path)
    _, trainer = _fit(_strategy("vescale"), max_steps=2)
    trainer.save_checkpoint(mine_path)
    ref, _ = _fit(_strategy("ddp"), max_steps=4, ckpt_path=ddp_path)
    mine, _ = _fit(_strategy("vescale"), max_steps=4, ckpt_path=mine_path)
    return {"noise_diff": _close(mine.noise, ref.noise), "max_rel_diff": _close(mine.losses, ref.losses)}


def load_from_checkpoint_of_a_sharded_directory(tmp: str) -> dict:
    ddp_path, mine_path = os.path.join(tmp, "load_ddp.ckpt"), os.path.join(tmp, "load_vescale.ckpt")
    _, trainer = _fit(_strategy("ddp"), max_steps=3)
    trainer.save_checkpoint(ddp_path)
    _, trainer = _fit(_strategy("vescale"), max_steps=3)
    trainer.save_checkpoint(mine_path)
    assert os.path.isdir(mine_path), "the engine saves a sharded directory"
    want = GAN.load_from_checkpoint(ddp_path)
    got = GAN.load_from_checkpoint(mine_path)
    diff = max((got.state_dict()[k] - v).abs().max().item() for k, v in want.state_dict().items())
    return {"max_rel_diff": diff, "hparams_equal": float(dict(got.hparams) == dict(want.hparams)),
            "same_keys": float(sorted(got.state_dict()) == sorted(want.state_dict()))}


def fit_resumes_from_a_ddp_checkpoint_file(tmp: str) -> dict:
    path = os.path.join(tmp, "from_ddp.ckpt")
    _, trainer = _fit(_strategy("ddp"), max_steps=3)
    trainer.save_checkpoint(path)
    ref, _ = _fit(_strategy("ddp"), max_steps=6, ckpt_path=path)
    mine, trainer = _fit(_strategy("vescale"), max_steps=6, ckpt_path=path)
    return {"max_rel_diff": _close(mine.losses, ref.losses), "global_step": trainer.global_step}


def _two_optimizers(rank: int, world: int, tmp: str) -> None:
    v = two_optimizers_train_like_ddp(tmp)
    assert v["steps"] >= 4 and v["max_rel_diff"] <= 1e-5, v


def _save_checkpoint_keeps_both_optimizers(rank: int, world: int, tmp: str) -> None:
    v = save_checkpoint_keeps_both_optimizers(tmp)
    assert v["noise_diff"] == 0.0, f"restore_rng_states=True must continue the global RNG exactly: {v}"
    assert v["max_rel_diff"] <= 1e-6, f"the resumed run differs from the uninterrupted one: {v}"


def _resume_leaves_the_global_rng(rank: int, world: int, tmp: str) -> None:
    v = resume_leaves_the_global_rng_like_ddp(tmp)
    assert v["noise_diff"] == 0.0, f"the resumed run draws other noise than DDP's resume: {v}"
    assert v["max_rel_diff"] <= 1e-5, v


def _load_from_checkpoint(rank: int, world: int, tmp: str) -> None:
    v = load_from_checkpoint_of_a_sharded_directory(tmp)
    assert v["same_keys"] == 1.0 and v["hparams_equal"] == 1.0, v
    assert v["max_rel_diff"] <= 1e-5, v


def _fit_resumes_from_ddp(rank: int, world: int, tmp: str) -> None:
    v = fit_resumes_from_a_ddp_checkpoint_file(tmp)
    assert v["global_step"] >= 6 and v["max_rel_diff"] <= 1e-5, v


class TestTrainerIdiomsMatchDDP(DistributedTest):
    world_size = 2
    pg_timeout = 180

    def test_two_optimizers_train_like_ddp(self, tmp_path) -> None:
        self.run_ranks(_two_optimizers, str(tmp_path))

    def test_save_checkpoint_keeps_both_optimizers(self, tmp_path) -> None:
        self.run_ranks(_save_checkpoint_keeps_both_optimizers, str(tmp_path))

    def test_resume_leaves_the_global_rng_like_ddp(self, tmp_path) -> None:
        self.run_ranks(_resume_leaves_the_global_rng, str(tmp_path))

    def test_load_from_checkpoint_of_a_sharded_directory(self, tmp_path) -> None:
        self.run_ranks(_load_from_checkpoint, str(tmp_path))

    def test_fit_resumes_from_a_ddp_checkpoint_file(self, tmp_path) -> None:
        self.run_ranks(_fit_resumes_from_ddp, str(tmp_path))

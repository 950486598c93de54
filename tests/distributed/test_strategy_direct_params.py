"""A LightningModule that owns parameters directly (a CLS token, a learned position embedding) trains under
``strategy="vescale"`` exactly as under ``strategy="ddp"``, unchanged: the parameters no child holds go into
the LightningModule's own group (FSDP2's root group), gathered around each step.

One class of tests sharing 2 gloo ranks (:class:`tests.dist_pool.DistributedTest`), one test per behaviour, each
fitting 6 steps with accumulation and clipping:

* the layout: every parameter sharded, ``cls`` and ``pos`` in the LightningModule's own group, full shapes;
* the losses, gradient norms and validation loss against DDP (1e-5: reductions run in other orders);
* a checkpoint resume from the end of the first epoch against the uninterrupted run (1e-6);
* the same module with its children built on the meta device in ``configure_model``, against DDP (1e-5).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_vescale.engine.fully_shard import get_state, sharded_groups
from lightning_vescale.engine.tensor import is_ragged
from tests.dist_pool import DistributedTest
from tests.distributed.test_lightning_strategy import Recorder, assert_close, ddp, fit
from tests.toy_models import Block

VOCAB, SEQ, DIM, CLASSES = 32, 6, 16, 5
CLIP = 0.05


class Sequences(Dataset):
    """Random token sequences and a class label each, from a private generator."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.y = torch.randint(0, CLASSES, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class DirectParams(Recorder):
    """A ViT-style classifier: ``cls`` and ``pos`` are registered on the LightningModule itself and used in
    ``training_step`` (no ``forward`` call), as a DDP user would write it."""

    def __init__(self, build_in_configure_model: bool = False) -> None:
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, DIM) * 0.5)
        self.pos = nn.Parameter(torch.randn(SEQ + 1, DIM) * 0.5)
        self.build_in_configure_model = build_in_configure_model
        self.embed = self.blocks = self.head = None
        if not build_in_configure_model:
            self._build()

    def _build(self) -> None:
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM, n_heads=2) for _ in range(2))
        self.head = nn.Linear(DIM, CLASSES)

    def configure_model(self) -> None:
        if self.build_in_configure_model and self.embed is None:
            self._build()

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        h = torch.cat([self.cls.expand(len(x), -1, -1), self.embed(x)], dim=1) + self.pos
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h[:, 0]), y)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.record(loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(Sequences(64, seed=1), batch_size=4, shuffle=True)

    def val_dataloader(self):
        return DataLoader(Sequences(16, seed=2), batch_size=4)


COMMON = dict(max_steps=6, accumulate_grad_batches=2, gradient_clip_val=CLIP, val_check_interval=4)


def _own_parameters_in_the_root_group(rank: int, world: int) -> None:
    """Every parameter is sharded; cls and pos are in the LightningModule's own group."""
    mine, _ = fit(DirectParams, "vescale", **COMMON)
    assert all(is_ragged(p) for p in mine.parameters())
    own = get_state(mine).group
    assert sorted(mp.fqn for mp in own.managed) == ["cls", "pos"]
    assert len(sharded_groups(mine)) == 5, "2 blocks + embed + head + the LightningModule's own group"
    assert mine.cls.shape == (1, 1, DIM) and mine.pos.shape == (SEQ + 1, DIM)  # the full shapes, not pieces
    pieces = torch.tensor([mine.cls.to_local().numel() + mine.pos.to_local().numel()])
    dist.all_reduce(pieces)
    assert pieces.item() == DIM + (SEQ + 1) * DIM


def _trains_like_ddp(rank: int, world: int) -> None:
    ref, ref_trainer = fit(DirectParams, ddp(), **COMMON)
    mine, trainer = fit(DirectParams, "vescale", **COMMON)

    # Same losses (every micro-batch), gradient norms (clipping active) and validation loss as DDP.
    assert len(mine.losses) == 12 and len(mine.norms) == 6
    assert_close(mine.losses, ref.losses, 1e-5, "losses vs DDP")
    assert_close(mine.norms, ref.norms, 1e-5, "gradient norms vs DDP")
    assert max(ref.norms) > CLIP
    want = ref_trainer.callback_metrics["val_loss"].item()
    assert abs(trainer.callback_metrics["val_loss"].item() - want) < 1e-5


def _resume_equals_uninterrupted(rank: int, world: int, tmp: str) -> None:
    """A resume from step 4, the end of the first epoch (cls and pos in the sharded checkpoint), equals the
    uninterrupted run."""
    saver = ModelCheckpoint(dirpath=os.path.join(tmp, "ckpt"), every_n_train_steps=4, save_top_k=-1)
    mine, _ = fit(DirectParams, "vescale", callbacks=[saver], **COMMON)
    ckpt = os.path.join(tmp, "ckpt", "epoch=0-step=4.ckpt")
    assert os.path.isdir(ckpt), sorted(os.listdir(os.path.join(tmp, "ckpt")))
    resumed, _ = fit(DirectParams, "vescale", init_seed=123, ckpt_path=ckpt, **COMMON)
    assert_close(resumed.losses, mine.losses[8:], 1e-6, "resumed vs uninterrupted")


def _configure_model_children_train_like_ddp(rank: int, world: int) -> None:
    """Children built on the meta device in configure_model, cls and pos real from __init__: same as DDP."""
    ref_cm, _ = fit(lambda: DirectParams(build_in_configure_model=True), ddp(), **COMMON)
    mine_cm, _ = fit(lambda: DirectParams(build_in_configure_model=True), "vescale", **COMMON)
    assert not any(p.is_meta for p in mine_cm.parameters())
    assert_close(mine_cm.losses, ref_cm.losses, 1e-5, "configure_model children vs DDP")


class TestDirectParameters(DistributedTest):
    """A LightningModule with parameters of its own, on 2 ranks."""

    world_size = 2

    def test_its_own_parameters_are_sharded_in_the_lightning_modules_group(self) -> None:
        self.run_ranks(_own_parameters_in_the_root_group)

    def test_losses_gradient_norms_and_validation_equal_ddp(self) -> None:
        self.run_ranks(_trains_like_ddp)

    def test_resume_from_the_end_of_the_first_epoch_equals_uninterrupted_training(self, tmp_path) -> None:
        self.run_ranks(_resume_equals_uninterrupted, str(tmp_path))

    def test_children_built_in_configure_model_train_like_ddp(self) -> None:
        self.run_ranks(_configure_model_children_train_like_ddp)

"""A LightningModule that owns parameters directly (a CLS token, a learned position embedding) trains under
``strategy="vescale"`` exactly as under ``strategy="ddp"``, unchanged: the parameters no child holds go into
the LightningModule's own group (FSDP2's root group), gathered around each step.

One process group (2 gloo ranks) runs every check: losses and gradient norms against DDP with accumulation
and clipping, validation, a checkpoint resume, and the same module with its children built on the meta
device in ``configure_model``.
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
from tests.dist_utils import run_distributed
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


def _checks(rank: int, world: int, tmp: str) -> None:
    common = dict(max_steps=6, accumulate_grad_batches=2, gradient_clip_val=CLIP, val_check_interval=4)
    ref, ref_trainer = fit(DirectParams, ddp(), **common)
    saver = ModelCheckpoint(dirpath=os.path.join(tmp, "ckpt"), every_n_train_steps=4, save_top_k=-1)
    mine, trainer = fit(DirectParams, "vescale", callbacks=[saver], **common)

    # Every parameter is sharded; cls and pos are in the LightningModule's own group.
    assert all(is_ragged(p) for p in mine.parameters())
    own = get_state(mine).group
    assert sorted(mp.fqn for mp in own.managed) == ["cls", "pos"]
    assert len(sharded_groups(mine)) == 5, "2 blocks + embed + head + the LightningModule's own group"
    assert mine.cls.shape == (1, 1, DIM) and mine.pos.shape == (SEQ + 1, DIM)  # the full shapes, not pieces
    pieces = torch.tensor([mine.cls.to_local().numel() + mine.pos.to_local().numel()])
    dist.all_reduce(pieces)
    assert pieces.item() == DIM + (SEQ + 1) * DIM

    # Same losses (every micro-batch), gradient norms (clipping active) and validation loss as DDP.
    assert len(mine.losses) == 12 and len(mine.norms) == 6
    assert_close(mine.losses, ref.losses, 1e-5, "losses vs DDP")
    assert_close(mine.norms, ref.norms, 1e-5, "gradient norms vs DDP")
    assert max(ref.norms) > CLIP
    want = ref_trainer.callback_metrics["val_loss"].item()
    assert abs(trainer.callback_metrics["val_loss"].item() - want) < 1e-5

    # A resume from step 4, the end of the first epoch (cls and pos in the sharded checkpoint), equals the
    # uninterrupted run.
    ckpt = os.path.join(tmp, "ckpt", "epoch=0-step=4.ckpt")
    assert os.path.isdir(ckpt), sorted(os.listdir(os.path.join(tmp, "ckpt")))
    resumed, _ = fit(DirectParams, "vescale", init_seed=123, ckpt_path=ckpt, **common)
    assert_close(resumed.losses, mine.losses[8:], 1e-6, "resumed vs uninterrupted")

    # Children built on the meta device in configure_model, cls and pos real from __init__: same as DDP.
    ref_cm, _ = fit(lambda: DirectParams(build_in_configure_model=True), ddp(), **common)
    mine_cm, _ = fit(lambda: DirectParams(build_in_configure_model=True), "vescale", **common)
    assert not any(p.is_meta for p in mine_cm.parameters())
    assert_close(mine_cm.losses, ref_cm.losses, 1e-5, "configure_model children vs DDP")


def test_lightning_module_with_its_own_parameters_trains_like_ddp(tmp_path) -> None:
    run_distributed(_checks, 2, str(tmp_path), timeout=300)

"""An existing Lightning project moved to lightning-vescale by changing only ``strategy=``.

The LightningModule, the data and the Trainer below are ordinary Lightning code: a small character-level
transformer language model trained on this file's own text. The only line that differs from a DDP project
is ``Trainer(strategy="vescale")`` (plus the import that registers the name):

    python examples/lightning_switch.py                       # 2 CPU processes, strategy="vescale"
    python examples/lightning_switch.py --strategy ddp        # the same run with DDP: same losses
    python examples/lightning_switch.py --precision bf16-mixed --accumulate 2
    torchrun --nproc_per_node 2 examples/lightning_switch.py  # or let torchrun start the processes

The strategy shards each transformer layer as its own group (every element of an ``nn.ModuleList`` of
identical blocks) and the model as the root, builds the optimizer on the local pieces, clips by the
true global norm, skips gradient communication on accumulation steps and writes sharded checkpoints.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.demos.transformer import Transformer
from torch.utils.data import DataLoader, Dataset

import lightning_vescale.lightning  # noqa: F401 - registers strategy="vescale" with Lightning


class CharData(Dataset):
    """Fixed-length windows of this file's characters."""

    def __init__(self, block: int = 32) -> None:
        text = Path(__file__).read_text()
        self.vocab = sorted(set(text))
        ids = torch.tensor([self.vocab.index(c) for c in text])
        n = (len(ids) - 1) // block
        self.x = ids[: n * block].view(n, block)
        self.y = ids[1 : n * block + 1].view(n, block)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class CharLM(LightningModule):
    def __init__(self, vocab_size: int, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = Transformer(vocab_size=vocab_size, ninp=64, nhead=4, nhid=128, nlayers=2, dropout=0.0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.nll_loss(self.model(x, y), y.reshape(-1))
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.nll_loss(self.model(x, y), y.reshape(-1)), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="vescale", help="vescale (default), vescale_hsdp, ddp, ...")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--root-dir", default="lightning_switch_logs")
    args = parser.parse_args()

    seed_everything(0)
    data = CharData()
    model = CharLM(vocab_size=len(data.vocab))
    trainer = Trainer(
        strategy=args.strategy,  # <- the only change: "ddp" before
        accelerator=args.accelerator,
        devices=args.devices,
        precision=args.precision,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=1.0,
        limit_val_batches=2,
        val_check_interval=10,
        check_val_every_n_epoch=None,
        default_root_dir=args.root_dir,
        logger=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True), DataLoader(data, batch_size=8))
    if trainer.is_global_zero:
        metrics = {k: round(v.item(), 4) for k, v in trainer.callback_metrics.items()}
        print(f"strategy={args.strategy}: {metrics}")


if __name__ == "__main__":
    main()

"""AdamW8bit through ``Fabric``: joint setup, training, a sharded ``fabric.save`` / ``fabric.load`` that resumes
exactly, and the layout check when the optimizer was built before sharding (one process group, 2 gloo ranks)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

import lightning_vescale.lightning  # noqa: F401 - registers strategy="vescale"
from lightning_vescale.lightning import VeScaleFabricStrategy
from lightning_vescale.optim import AdamW8bit, adamw8bit_granularity
from tests.dist_utils import run_distributed
from tests.toy_models import TinyTransformer


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(10 * step + rank)
    tokens = torch.randint(0, 32, (4, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train(fabric, model, opt, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step, fabric.global_rank)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    return losses


def _run(rank: int, world: int, tmp: str) -> None:
    fabric = Fabric(accelerator="cpu", devices=world, strategy=VeScaleFabricStrategy(granularity=adamw8bit_granularity()))
    fabric.launch()
    torch.manual_seed(0)
    model = TinyTransformer()
    model, opt = fabric.setup(model, AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=256))
    losses = train(fabric, model, opt, range(8))
    assert losses[-1] < losses[0] - 0.3, losses
    assert any("exp_avg_codes" in s for s in opt.state.values())

    ckpt = os.path.join(tmp, "fabric_ckpt")
    fabric.save(ckpt, {"model": model, "optimizer": opt, "step": 8})
    after = train(fabric, model, opt, range(8, 11))
    torch.manual_seed(1)
    other = TinyTransformer()
    other, other_opt = fabric.setup(other, AdamW8bit(other.parameters(), lr=1e-2, min_8bit_size=256))
    state = {"model": other, "optimizer": other_opt, "step": 0}
    fabric.load(ckpt, state)
    assert state["step"] == 8
    assert train(fabric, other, other_opt, range(8, 11)) == pytest.approx(after, abs=1e-6)

    # Negative control: the default element granularity cuts inside blocks; the optimizer built before sharding
    # (joint setup) is refused at its first step.
    plain = Fabric(accelerator="cpu", devices=world, strategy="vescale")
    plain.launch()
    torch.manual_seed(0)
    model = TinyTransformer()
    model, opt = plain.setup(model, AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=256))
    with pytest.raises(ValueError, match="falls inside an 8-bit block"):
        train(plain, model, opt, range(1))


def test_adamw8bit_fabric_trains_saves_and_resumes(tmp_path) -> None:
    run_distributed(_run, 2, str(tmp_path))

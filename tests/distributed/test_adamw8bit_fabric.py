"""AdamW8bit through ``Fabric`` on 2 gloo ranks, one test per behaviour (``tests.dist_pool.DistributedTest``):

* joint setup (``fabric.setup(model, optimizer)``) with ``adamw8bit_granularity()`` trains (the loss falls by 0.3)
  and keeps 8-bit states;
* a sharded ``fabric.save`` / ``fabric.load`` into another init resumes exactly (losses to 1e-6);
* negative control: under the default element granularity the optimizer built before sharding is refused at its
  first step (a piece boundary falls inside an 8-bit block).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

import lightning_vescale.lightning  # noqa: F401 - registers strategy="vescale"
from lightning_vescale.lightning import VeScaleFabricStrategy
from lightning_vescale.optim import AdamW8bit, adamw8bit_granularity
from tests.dist_pool import DistributedTest
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


def _block_fabric(world: int) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=world, strategy=VeScaleFabricStrategy(granularity=adamw8bit_granularity()))
    fabric.launch()
    return fabric


def _setup(fabric: Fabric, seed: int):
    torch.manual_seed(seed)
    model = TinyTransformer()
    return fabric.setup(model, AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=256))


def _trained(world: int):
    """The block-granular Fabric, and a model and optimizer set up jointly (seed 0) and trained 8 steps."""
    fabric = _block_fabric(world)
    model, opt = _setup(fabric, 0)
    return fabric, model, opt, train(fabric, model, opt, range(8))


def _trains_with_8bit_states(rank: int, world: int) -> None:
    _, _, opt, losses = _trained(world)
    assert losses[-1] < losses[0] - 0.3, losses
    assert any("exp_avg_codes" in s for s in opt.state.values())


def _save_and_load_resume_exactly(rank: int, world: int, tmp: str) -> None:
    fabric, model, opt, _ = _trained(world)
    ckpt = os.path.join(tmp, "fabric_ckpt")
    fabric.save(ckpt, {"model": model, "optimizer": opt, "step": 8})
    after = train(fabric, model, opt, range(8, 11))
    other, other_opt = _setup(fabric, 1)
    state = {"model": other, "optimizer": other_opt, "step": 0}
    fabric.load(ckpt, state)
    assert state["step"] == 8
    assert train(fabric, other, other_opt, range(8, 11)) == pytest.approx(after, abs=1e-6)


def _element_granularity_refused(rank: int, world: int) -> None:
    # The default element granularity cuts inside blocks; the optimizer built before sharding (joint setup) is
    # refused at its first step.
    plain = Fabric(accelerator="cpu", devices=world, strategy="vescale")
    plain.launch()
    model, opt = _setup(plain, 0)
    with pytest.raises(ValueError, match="falls inside an 8-bit block"):
        train(plain, model, opt, range(1))


class TestAdamW8bitFabric(DistributedTest):
    world_size = 2

    def test_joint_setup_trains_with_8bit_states(self) -> None:
        self.run_ranks(_trains_with_8bit_states)

    def test_save_and_load_resume_exactly(self, tmp_path) -> None:
        self.run_ranks(_save_and_load_resume_exactly, str(tmp_path))

    def test_element_granularity_is_refused_at_the_first_step(self) -> None:
        self.run_ranks(_element_granularity_refused)

"""A NaN loss on one of 2 ranks never reaches the weights (issue 25).

Rank 1's loss is NaN at step 3 (as a bad batch or an overflow on one rank gives). With ``NonFiniteGuard``:

* ``"stop"`` (the recipes' default): every rank raises ``NonFiniteError`` naming the step and the rank, before
  the optimizer step, so the weights are those of step 2 on every rank;
* ``"skip"``: step 3's optimizer step is skipped on every rank (the weights stay those of step 2) and
  counted, and training goes on to the end with finite weights.

Without the guard the NaN is reduce-scattered into every rank's gradient pieces and every weight turns NaN.

One class of tests on the 2 ranks (:class:`tests.dist_pool.DistributedTest`), one test per action and one for the
control; weights compared bitwise.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_vescale.lightning  # noqa: F401 - registers strategy="vescale"
from lightning_vescale.recipe.callbacks import NonFiniteError, NonFiniteGuard
from tests.dist_pool import DistributedTest


class NaNOnRank1(BoringModel):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        if self.global_step == 2 and self.global_rank == 1:  # the batch of step 3
            out["loss"] = out["loss"] * float("nan")
        return out

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1, weight_decay=0.1)


class Weights(Callback):
    """This rank's weight pieces after every optimizer step."""

    def __init__(self) -> None:
        self.after: dict[int, list[torch.Tensor]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.after[trainer.global_step] = [p.to_local().detach().clone() for p in pl_module.parameters()]


def _train(world: int, action, steps: int = 5):
    weights = Weights()
    callbacks = [weights] + ([NonFiniteGuard(action)] if action else [])
    trainer = Trainer(strategy="vescale", accelerator="cpu", devices=world, max_steps=steps, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      gradient_clip_val=1.0, limit_val_batches=0, callbacks=callbacks)
    torch.manual_seed(0)
    model = NaNOnRank1()
    return trainer, model, weights, callbacks[-1]


def _stop_raises_before_the_optimizer_step(rank: int, world: int) -> None:
    trainer, model, weights, _ = _train(world, "stop")
    with pytest.raises(NonFiniteError, match=r"step 3: non-finite loss on rank\(s\) \[1\]; .*Stopped on every rank "
                                             r"before the optimizer step, so the weights \(and any checkpoint\) are "
                                             r"those of step 2"):
        trainer.fit(model)
    now = [p.to_local().detach() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(now, weights.after[2])), "step 3 changed the weights"


def _skip_skips_the_step_on_every_rank(rank: int, world: int) -> None:
    trainer, model, weights, guard = _train(world, "skip")
    trainer.fit(model)
    assert guard.skipped == [3] and trainer.global_step == 5
    assert all(torch.equal(a, b) for a, b in zip(weights.after[3], weights.after[2])), "the skipped step stepped"
    assert all(torch.isfinite(p.to_local()).all() for p in model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(weights.after[5], weights.after[3])), "training went on"


def _without_guard_nan_reaches_every_weight(rank: int, world: int) -> None:
    trainer, model, _, _ = _train(world, None)  # the control: without the guard, NaN reaches every rank's weights
    trainer.fit(model)
    assert all(torch.isnan(p.to_local()).all() for p in model.parameters())


class TestNonFiniteLossOn2Ranks(DistributedTest):
    world_size = 2

    def test_stop_raises_on_every_rank_before_the_optimizer_step(self) -> None:
        self.run_ranks(_stop_raises_before_the_optimizer_step)

    def test_skip_skips_the_step_on_every_rank_and_training_goes_on(self) -> None:
        self.run_ranks(_skip_skips_the_step_on_every_rank)

    def test_without_the_guard_nan_reaches_every_weight(self) -> None:
        self.run_ranks(_without_guard_nan_reaches_every_weight)

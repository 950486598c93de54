"""``VeScaleStrategy(expert_parallel_size=...)`` through the recipe: ``strategy.expert_parallel_size=2`` trains
``model=moe_tiny`` on 2 CPU processes (experts split over "ep"), and a size that does not divide the world
stops before any process is launched, with a message naming both numbers.
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from tests.recipe_zygote import ROOT, run_command, run_recipe


@pytest.mark.slow
def test_moe_tiny_trains_with_expert_parallel_size_2(tmp_path):
    run = tmp_path / "moe_tiny" / "run"
    proc = run_recipe("train.py", "model=moe_tiny", "strategy.expert_parallel_size=2", "trainer.devices=2",
                      "trainer.max_steps=6", "trainer.checkpoint_every_n_steps=0", "trainer.val_every_n_steps=6",
                      f"output_root={tmp_path}", f"hydra.run.dir={run}")
    assert "expert parallel over ('dp', 'ep') = (1, 2)" in proc.stdout + proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model"] == "moe_tiny" and summary["strategy"] == "VeScaleStrategy"
    assert summary["world_size"] == 2 and summary["steps"] == 6 and summary["loss_is_finite"]
    losses = [p["loss"] for p in summary["losses"]]
    assert all(math.isfinite(x) for x in losses)
    assert summary["final_loss"] < summary["first_loss"] - 1.0, losses


def test_expert_parallel_size_that_does_not_divide_the_world_stops_before_training(tmp_path):
    cmd = [sys.executable, str(ROOT / "recipes" / "train.py"), "model=moe_tiny", "strategy.expert_parallel_size=3",
           "trainer.devices=2", f"output_root={tmp_path}"]
    proc = run_command(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1"), timeout=120)
    assert proc.returncode != 0
    assert "expert_parallel_size=3 does not divide the world size 2" in proc.stderr, proc.stderr[-3000:]
    assert "Initializing distributed" not in proc.stdout + proc.stderr


def test_the_strategy_checks_expert_parallel_size_when_the_trainer_is_built():
    from lightning.pytorch import Trainer

    from lightning_vescale.lightning import VeScaleStrategy

    with pytest.raises(ValueError, match=r"expert_parallel_size=3 does not divide the world size 2"):
        Trainer(strategy=VeScaleStrategy(expert_parallel_size=3), accelerator="cpu", devices=2, logger=False)


def test_expert_parallel_with_replicate_size_is_refused():
    from lightning_vescale.lightning import VeScaleStrategy

    with pytest.raises(ValueError, match=r"replicate_size=2 \(HSDP\) is not supported yet"):
        VeScaleStrategy(expert_parallel_size=2, replicate_size=2)


def test_expert_parallel_size_must_be_a_positive_int():
    from lightning_vescale.lightning import VeScaleStrategy

    with pytest.raises(ValueError, match="expert_parallel_size must be a positive int"):
        VeScaleStrategy(expert_parallel_size=0)

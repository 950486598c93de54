"""``recipes/train.py`` trains the new MoE families' tiny presets on 2 CPU processes (a few smoke steps)."""

from __future__ import annotations

import json

import pytest

from tests.recipe_zygote import run_recipe

pytestmark = pytest.mark.slow  # recipe runs as subprocesses (Hydra, Lightning's launcher): tens of seconds each


@pytest.mark.parametrize(
    "model,overrides",
    [("qwen3_moe_tiny", []), ("deepseek_v3_tiny", ["strategy.expert_parallel_size=2"])],
    ids=["qwen3_moe", "deepseek_v3-expert-parallel"],
)
def test_tiny_preset_trains(model, overrides, tmp_path):
    run = tmp_path / model
    run_recipe("train.py", f"model={model}", f"output_root={tmp_path}", f"hydra.run.dir={run}", "trainer.max_steps=6",
               "trainer.checkpoint_every_n_steps=0", "trainer.val_every_n_steps=6", *overrides)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model"] == model and summary["world_size"] == 2 and summary["steps"] == 6
    assert summary["loss_is_finite"] and summary["final_loss"] < summary["first_loss"] - 1.0, summary["losses"]

"""``recipes/train.py experiment=vlm_mpmd`` end to end on 4 CPU processes, and its config errors before start."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lightning_vescale.models.vlm import VLM, vlm_config
from lightning_vescale.pipeline import read_mpmd_full_state_dict
from tests.recipe_zygote import ROOT, run_command

pytestmark = pytest.mark.slow  # recipe runs as subprocesses (Hydra, Lightning's launcher): tens of seconds each

def run_train(*overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "recipes" / "train.py"), "experiment=vlm_mpmd", *overrides]
    return run_command(cmd, timeout=300)


def test_vlm_mpmd_recipe_trains_on_four_processes_and_saves_every_stage(tmp_path):
    run = tmp_path / "run"
    proc = run_train("mpmd.model=tiny", "mpmd.layout=plan", "trainer.max_steps=6", "trainer.checkpoint_every_n_steps=6",
                     f"output_root={tmp_path}", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["steps"] == 6 and summary["loss_is_finite"]
    assert summary["final_loss"] < summary["first_loss"] - 1.0, summary["losses"]
    assert [s["ranks"] for s in summary["plan"]["stages"]] == [1, 3]
    full = read_mpmd_full_state_dict(run / "checkpoints" / "final")
    assert {k: tuple(v.shape) for k, v in full.items()} == {
        k: tuple(v.shape) for k, v in VLM(vlm_config("tiny")).state_dict().items()}


def test_vlm_mpmd_recipe_refuses_a_world_size_the_plan_does_not_fill_before_starting(tmp_path):
    proc = run_train("trainer.devices=3", "mpmd.layout=plan", f"output_root={tmp_path}")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "add up to 1 (vision) + 3 (language) = 4, but the world has 3 ranks" in proc.stdout + proc.stderr
    assert not any(tmp_path.iterdir())  # no run directory


def test_vlm_mpmd_recipe_trains_the_layout_the_cost_model_chooses(tmp_path):
    import yaml

    from lightning_vescale.recipe.mpmd import MPMDConfig

    run = tmp_path / "run"
    # The tiny model (the choice is made and followed alike for any size; the default one costs a minute here).
    proc = run_train("mpmd.model=tiny", "trainer.max_steps=3", "trainer.checkpoint_every_n_steps=0",
                     f"output_root={tmp_path}", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    summary = json.loads((run / "summary.json").read_text())
    experiment = yaml.safe_load((ROOT / "configs" / "experiment" / "vlm_mpmd.yaml").read_text())["mpmd"]
    config = MPMDConfig(**{**experiment, "model": "tiny"})
    plan, costs = config.choose(4, "cpu")
    assert summary["layout"] == ("uniform" if plan is None else plan.name)
    assert [c["layout"] for c in summary["predicted"]] == [c.name.removeprefix("mpmd:") for c in costs]
    assert len(costs) == 18, "uniform sharding and the 17 MPMD layouts of two stages on 4 ranks for a batch of 12"
    assert "predicted fastest of 18 layouts" in proc.stdout + proc.stderr
    assert summary["loss_is_finite"] and summary["cpu_time_s_per_step"] > 0


def test_vlm_recipe_trains_uniform_sharding_as_the_baseline(tmp_path):
    from lightning_vescale.checkpoint import read_full_checkpoint

    run = tmp_path / "run"
    proc = run_train("mpmd.model=tiny", "mpmd.layout=uniform", "trainer.max_steps=6",
                     "trainer.checkpoint_every_n_steps=6", f"output_root={tmp_path}", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["layout"] == "uniform" and summary["plan"] is None
    assert summary["final_loss"] < summary["first_loss"] - 1.0, summary["losses"]
    state, _ = read_full_checkpoint(run / "checkpoints" / "final")
    want = VLM(vlm_config("tiny")).state_dict()
    assert {k: tuple(state[k].shape) for k in want} == {k: tuple(v.shape) for k, v in want.items()}

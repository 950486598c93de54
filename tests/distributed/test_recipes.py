"""The recipes end to end: ``recipes/train.py`` and ``recipes/finetune.py`` as subprocesses on 2 CPU processes.

Each run goes through Hydra, Lightning's subprocess launcher (which re-launches the Hydra app for rank 1),
the vescale strategy, checkpoints and the summary. The runs are a few steps of ``experiment=smoke``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_vescale.models import MoE, moe_config, save_pretrained

ROOT = Path(__file__).resolve().parents[2]


def run_recipe(script: str, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(ROOT / "recipes" / script), "experiment=smoke", "trainer.enable_progress_bar=false",
           *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_llama_tiny_trains_checkpoints_and_resumes(tmp_path):
    run1 = tmp_path / "llama_tiny" / "run1"
    run_recipe("train.py", f"output_root={tmp_path}", f"hydra.run.dir={run1}")

    summary = json.loads((run1 / "summary.json").read_text())
    assert summary["model"] == "llama_tiny" and summary["strategy"] == "VeScaleStrategy"
    assert summary["world_size"] == 2 and summary["steps"] == 12 and summary["loss_is_finite"]
    assert summary["first_loss"] > 5.0  # about ln(256) at initialization
    assert summary["final_loss_mean_last_10"] < summary["first_loss"] - 1.0, summary["losses"]
    assert summary["val_loss"] is not None and math.isfinite(summary["val_loss"])
    assert summary["tokens_per_s"] > 0 and summary["comm_bytes_per_step"] > 0
    assert {"all_gather", "reduce_scatter"} <= set(summary["comm_bytes_per_step_by_kind"])
    assert summary["peak_memory_bytes"] > 0
    assert (run1 / "loss_curve.png").stat().st_size > 0
    ckpts = run1 / "checkpoints"
    assert (ckpts / "step-000006.ckpt").is_dir() and (ckpts / "step-000012.ckpt").is_dir()
    assert (ckpts / "last.ckpt").resolve() == (ckpts / "step-000012.ckpt").resolve()
    rows = read_metrics(run1)
    assert {"loss", "tok/s", "comm/step", "lr", "val_loss"} <= set(rows[0])
    assert any(r["val_loss"] for r in rows)

    # resume=true finds run1's last checkpoint and continues at step 12, with the loss where it was.
    run2 = tmp_path / "llama_tiny" / "run2"
    run_recipe("train.py", f"output_root={tmp_path}", f"hydra.run.dir={run2}", "resume=true", "trainer.max_steps=16")
    resumed = json.loads((run2 / "summary.json").read_text())
    assert resumed["resumed_from"] == str(ckpts / "last.ckpt")
    assert resumed["resumed_from_step"] == 12 and resumed["steps"] == 16 and resumed["steps_this_run"] == 4
    assert [p["step"] for p in resumed["losses"]] == [13, 14, 15, 16]
    assert resumed["first_loss"] < summary["first_loss"] - 1.0  # no restart from random weights
    assert (run2 / "checkpoints" / "step-000016.ckpt").is_dir()


def test_moe_tiny_trains_and_logs_tokens_per_expert(tmp_path):
    run = tmp_path / "moe_tiny" / "run"
    run_recipe("train.py", "model=moe_tiny", f"output_root={tmp_path}", f"hydra.run.dir={run}",
               "trainer.max_steps=8", "trainer.checkpoint_every_n_steps=0", "trainer.val_every_n_steps=8")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model"] == "moe_tiny" and summary["steps"] == 8 and summary["loss_is_finite"]
    assert summary["final_loss"] < summary["first_loss"]
    assert not (run / "checkpoints").exists()
    rows = [r for r in read_metrics(run) if r.get("moe/layer0/expert0")]
    assert rows, "no tokens-per-expert metrics were logged"
    shares = [float(rows[-1][f"moe/layer1/expert{e}"]) for e in range(4)]
    assert sum(shares) == pytest.approx(1.0, abs=1e-5) and all(0 <= s <= 1 for s in shares)
    assert float(rows[-1]["moe/max_load"]) >= 1.0


def test_finetune_starts_from_the_hugging_face_weights(tmp_path):
    # Zero the output head: if (and only if) the weights are loaded, the first loss is exactly ln(256).
    # One process is enough to check that the sharded model receives the weights (and saves a launch).
    arch = moe_config("tiny")
    arch.shared_expert_gate = True  # Qwen2-MoE's gated shared expert, so the checkpoint is a transformers one
    model = MoE(arch)
    with torch.no_grad():
        model.output.weight.zero_()
    save_pretrained(model, arch, tmp_path / "hf")
    run = tmp_path / "ft" / "run"
    run_recipe("finetune.py", f"init_from={tmp_path / 'hf'}", "model=moe_tiny", "model.shared_expert_gate=true",
               f"output_root={tmp_path}", f"hydra.run.dir={run}", "trainer.max_steps=4", "trainer.devices=1",
               "trainer.checkpoint_every_n_steps=0", "trainer.limit_val_batches=0")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["init_from"] == str(tmp_path / "hf") and summary["steps"] == 4
    assert summary["strategy"] == "VeScaleStrategy" and summary["world_size"] == 1
    assert summary["losses"][0]["loss"] == pytest.approx(math.log(256), abs=1e-4)
    assert summary["loss_is_finite"]


def test_a_mismatching_checkpoint_stops_before_training(tmp_path):
    arch = moe_config("tiny")
    arch.shared_expert_gate = True
    save_pretrained(MoE(arch), arch, tmp_path / "hf")
    cmd = [sys.executable, str(ROOT / "recipes" / "finetune.py"), f"init_from={tmp_path / 'hf'}", "model=moe_tiny",
           f"output_root={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1"))
    assert proc.returncode != 0
    assert "does not match model=moe_tiny" in proc.stderr and "shared_expert_gate: checkpoint True" in proc.stderr
    assert "Initializing distributed" not in proc.stdout + proc.stderr

"""``recipes/train.py strategy.tensor_parallel_size=2 plan=llama`` on 4 CPU processes (dp2 x tp2) against the same
recipe on 2 processes without tensor parallelism (dp2): the same global batches, so the same losses and weights.

The two runs are launched once for the module (a module-scoped fixture; its tests stay on one pytest-xdist worker),
each test checks one behaviour of them: the tp run reports its mesh; with ``optimizer=muon`` its Muon orthogonalizes
the tensor-parallel matrices whole and gives the dp run's losses and validation loss (Newton-Schulz runs in bf16:
1e-4) and weights (2e-2, see ``WEIGHT_TOLERANCE``); the tp run's checkpoint reads whole and exports to Hugging Face.
A tp size that does not divide the processes stops before anything is launched (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from safetensors.torch import load_file

from lightning_vescale.export import export_hf, read_model_state
from tests.recipe_zygote import run_recipe

pytestmark = pytest.mark.slow  # recipe runs as subprocesses (Hydra, Lightning's launcher): tens of seconds each

WEIGHT_TOLERANCE = 2e-2
"""Max |w_tp - w_dp| after 6 Muon steps: measured 3.9e-3 (Newton-Schulz runs in bf16: fp32 reduction-order differences
flip its roundings, and each Muon update moves every element by about lr); a wrong split is off by the weights' scale."""

ONE_WORKER = pytest.mark.xdist_group(name="test_recipe_tensor_parallel.tp_and_dp_runs")
"""The tests of the fixture's two runs: on one pytest-xdist worker, so the runs are launched once."""


class Runs(NamedTuple):
    root: Path
    tp_run: Path
    dp_run: Path
    tp_output: str
    tp: dict[str, Any]
    dp: dict[str, Any]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    tmp = tmp_path_factory.mktemp("tp_recipe")
    # optimizer=muon: the Muon matrices are tensor-parallel (orthogonalized whole), the rest AdamW.
    common = ("plan=llama", "optimizer=muon", "trainer.max_steps=6", "trainer.val_every_n_steps=6",
              "trainer.checkpoint_every_n_steps=6", f"output_root={tmp}")
    tp_run, dp_run = tmp / "tp", tmp / "dp"
    proc = run_recipe("train.py", *common, "trainer.devices=4", "strategy.tensor_parallel_size=2",
                      f"hydra.run.dir={tp_run}", timeout=400)
    run_recipe("train.py", *common, "trainer.devices=2", f"hydra.run.dir={dp_run}", timeout=300)
    tp, dp = (json.loads((run / "summary.json").read_text()) for run in (tp_run, dp_run))
    return Runs(tmp, tp_run, dp_run, proc.stdout + proc.stderr, tp, dp)


@ONE_WORKER
def test_tensor_parallel_run_reports_its_mesh_and_both_runs_use_muon(runs: Runs):
    assert "tensor parallel over (data_parallel=2, tensor_parallel=2)" in runs.tp_output
    assert runs.tp["world_size"] == 4 and runs.dp["world_size"] == 2
    assert runs.tp["optimizer"] == runs.dp["optimizer"] == "lightning_vescale.optim.build_optimizer"


@ONE_WORKER
def test_tensor_parallel_losses_equal_data_parallel_losses(runs: Runs):
    tp, dp = runs.tp, runs.dp
    tp_losses, dp_losses = ([r["loss"] for r in s["losses"]] for s in (tp, dp))
    assert len(tp_losses) == len(dp_losses) == 6 and tp_losses[-1] < tp_losses[0]
    # Measured: 0, 0, 2e-6, 1.5e-5 over the first 4 (fp32 reduction order flips bf16 roundings inside Newton-Schulz
    # from step 3; with AdamW only the runs agree to 1e-6, test_tensor_parallel_plan.py checks that at 1e-5).
    assert all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(tp_losses, dp_losses)), (tp_losses, dp_losses)
    assert abs(tp["val_loss"] - dp["val_loss"]) <= 1e-4 * max(1.0, dp["val_loss"])


@ONE_WORKER
def test_tensor_parallel_weights_equal_data_parallel_weights(runs: Runs):
    tp_state, dp_state = (read_model_state(run / "checkpoints" / "last.ckpt") for run in (runs.tp_run, runs.dp_run))
    assert tp_state.keys() == dp_state.keys()
    worst = max((tp_state[n] - dp_state[n]).abs().max().item() for n in dp_state)
    assert worst <= WEIGHT_TOLERANCE, f"the tp run's weights differ from the dp run's by {worst}"


@ONE_WORKER
def test_tensor_parallel_checkpoint_exports_to_hugging_face(runs: Runs):
    tp_state = read_model_state(runs.tp_run / "checkpoints" / "last.ckpt")
    exported = load_file(str(export_hf(runs.tp_run, runs.root / "hf") / "model.safetensors"))
    wq = exported["model.layers.0.self_attn.q_proj.weight"]
    assert wq.shape == tp_state["layers.0.attention.wq.weight"].shape == (64, 64)
    assert torch.isfinite(wq).all() and len(exported) >= len(tp_state)


def test_tensor_parallel_size_not_dividing_the_processes_stops_before_launch(tmp_path):
    proc = run_recipe("train.py", "plan=llama", "trainer.devices=2", "strategy.tensor_parallel_size=4",
                      f"output_root={tmp_path}", returncode=2, timeout=120)
    assert "strategy.tensor_parallel_size=4 does not divide the world size 2" in proc.stdout + proc.stderr

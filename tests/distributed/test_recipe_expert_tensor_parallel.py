"""``recipes/train.py model=qwen3_moe_tiny plan=moe strategy.expert_parallel_size=2 strategy.tensor_parallel_size=2`` on
4 CPU processes (dp1 x ep2 x tp2: attention on tp, experts on ep, feed-forwards on sequence shards) against the same
recipe with expert parallelism only on 2 processes (dp1 x ep2): the same global batches, so the same losses and
weights.

The two runs are launched once for the module (a module-scoped fixture; its tests stay on one pytest-xdist worker),
each test checks one behaviour of them: the ep x tp run reports its mesh; its losses and validation loss equal the ep
run's (fp32, AdamW; measured 2e-7 apart over 6 steps, 1e-5 allowed: reductions run in other orders), so do its weights
(per tensor: the difference's norm within 5e-5 of the weights', the largest element within 1e-3 of the largest
weight; see the test for why two measures); its checkpoint reads whole and exports to Hugging Face (the expert weights bitwise). An ep x tp
product that does not divide the processes stops before anything is launched (exit 2)."""

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

ONE_WORKER = pytest.mark.xdist_group(name="test_recipe_expert_tensor_parallel.eptp_and_ep_runs")
"""The tests of the fixture's two runs: on one pytest-xdist worker, so the runs are launched once."""


class Runs(NamedTuple):
    root: Path
    eptp_run: Path
    ep_run: Path
    eptp_output: str
    eptp: dict[str, Any]
    ep: dict[str, Any]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    tmp = tmp_path_factory.mktemp("eptp_recipe")
    common = ("model=qwen3_moe_tiny", "plan=moe", "strategy.expert_parallel_size=2", "trainer.max_steps=6",
              "trainer.val_every_n_steps=6", "trainer.checkpoint_every_n_steps=6", f"output_root={tmp}")
    eptp_run, ep_run = tmp / "eptp", tmp / "ep"
    proc = run_recipe("train.py", *common, "trainer.devices=4", "strategy.tensor_parallel_size=2",
                      f"hydra.run.dir={eptp_run}", timeout=400)
    run_recipe("train.py", *common, "trainer.devices=2", f"hydra.run.dir={ep_run}", timeout=300)
    eptp, ep = (json.loads((run / "summary.json").read_text()) for run in (eptp_run, ep_run))
    return Runs(tmp, eptp_run, ep_run, proc.stdout + proc.stderr, eptp, ep)


@ONE_WORKER
def test_expert_and_tensor_parallel_run_reports_its_mesh(runs: Runs):
    assert "expert parallel over ('dp', 'ep', 'tp') = (1, 2, 2)" in runs.eptp_output
    assert runs.eptp["world_size"] == 4 and runs.ep["world_size"] == 2


@ONE_WORKER
def test_expert_and_tensor_parallel_losses_equal_expert_parallel_losses(runs: Runs):
    eptp, ep = runs.eptp, runs.ep
    eptp_losses, ep_losses = ([r["loss"] for r in s["losses"]] for s in (eptp, ep))
    assert len(eptp_losses) == len(ep_losses) == 6 and eptp_losses[-1] < eptp_losses[0]
    assert all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(eptp_losses, ep_losses)), (eptp_losses, ep_losses)
    assert abs(eptp["val_loss"] - ep["val_loss"]) <= 1e-5 * max(1.0, ep["val_loss"])


@ONE_WORKER
def test_expert_and_tensor_parallel_weights_equal_expert_parallel_weights(runs: Runs):
    # Two measures, because AdamW amplifies reduction order unevenly: an element whose gradient is about zero moves by
    # lr * m / sqrt(v), so last-bit gradient differences there become visible updates (a heavy tail: 4 of wq's 8192
    # elements above 1e-6 apart, 1.2e-4 of the tensor's largest weight, on an AVX-512 Xeon). Per tensor, the norm of
    # the difference stays at reduction noise (measured 5.9e-6 of the weights' norm, the same recipe with gradient
    # accumulation 6e-7); a wrong tensor-parallel gradient (a missing or doubled reduction) moves whole tensors by
    # 1e-2 or more. The largest element is bounded too, at the tail's size with a margin.
    eptp_state, ep_state = (read_model_state(run / "checkpoints" / "last.ckpt") for run in (runs.eptp_run, runs.ep_run))
    assert eptp_state.keys() == ep_state.keys()
    floats = [n for n in ep_state if ep_state[n].is_floating_point()]
    norm_worst, norm_name = max((((eptp_state[n] - ep_state[n]).norm() / ep_state[n].norm().clamp_min(1e-12)).item(), n)
                                for n in floats)
    assert norm_worst <= 5e-5, f"the ep x tp run's weights differ from the ep run's by {norm_worst} (norm, in {norm_name})"
    worst, name = max((((eptp_state[n] - ep_state[n]).abs().max() / ep_state[n].abs().max().clamp_min(1e-12)).item(), n)
                      for n in floats)
    assert worst <= 1e-3, f"the ep x tp run's weights differ from the ep run's by {worst} (largest element, in {name})"


@ONE_WORKER
def test_expert_and_tensor_parallel_checkpoint_exports_to_hugging_face(runs: Runs):
    eptp_state = read_model_state(runs.eptp_run / "checkpoints" / "last.ckpt")
    exported = load_file(str(export_hf(runs.eptp_run, runs.root / "hf") / "model.safetensors"))
    gate = exported["model.layers.0.mlp.experts.0.gate_proj.weight"]
    assert gate.shape == eptp_state["layers.0.feed_forward.experts.w1_EDF"][0].T.shape
    torch.testing.assert_close(gate, eptp_state["layers.0.feed_forward.experts.w1_EDF"][0].T, rtol=0, atol=0)


def test_expert_times_tensor_parallel_not_dividing_the_processes_stops_before_launch(tmp_path):
    proc = run_recipe("train.py", "model=moe_tiny", "plan=moe", "trainer.devices=2", "strategy.expert_parallel_size=2",
                      "strategy.tensor_parallel_size=2", f"output_root={tmp_path}", returncode=2, timeout=120)
    assert ("strategy.expert_parallel_size=2 times strategy.tensor_parallel_size=2 does not divide the world size 2"
            in proc.stdout + proc.stderr)

"""``recipes/train.py model=qwen3_moe_tiny plan=moe strategy.expert_parallel_size=2 strategy.tensor_parallel_size=2`` on
4 CPU processes (dp1 x ep2 x tp2: attention on tp, experts on ep, feed-forwards on sequence shards) against the same
recipe with expert parallelism only on 2 processes (dp1 x ep2): the same global batches, so the same losses and
weights (fp32, AdamW; measured 2e-7 apart over 6 steps, 1e-5 allowed: reductions run in other orders). The ep x tp
run's checkpoint reads whole and exports to Hugging Face. An ep x tp product that does not divide the processes stops
before anything is launched (exit 2)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from lightning_vescale.export import export_hf, read_model_state
from tests.distributed.test_recipes import run_recipe


def test_expert_and_tensor_parallel_recipe_equals_expert_parallel_and_exports(tmp_path):
    common = ("model=qwen3_moe_tiny", "plan=moe", "strategy.expert_parallel_size=2", "trainer.max_steps=6",
              "trainer.val_every_n_steps=6", "trainer.checkpoint_every_n_steps=6", f"output_root={tmp_path}")
    eptp_run, ep_run = tmp_path / "eptp", tmp_path / "ep"
    proc = run_recipe("train.py", *common, "trainer.devices=4", "strategy.tensor_parallel_size=2",
                      f"hydra.run.dir={eptp_run}", timeout=400)
    assert "expert parallel over ('dp', 'ep', 'tp') = (1, 2, 2)" in proc.stdout + proc.stderr
    run_recipe("train.py", *common, "trainer.devices=2", f"hydra.run.dir={ep_run}", timeout=300)
    eptp, ep = (json.loads((run / "summary.json").read_text()) for run in (eptp_run, ep_run))
    assert eptp["world_size"] == 4 and ep["world_size"] == 2
    eptp_losses, ep_losses = ([r["loss"] for r in s["losses"]] for s in (eptp, ep))
    assert len(eptp_losses) == len(ep_losses) == 6 and eptp_losses[-1] < eptp_losses[0]
    assert all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(eptp_losses, ep_losses)), (eptp_losses, ep_losses)
    assert abs(eptp["val_loss"] - ep["val_loss"]) <= 1e-5 * max(1.0, ep["val_loss"])

    eptp_state, ep_state = (read_model_state(run / "checkpoints" / "last.ckpt") for run in (eptp_run, ep_run))
    assert eptp_state.keys() == ep_state.keys()
    worst = max(((eptp_state[n] - ep_state[n]).abs().max() / ep_state[n].abs().max().clamp_min(1e-12)).item()
                for n in ep_state if ep_state[n].is_floating_point())
    assert worst <= 1e-4, f"the ep x tp run's weights differ from the ep run's by {worst} (relative)"
    exported = load_file(str(export_hf(eptp_run, tmp_path / "hf") / "model.safetensors"))
    gate = exported["model.layers.0.mlp.experts.0.gate_proj.weight"]
    assert gate.shape == eptp_state["layers.0.feed_forward.experts.w1_EDF"][0].T.shape
    torch.testing.assert_close(gate, eptp_state["layers.0.feed_forward.experts.w1_EDF"][0].T, rtol=0, atol=0)


def test_expert_times_tensor_parallel_not_dividing_the_processes_stops_before_launch(tmp_path):
    proc = run_recipe("train.py", "model=moe_tiny", "plan=moe", "trainer.devices=2", "strategy.expert_parallel_size=2",
                      "strategy.tensor_parallel_size=2", f"output_root={tmp_path}", returncode=2, timeout=120)
    assert ("strategy.expert_parallel_size=2 times strategy.tensor_parallel_size=2 does not divide the world size 2"
            in proc.stdout + proc.stderr)

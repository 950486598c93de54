"""The recipes end to end: ``recipes/train.py`` and ``recipes/finetune.py`` as their own processes on 2 CPU ranks.

Each run goes through Hydra, Lightning's subprocess launcher (which re-launches the Hydra app for rank 1),
the vescale strategy, checkpoints and the summary. The runs are a few steps of ``experiment=smoke``. The main run
starts a fresh interpreter as the user's command does; the others are forked from one that has imported torch and
Lightning already (``tests/recipe_zygote.py``), which saves each process 7-9 s of imports.
SIGTERM and exact mid-epoch resume: ``test_recipe_signals.py``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightning_vescale.export import read_model_state
from lightning_vescale.models import Llama, MoE, llama_config, moe_config, save_pretrained
from tests.recipe_zygote import ROOT, run_command, run_recipe

pytestmark = pytest.mark.slow  # recipe runs as subprocesses (Hydra, Lightning's launcher): tens of seconds each

def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_llama_tiny_trains_checkpoints_and_resumes(tmp_path):
    run1 = tmp_path / "llama_tiny" / "run1"
    # A fresh interpreter, as the user's command starts (the other runs fork from one that has imported everything).
    proc = run_recipe("train.py", f"output_root={tmp_path}", f"hydra.run.dir={run1}",
                      "trainer.enable_progress_bar=true", fresh=True)
    # stdout is not a terminal: one progress line every log_every_n_steps (2) steps, and one per validation.
    output = proc.stdout + proc.stderr
    assert "\r" not in output
    # No noise: Lightning's cloud-logger tip, an empty log file of rank 1; counts in readable units.
    assert "litlogger" not in output and "training llama_tiny (107K parameters)" in output
    assert sorted(p.name for p in run1.glob("*.log")) == ["train.log"]
    progress = [line.split(" - ", 1)[1] for line in proc.stdout.splitlines() if " - step " in line]
    assert [p.split()[1] for p in progress] == ["2/12", "4/12", "6/12", "6/12", "8/12", "10/12", "12/12", "12/12"]
    assert progress[2].startswith("step 6/12  loss ") and progress[3].startswith("step 6/12  val_loss ")

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
    plan = yaml.safe_load((run1 / "plan.yaml").read_text())  # the default plan, as resolved
    assert plan["plan"]["name"] == "default" and list(plan["groups"]) == ["model.layers.1", "model.layers.0", "model.tok_embeddings", "model"]
    ckpts = run1 / "checkpoints"
    assert (ckpts / "step-000006.ckpt").is_dir() and (ckpts / "step-000012.ckpt").is_dir()
    assert (ckpts / "last.ckpt").resolve() == (ckpts / "step-000012.ckpt").resolve()
    rows = read_metrics(run1)
    assert {"loss", "tok/s", "comm/step", "lr", "val_loss"} <= set(rows[0])
    # One step numbering everywhere: metrics.csv's step is the summary's (optimizer steps done, from 1).
    train_rows = [r for r in rows if r["loss"]]
    assert [int(r["step"]) for r in train_rows] == [2, 4, 6, 8, 10, 12]
    by_step = {p["step"]: p["loss"] for p in summary["losses"]}
    for r in train_rows:
        assert float(r["loss"]) == pytest.approx(by_step[int(r["step"])], rel=1e-5), (r, by_step)
    val_rows = [(int(r["step"]), float(r["val_loss"])) for r in rows if r["val_loss"]]
    assert val_rows == [(v["step"], pytest.approx(v["val_loss"], rel=1e-5)) for v in summary["val_losses"]]
    assert [s for s, _ in val_rows] == [6, 12]

    # resume=true finds run1's last checkpoint and continues at step 12, with the loss where it was.
    run2 = tmp_path / "llama_tiny" / "run2"
    run_recipe("train.py", f"output_root={tmp_path}", f"hydra.run.dir={run2}", "resume=true", "trainer.max_steps=16")
    resumed = json.loads((run2 / "summary.json").read_text())
    assert resumed["resumed_from"] == str(ckpts / "step-000012.ckpt")  # last.ckpt, resolved once
    assert resumed["resumed_from_step"] == 12 and resumed["steps"] == 16 and resumed["steps_this_run"] == 4
    assert [p["step"] for p in resumed["losses"]] == [13, 14, 15, 16]
    assert resumed["first_loss"] < summary["first_loss"] - 1.0  # no restart from random weights
    assert (run2 / "checkpoints" / "step-000016.ckpt").is_dir()

    # Resuming it again with the same max_steps: nothing to train; said before any run directory exists.
    proc = run_recipe("train.py", f"output_root={tmp_path}", "resume=true", "trainer.max_steps=16", returncode=2)
    assert "already reached trainer.max_steps=16" in proc.stderr and "trainer.max_steps=32" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in (tmp_path / "llama_tiny").iterdir()) == ["run1", "run2"]


def test_moe_tiny_trains_and_logs_tokens_per_expert(tmp_path):
    run = tmp_path / "moe_tiny" / "run"
    # With the MoE plan (experts in groups of their own), one of its values overridden on the command line.
    proc = run_recipe("train.py", "model=moe_tiny", "plan=moe", "plan.fallback.prefetch=2", f"output_root={tmp_path}",
                      f"hydra.run.dir={run}", "trainer.max_steps=8", "trainer.checkpoint_every_n_steps=0",
                      "trainer.val_every_n_steps=8", "scheduler.warmup_steps=8")
    plan = yaml.safe_load((run / "plan.yaml").read_text())
    assert plan["plan"]["name"] == "moe"
    experts = plan["groups"]["model.layers.0.feed_forward.experts"]
    assert experts["prefetch"] == 2 and experts["sources"]["prefetch"] == "plan fallback"
    assert plan["params"]["model.layers.0.feed_forward.router.weight"]["optimizer"] == "adamw"
    assert "sharding plan (2 ranks):" in proc.stdout + proc.stderr
    # A warning every rank would log is printed once.
    assert (proc.stdout + proc.stderr).count("the run ends inside warmup") == 1
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model"] == "moe_tiny" and summary["steps"] == 8 and summary["loss_is_finite"]
    assert summary["final_loss"] < summary["first_loss"]
    assert not (run / "checkpoints").exists()
    rows = [r for r in read_metrics(run) if r.get("moe/layer0/expert0")]
    assert rows, "no tokens-per-expert metrics were logged"
    shares = [float(rows[-1][f"moe/layer1/expert{e}"]) for e in range(4)]
    assert sum(shares) == pytest.approx(1.0, abs=1e-5) and all(0 <= s <= 1 for s in shares)
    assert float(rows[-1]["moe/max_load"]) >= 1.0


def test_finetune_round_trip_from_and_to_hugging_face(tmp_path):
    # A Llama whose norm_eps and rope_theta are not the preset's: model=from_checkpoint (the default) reads them.
    # Its output head is zero: if (and only if) the weights are loaded, the first loss is exactly ln(256).
    # The README's command as it is, on the default 2 processes: the export (rank 0 alone, after training) reads
    # the checkpoint without a collective the other rank would have to join.
    transformers = pytest.importorskip("transformers")
    arch = llama_config("tiny")
    arch.norm_eps, arch.rope_theta = 1e-6, 10000.0
    model = Llama(arch)
    with torch.no_grad():
        model.output.weight.zero_()
    save_pretrained(model, arch, tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    run = tmp_path / "ft" / "run"
    run_recipe("finetune.py", f"init_from={tmp_path / 'hf'}", f"output_root={tmp_path}", f"hydra.run.dir={run}",
               "trainer.max_steps=4", "trainer.checkpoint_every_n_steps=0",
               "trainer.limit_val_batches=0", "export_hf=true")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["init_from"] == str(tmp_path / "hf") and summary["steps"] == 4
    assert summary["strategy"] == "VeScaleStrategy" and summary["world_size"] == 2
    assert summary["losses"][0]["loss"] == pytest.approx(math.log(256), abs=1e-4)
    assert summary["loss_is_finite"]

    # The way back: <run>/hf is a Hugging Face directory of the fine-tuned weights that transformers loads.
    hf_dir = run / "hf"
    assert (hf_dir / "tokenizer_config.json").read_text() == '{"model_max_length": 128}\n'
    exported = json.loads((hf_dir / "config.json").read_text())
    assert exported["rms_norm_eps"] == 1e-6 and exported["model_type"] == "llama"
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    tuned = Llama(arch)
    tuned.load_state_dict(read_model_state(run / "checkpoints" / "last.ckpt"))
    assert tuned.output.weight.abs().sum() > 0  # trained, not the zero head it started from
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, tuned.eval()(tokens), rtol=1e-4, atol=1e-4)


def test_config_mistakes_stop_before_anything_is_written(tmp_path):
    arch = moe_config("tiny")
    arch.shared_expert_gate = True
    save_pretrained(MoE(arch), arch, tmp_path / "hf")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for script, overrides, message in [
        ("finetune.py", [f"init_from={tmp_path / 'hf'}", "model=moe_tiny"],
         "does not match model=moe_tiny:\n  shared_expert_gate: checkpoint True"),
        ("train.py", ["+foo=1"], "unknown config key(s): foo"),
        # A nested target of the package that would replace a directory (issue 25): refused, nothing runs.
        ("train.py", [f"strategy.granularity={{_target_:lightning_vescale.export.export_hf,source:{tmp_path / 'hf'},"
                      f"output_dir:{victim},overwrite:true}}"], "is not something a config may build"),
        ("train.py", ["trainer.max_step=20"], "(did you mean trainer.max_steps?)"),  # checked before Hydra's app
        ("train.py", ["strategy.replicate_size=3"], "strategy.replicate_size=3 does not divide the 2 processes"),
    ]:
        cmd = [sys.executable, str(ROOT / "recipes" / script), *overrides, f"output_root={tmp_path / 'out'}"]
        proc = run_command(cmd, env=env, timeout=120)
        assert proc.returncode == 2, (proc.stdout, proc.stderr)
        assert f"{script}: error: " in proc.stderr and message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and "Initializing distributed" not in proc.stdout + proc.stderr
        assert not (tmp_path / "out").exists()  # no run directory left behind
    assert (victim / "keep.txt").read_text() == "precious"


def test_memory_placements_train_like_the_device(tmp_path):
    """memory=offload_disk (weights, gradients, optimizer states and activations on disk, the ledger in the log
    line) and memory=budget (which chooses by the cost model and prints its table) give the losses of the plain
    run, bitwise (the same ops on the same bytes); memory= with another strategy is refused."""
    common = ("trainer.max_steps=6", "trainer.checkpoint_every_n_steps=0", "trainer.val_every_n_steps=6",
              f"output_root={tmp_path}")
    losses = {}
    for name, extra in [("device", ()), ("disk", ("memory=offload_disk", "trainer.enable_progress_bar=true")),
                        ("budget", ("memory=budget", "memory.budget=5MiB"))]:
        run_dir = tmp_path / name
        proc = run_recipe("train.py", *common, f"hydra.run.dir={run_dir}", *extra)
        losses[name] = [p["loss"] for p in json.loads((run_dir / "summary.json").read_text())["losses"]]
        if name == "disk":  # the ledger in the log line: weights on disk between steps, brought in during them
            assert re.search(r"mem activations disk .*\| grads dev .*\| optimizer_states .*\| params dev \S+ \S+/\S+ \S+ disk [1-9]",
                             proc.stdout + proc.stderr), proc.stderr[-2000:]
        if name == "budget":
            assert "placement chosen by the cost model" in proc.stdout + proc.stderr
            assert "| activations | checkpoint |" in proc.stdout + proc.stderr
    assert losses["disk"] == losses["device"] and losses["budget"] == losses["device"], losses
    proc = run_recipe("train.py", *common, f"hydra.run.dir={tmp_path / 'ddp'}", "strategy=ddp", "memory=offload_disk",
                      returncode=2)
    assert "memory=... needs strategy=vescale" in proc.stderr + proc.stdout


def test_memory_budget_too_small_is_a_config_error(tmp_path):
    proc = run_recipe("train.py", "memory=budget", "memory.budget=1MiB", f"output_root={tmp_path}",
                      f"hydra.run.dir={tmp_path / 'run'}", returncode=2)
    assert "memory.budget=1MiB: a budget of 1.0 MiB per rank is too small" in proc.stderr
    assert "Raise the budget to at least" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_run_started_when_its_folder_exists_writes_to_a_new_one(tmp_path):
    """Another run of the same name started in the same second owns the timestamped folder: this one (both of
    its ranks) writes to ``<time>_2`` and leaves the other's folder alone (issue 25)."""
    import time

    taken = set()
    for ahead in range(0, 180):  # every second this run may start in
        folder = tmp_path / "llama_tiny" / time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(time.time() + ahead))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "other_run.txt").write_text("mine")
        taken.add(folder)
    proc = run_recipe("train.py", f"output_root={tmp_path}", "trainer.max_steps=2", "trainer.val_every_n_steps=2",
                      "trainer.checkpoint_every_n_steps=0")
    new = [p for p in (tmp_path / "llama_tiny").iterdir() if p not in taken]
    assert len(new) == 1 and new[0].name.endswith("_2"), new
    assert f"this run writes to {new[0]}" in proc.stderr
    assert (new[0] / "summary.json").is_file() and (new[0] / "csv" / "metrics.csv").is_file()
    for folder in taken:
        assert [p.name for p in folder.iterdir()] == ["other_run.txt"], folder


def test_a_run_whose_loss_turns_non_finite_stops_before_the_step_and_keeps_its_checkpoint(tmp_path):
    """optimizer.lr=1e30 is finite (accepted) but blows the weights up: step 2's loss is not finite, and both
    ranks stop before its optimizer step, naming it; the checkpoint of step 1 is the last one (issue 25)."""
    run = tmp_path / "run"
    proc = run_recipe("train.py", f"output_root={tmp_path}", f"hydra.run.dir={run}", "optimizer.lr=1e30",
                      "scheduler.warmup_steps=0", "trainer.max_steps=6", "trainer.checkpoint_every_n_steps=1",
                      "trainer.gradient_clip_val=null", returncode=1)
    assert re.search(r"step 2: non-finite (loss|gradients) on rank\(s\) \[0, 1\].*Stopped on every rank before the "
                     r"optimizer step.*\(last checkpoint: .*step-000001\.ckpt\)", proc.stdout + proc.stderr), (proc.stdout + proc.stderr)[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert os.path.realpath(run / "checkpoints" / "last.ckpt").endswith("step-000001.ckpt")
    state = read_model_state(run / "checkpoints" / "last.ckpt")
    assert all(torch.isfinite(v).all() for v in state.values())


def test_adamw8bit_recipe_cuts_on_blocks_and_resumes(tmp_path):
    # optimizer=adamw8bit: the strategy cuts on the 8-bit blocks, the run trains, and its sharded checkpoint (codes
    # and per-block scales) resumes through the Trainer on another world size (2 -> 1 process: the weights, the
    # 8-bit states and the data position reshard; 2 -> 3 ranks at the engine level in test_adamw8bit.py).
    run1 = tmp_path / "llama_tiny" / "run1"
    run_recipe("train.py", "optimizer=adamw8bit", f"output_root={tmp_path}", f"hydra.run.dir={run1}")
    summary = json.loads((run1 / "summary.json").read_text())
    assert summary["optimizer"] == "lightning_vescale.optim.AdamW8bit" and summary["world_size"] == 2
    assert summary["final_loss_mean_last_10"] < summary["first_loss"] - 1.0, summary["losses"]
    params = yaml.safe_load((run1 / "plan.yaml").read_text())["params"]
    assert {p["granularity"] for p in params.values()} == {"elements:256"}, params
    run2 = tmp_path / "llama_tiny" / "run2"
    proc = run_recipe("train.py", "optimizer=adamw8bit", f"output_root={tmp_path}", f"hydra.run.dir={run2}",
                      "resume=true", "trainer.max_steps=14", "trainer.devices=1")
    assert "the position was saved on 2 rank(s) and is loaded on 1" in proc.stdout + proc.stderr
    resumed = json.loads((run2 / "summary.json").read_text())
    assert resumed["world_size"] == 1 and resumed["resumed_from_step"] == 12 and resumed["steps"] == 14
    assert resumed["first_loss"] < summary["first_loss"] - 1.0  # weights and states restored, not restarted
    assert abs(resumed["first_loss"] - summary["losses"][-1]["loss"]) < 0.5

"""The VLM recipe's layout: does ``mpmd.layout=auto`` (the cost model's pick) train faster than uniform sharding, and
is its pick the layout that measures fastest?

    python benchmarks/mpmd_recipe_bench.py --steps 20 --top 6 --recipe-steps 30 --repeats 2

1. Layouts, side by side in one 4-process run (engines interleaved step by step, so other users' load hits all of
   them alike): uniform sharding, the written plan of ``configs/experiment/vlm_mpmd.yaml`` (encoder 1 rank, decoder
   3, 1F1B, 4 micro-batches) and the ``--top`` layouts the cost model ranks fastest among all candidates
   (:func:`lightning_vescale.pipeline.candidate_plans`): median wall time per step, CPU seconds per step summed
   over the ranks, predicted step time.
2. The recipe itself: ``recipes/train.py experiment=vlm_mpmd`` with ``mpmd.layout=auto`` and with
   ``mpmd.layout=uniform``, alternated ``--repeats`` times; each run's median step time and CPU time per step from
   its ``summary.json``.

Writes ``benchmarks/results/mpmd_recipe.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.mpmd_bench import WORLD, _run_ranks  # noqa: E402 - after the path

EXPERIMENT = ROOT / "configs" / "experiment" / "vlm_mpmd.yaml"


def _config():
    from lightning_vescale.recipe.mpmd import MPMDConfig

    return MPMDConfig(**yaml.safe_load(EXPERIMENT.read_text())["mpmd"])


def _layouts(top: int) -> tuple[dict, dict, str]:
    """Name -> plan dict (None: uniform) to measure; name -> predicted seconds; the cost model's pick."""
    config = _config()
    best, costs = config.choose(WORLD, "cpu")
    predicted = {c.name.removeprefix("mpmd:"): c.step_seconds for c in costs}
    chosen = "uniform" if best is None else best.name
    written = dict(config.mpmd_plan().to_dict(), name="written: 1+3 1f1b M=4")
    from lightning_vescale.pipeline import candidate_plans

    by_name = {p.name: p.to_dict() for p in candidate_plans(config.plan, WORLD, config.batch_size)}
    layouts: dict = {"uniform": None, written["name"]: written}
    for name in list(predicted)[: top + 1]:
        if name != "uniform" and name in by_name:
            layouts[name] = by_name[name]
    predicted[written["name"]] = predicted.get("1+3 1f1b M=4")
    return layouts, predicted, chosen


def _worker(rank: int, init_file: str, layouts: dict, steps: int, warmup: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    import lightning_vescale as lv
    from lightning_vescale.models.vlm import VLM, synthetic_vlm_batch, vlm_config
    from lightning_vescale.pipeline import MPMDModel, lm_loss

    config = _config()
    arch = vlm_config(config.model)
    batch, seq = config.batch_size, config.seq_len
    images, tokens, _ = synthetic_vlm_batch(arch, batch, seq, 0)
    models = {}
    for name, plan in layouts.items():
        torch.manual_seed(0)
        model = (lv.parallelize(VLM(arch), plan, example_inputs=(images, tokens)) if plan
                 else lv.parallelize(VLM(arch), None, init_device_mesh("cpu", (WORLD,))))
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    mine = slice(rank * batch // WORLD, (rank + 1) * batch // WORLD)
    wall: dict = {name: [] for name in layouts}
    cpu: dict = {name: [] for name in layouts}
    for i in range(warmup + steps):
        images, tokens, target = synthetic_vlm_batch(arch, batch, seq, i)
        for name, (model, opt) in models.items():
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            if isinstance(model, MPMDModel):
                model.step(images, tokens, target=target)
                model.clip_grad_norm_(1.0)
            else:
                lm_loss(model(images[mine], tokens[mine]), target[mine]).backward()
                lv.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            used = time.process_time() - start_cpu
            dist.barrier()
            if i >= warmup:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(used)
    everyone: list = [None] * WORLD
    dist.all_gather_object(everyone, {name: statistics.median(c) for name, c in cpu.items()})
    if rank == 0:
        Path(out).write_text(json.dumps({"wall": wall, "cpu": everyone}))
    dist.destroy_process_group()


def _recipe(layout: str, steps: int, tmp: Path) -> dict:
    run = tmp / f"{layout}-{time.monotonic_ns()}"
    cmd = [sys.executable, str(ROOT / "recipes" / "train.py"), "experiment=vlm_mpmd", f"mpmd.layout={layout}",
           f"trainer.max_steps={steps}", "trainer.checkpoint_every_n_steps=0", f"output_root={tmp}",
           f"hydra.run.dir={run}"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return json.loads((run / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=6, help="measure the cost model's fastest N layouts")
    parser.add_argument("--recipe-steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    load_start = os.getloadavg()
    layouts, predicted, chosen = _layouts(args.top)
    raw = _run_ranks(_worker, layouts, args.steps, args.warmup)
    measured = {name: {"median_s": statistics.median(t), "cpu_s": sum(r[name] for r in raw["cpu"])}
                for name, t in raw["wall"].items()}
    recipe: dict = {"auto": [], "uniform": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for layout in ("auto", "uniform"):
                s = _recipe(layout, args.recipe_steps, Path(tmp))
                recipe[layout].append({"layout": s["layout"], "median_s": s["step_time_s_median"],
                                       "cpu_s": s["cpu_time_s_per_step"], "final_loss": s["final_loss"]})
    result = {"command": "python benchmarks/mpmd_recipe_bench.py " + " ".join(sys.argv[1:]), "chosen": chosen,
              "predicted": predicted, "measured": measured, "recipe": recipe, "load_average_start": load_start,
              "load_average_end": os.getloadavg()}
    out = ROOT / "benchmarks" / "results"
    (out / "mpmd_recipe.json").write_text(json.dumps(result, indent=2))
    (out / "mpmd_recipe.md").write_text(_markdown(result))
    print(_markdown(result))


def _markdown(r: dict) -> str:
    base = r["measured"]["uniform"]
    fastest = min(r["measured"], key=lambda n: r["measured"][n]["median_s"])
    lines = [
        "# The VLM recipe's layout: the cost model's pick against uniform sharding",
        "",
        f"`{r['command']}`; load average {r['load_average_start'][0]:.1f} at the start, "
        f"{r['load_average_end'][0]:.1f} at the end (2 CPU cores shared with other users).",
        "",
        "## Layouts side by side (one 4-process run, interleaved step by step)",
        "",
        "| layout | wall ms/step | vs uniform | CPU ms/step (4 ranks) | vs uniform | predicted ms | vs uniform |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    pu = r["predicted"]["uniform"]
    for name, m in sorted(r["measured"].items(), key=lambda kv: kv[1]["median_s"]):
        p = r["predicted"].get(name)
        mark = " (chosen)" if name == r["chosen"] else ""
        lines.append(f"| {name}{mark} | {1e3 * m['median_s']:.1f} | {m['median_s'] / base['median_s']:.2f}x | "
                     f"{1e3 * m['cpu_s']:.0f} | {m['cpu_s'] / base['cpu_s']:.2f}x | "
                     f"{'-' if p is None else f'{1e3 * p:.1f}'} | {'-' if p is None else f'{p / pu:.2f}x'} |")
    chosen = r["measured"].get(r["chosen"], base)
    lines += ["", f"Measured fastest: {fastest}; chosen by the cost model: {r['chosen']} "
              f"({chosen['median_s'] / r['measured'][fastest]['median_s']:.2f}x the fastest's wall time).", "",
              "## The recipe (`recipes/train.py experiment=vlm_mpmd`), `mpmd.layout=auto` against `uniform`", "",
              "| run | layout | median ms/step | CPU ms/step (4 ranks) | final loss |", "|---|---|---:|---:|---:|"]
    for layout in ("auto", "uniform"):
        for i, s in enumerate(r["recipe"][layout]):
            lines.append(f"| {layout} #{i + 1} | {s['layout']} | {1e3 * s['median_s']:.1f} | {1e3 * s['cpu_s']:.0f} | "
                         f"{s['final_loss']:.3f} |")
    auto = statistics.median(s["median_s"] for s in r["recipe"]["auto"])
    uni = statistics.median(s["median_s"] for s in r["recipe"]["uniform"])
    auto_cpu = statistics.median(s["cpu_s"] for s in r["recipe"]["auto"])
    uni_cpu = statistics.median(s["cpu_s"] for s in r["recipe"]["uniform"])
    lines += ["", f"Recipe: auto / uniform median step time {auto / uni:.2f}x, CPU time {auto_cpu / uni_cpu:.2f}x; "
              f"the goal (at least 10% faster than uniform) is {'met' if auto / uni <= 0.9 else 'not met'} in this run."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

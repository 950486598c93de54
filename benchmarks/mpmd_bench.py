"""MPMD vs uniform sharding of the small VLM at 4 ranks: measured step time on this machine, predicted step time and
bubble fraction from the dry-run cost model (:mod:`lightning_vescale.pipeline._cost`) on the ``cpu`` and ``h200``
profiles.

Run: ``python benchmarks/mpmd_bench.py`` (writes ``benchmarks/results/mpmd.{json,md}``); ``--steps`` and
``--warmup`` change the number of timed and untimed steps per layout.

Layouts (global batch 12 images + 16 caption tokens, fp32, AdamW, clipping at 1.0):

* ``uniform``: the whole VLM sharded over all 4 ranks with the default plan (each transformer block a group),
  3 samples per rank;
* ``mpmd 1+3 1f1b`` / ``gpipe``: encoder + projector on rank 0, the decoder sharded over ranks 1-3 (one
  pipeline, a team of 3), 4 micro-batches;
* ``mpmd 2+2 1f1b``: encoder + projector sharded over ranks 0-1, the decoder over ranks 2-3 (two pipelines side
  by side), 3 micro-batches; ``M=2``: 2 micro-batches; ``regather``: 3 micro-batches with ``gather_once: false``
  (every micro-batch gathers the stage's parameters again, as before ``gather_once``).

Every MPMD layout but ``regather`` gathers each stage's parameters once per step (``gather_once``, the default).

All layouts live in the same 4 processes and their steps are interleaved (one step of each in turn), so a change
in the machine's load hits them alike. A step is timed on rank 0 between two barriers of all ranks; each rank also
measures the CPU time its process used in the step (``time.process_time``, all its threads): their sum over the
ranks is the machine's work per step, which the load of other processes does not change (wall time it does). The 4
processes share 2 CPU cores (with whatever else runs on the machine): compute does not speed up with ranks, so
this machine measures overheads (collectives, pipeline bubbles, team traffic) more than parallel speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCH, SEQ, WORLD = 12, 16, 4
ENCODER_PLAN = {"rules": [{"match": "encoder.blocks.*", "group": True}]}


def mpmd_plan(vision: int, language: int, schedule: str, microbatches: int, gather_once: bool = True) -> dict:
    return {"name": f"{vision}+{language} {schedule} M={microbatches}" + ("" if gather_once else " regather"),
            "schedule": schedule, "microbatches": microbatches, "gather_once": gather_once, "stages": [
                {"name": "vision", "modules": ["encoder", "projector"], "ranks": vision, "plan": ENCODER_PLAN},
                {"name": "language", "modules": ["decoder"], "ranks": language, "plan": "llama"}]}


LAYOUTS = {
    "uniform": None,
    "mpmd 1+3 1f1b": mpmd_plan(1, 3, "1f1b", 4),
    "mpmd 1+3 gpipe": mpmd_plan(1, 3, "gpipe", 4),
    "mpmd 2+2 1f1b": mpmd_plan(2, 2, "1f1b", 3),
    "mpmd 2+2 1f1b M=2": mpmd_plan(2, 2, "1f1b", 2),
    "mpmd 2+2 1f1b regather": mpmd_plan(2, 2, "1f1b", 3, gather_once=False),
}


def _worker(rank: int, init_file: str, steps: int, warmup: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    import lightning_vescale as lv
    from lightning_vescale.models.vlm import VLM, synthetic_vlm_batch, vlm_config
    from lightning_vescale.pipeline import MPMDModel, lm_loss

    config = vlm_config("small")
    models = {}
    for name, plan in LAYOUTS.items():
        torch.manual_seed(0)
        model = VLM(config)
        model = lv.parallelize(model, plan) if plan else lv.parallelize(model, None, init_device_mesh("cpu", (WORLD,)))
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def step(model, opt, i):
        images, tokens, target = synthetic_vlm_batch(config, BATCH, SEQ, i)
        if isinstance(model, MPMDModel):
            loss = model.step(images, tokens, target=target)
            model.clip_grad_norm_(1.0)
        else:
            mine = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
            loss = lm_loss(model(images[mine], tokens[mine]), target[mine])
            loss.backward()
            lv.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    times = {name: [] for name in LAYOUTS}
    cpu = {name: [] for name in LAYOUTS}
    for i in range(warmup + steps):
        for name, (model, opt) in models.items():
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            step(model, opt, i)
            used = time.process_time() - start_cpu
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
                cpu[name].append(used)
    per_rank = [None] * WORLD
    dist.all_gather_object(per_rank, {name: statistics.median(c) for name, c in cpu.items()})
    if rank == 0:
        Path(out).write_text(json.dumps({"wall": times, "cpu": per_rank}))
    dist.destroy_process_group()


MEMORY_LAYOUTS = ("mpmd 2+2 1f1b", "mpmd 2+2 1f1b regather")


def _memory_worker(rank: int, init_file: str, name: str, out: str) -> None:
    """Peak resident set of a training step above the baseline after the imports and the process group."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    import lightning_vescale as lv
    from benchmarks._memory import peak_rss_bytes, reset_peak_rss, rss_bytes
    from lightning_vescale.models.vlm import VLM, synthetic_vlm_batch, vlm_config

    config = vlm_config("small")
    baseline = rss_bytes()
    torch.manual_seed(0)
    model = lv.parallelize(VLM(config), LAYOUTS[name])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    peaks = []
    for i in range(3):
        images, tokens, target = synthetic_vlm_batch(config, BATCH, SEQ, i)
        dist.barrier()
        reset_peak_rss()
        model.step(images, tokens, target=target)
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        peaks.append(peak_rss_bytes() - baseline)
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, max(peaks[1:]))  # after the first step (optimizer states exist)
    if rank == 0:
        Path(out).write_text(json.dumps(everyone))
    dist.destroy_process_group()


def measure_memory() -> dict:
    """Each of :data:`MEMORY_LAYOUTS` in its own 4 fresh processes (glibc set to return freed memory)."""
    from benchmarks._memory import MALLOC_ENV

    os.environ.update(MALLOC_ENV)  # read by the spawned interpreters' glibc at start
    return {name: _run_ranks(_memory_worker, name) for name in MEMORY_LAYOUTS}


def _run_ranks(worker, *args) -> dict:
    """``worker(rank, pg_file, *args, out_json)`` on :data:`WORLD` fresh processes; what rank 0 wrote to the JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker, args=(r, os.path.join(tmp, "pg"), *args, out)) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        return json.loads(Path(out).read_text())


def predictions() -> dict:
    from lightning_vescale.models.vlm import VLM, synthetic_vlm_batch, vlm_config
    from lightning_vescale.pipeline import choose_layout
    from lightning_vescale.plan._hardware import load_profile

    config = vlm_config("small")
    with torch.device("meta"):
        model = VLM(config)
    images, tokens, _ = synthetic_vlm_batch(config, BATCH, SEQ, 0)
    out = {}
    for hardware in ("cpu", "h200"):
        best, costs = choose_layout(model, (images, tokens), WORLD, load_profile(hardware),
                                    [p for p in LAYOUTS.values() if p])
        out[hardware] = {"chosen": "uniform" if best is None else best.name, "costs": [c.to_dict() for c in costs]}
    return out


def calibrate(measured: dict) -> dict:
    """Fit the ``cpu`` profile's ``op_overhead``, ``microbatch_overhead`` and ``tensor_overhead`` (least squares) to
    the measured CPU seconds of every rank: each rank's predicted busy time without them, plus operators x
    micro-batches x ``op_overhead``, micro-batches x ``microbatch_overhead``, parameter tensors x ``tensor_overhead``."""
    import dataclasses

    import numpy as np

    from lightning_vescale.models.vlm import VLM, synthetic_vlm_batch, vlm_config
    from lightning_vescale.pipeline import predict_mpmd, predict_uniform
    from lightning_vescale.pipeline._spec import MPMDPlan
    from lightning_vescale.plan._hardware import load_profile

    config = vlm_config("small")
    with torch.device("meta"):
        model = VLM(config)
    images, tokens, _ = synthetic_vlm_batch(config, BATCH, SEQ, 0)
    bare = dataclasses.replace(load_profile("cpu"), op_overhead=0.0, microbatch_overhead=0.0, tensor_overhead=0.0)
    rows, target = [], []
    for name, m in measured.items():
        plan = LAYOUTS[name]
        if plan is None:
            cost, micro, modules = predict_uniform(model, (images, tokens), WORLD, bare), 0, [[model]] * WORLD
        else:
            plan = MPMDPlan.from_dict(plan)
            cost, micro = predict_mpmd(model, plan, (images, tokens), bare), plan.microbatches
            modules = [[model.get_submodule(n) for n in s.modules] for s in plan.stages for _ in range(s.ranks)]
        stages = [s for s in cost.stages for _ in range(s.ranks)]
        for stage, mods, seconds in zip(stages, modules, m["cpu_s_per_rank"]):
            tensors = sum(1 for mod in mods for _ in mod.parameters())
            rows.append([stage.ops * max(micro, 1), micro, tensors])
            target.append(seconds - stage.busy_seconds)
    X, y = np.array(rows, dtype=float), np.array(target)
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    rms = float(np.sqrt(np.mean((X @ coef - y) ** 2)))
    return {"op_overhead": float(coef[0]), "microbatch_overhead": float(coef[1]), "tensor_overhead": float(coef[2]),
            "rms_residual_s": rms, "ranks": len(y)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--calibrate", action="store_true", help="fit the cpu profile's overheads to this run's "
                        "CPU seconds per rank (printed and saved; the profile file is not changed)")
    parser.add_argument("--memory", action="store_true", help="also the peak RSS per rank of "
                        + " and ".join(MEMORY_LAYOUTS) + ", each in fresh processes")
    args = parser.parse_args()
    load_start = os.getloadavg()
    predicted = predictions()
    raw = _run_ranks(_worker, args.steps, args.warmup)
    measured = {name: {"median_s": statistics.median(t), "min_s": min(t), "steps": len(t),
                       "cpu_s_per_rank": [r[name] for r in raw["cpu"]]} for name, t in raw["wall"].items()}
    load = os.getloadavg()
    memory = measure_memory() if args.memory else None
    fit = calibrate(measured) if args.calibrate else None
    result = {"memory_peak_rss_bytes": memory, "calibration": fit, "batch": BATCH, "seq_len": SEQ, "world_size": WORLD, "measured": measured, "predicted": predicted,
              "load_average_start": load_start, "load_average": load, "command": "python benchmarks/mpmd_bench.py " + " ".join(sys.argv[1:])}
    results = ROOT / "benchmarks" / "results"
    (results / "mpmd.json").write_text(json.dumps(result, indent=2))
    (results / "mpmd.md").write_text(_markdown(result))
    print(_markdown(result))


def _markdown(r: dict) -> str:
    base = r["measured"]["uniform"]
    base_cpu = sum(base["cpu_s_per_rank"])
    pred = {hw: {c["name"]: c for c in r["predicted"][hw]["costs"]} for hw in r["predicted"]}
    base_pred = pred["cpu"]["uniform"]["step_seconds"]
    lines = [
        "# MPMD vs uniform sharding: the small VLM at 4 ranks",
        "",
        f"`{r['command'].strip()}`; global batch {r['batch']} images + {r['seq_len']} caption tokens, fp32, AdamW. "
        f"Load average {r['load_average_start'][0]:.1f} at the start, {r['load_average'][0]:.1f} at the end "
        "(2 CPU cores shared with other users).",
        "",
        "Measured: median wall time per step, and the CPU time of a step summed over the 4 ranks (the machine's "
        "work, which other users' load does not inflate). Predicted (cost model, `cpu` profile): step time, bubble "
        "fraction of the schedule, unsharded parameters a rank of the decoder's stage holds through the step "
        "(`gather_once`).",
        "",
        "| layout | wall ms/step | vs uniform | CPU ms/step (4 ranks) | vs uniform | predicted cpu ms | vs uniform "
        "| predicted bubble | held unsharded MB | predicted h200 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in r["measured"].items():
        key = "uniform" if name == "uniform" else f"mpmd:{next(p for n, p in LAYOUTS.items() if n == name)['name']}"
        cpu, h200 = pred["cpu"][key], pred["h200"][key]
        work = sum(m["cpu_s_per_rank"])
        held = max((s["unsharded_bytes"] for s in cpu["stages"]), default=0.0) / 2**20
        lines.append(f"| {name} | {1e3 * m['median_s']:.1f} | {m['median_s'] / base['median_s']:.2f}x | "
                     f"{1e3 * work:.0f} | {work / base_cpu:.2f}x | {1e3 * cpu['step_seconds']:.1f} | "
                     f"{cpu['step_seconds'] / base_pred:.2f}x | {cpu['bubble_fraction']:.2f} | {held:.1f} | "
                     f"{1e3 * h200['step_seconds']:.3f} |")
    fastest = min(r["measured"], key=lambda n: r["measured"][n]["median_s"])
    best = min((n for n in r["measured"] if n != "uniform"), key=lambda n: r["measured"][n]["median_s"])
    ratio = r["measured"][best]["median_s"] / base["median_s"]
    lines += ["", f"Measured fastest: {fastest}. Chosen by the cost model: cpu -> {r['predicted']['cpu']['chosen']}, "
                  f"h200 -> {r['predicted']['h200']['chosen']}.", "",
              f"Goal (the best MPMD layout at least 10% faster than uniform sharding, the encoder being small next to "
              f"the decoder): {'met' if ratio <= 0.9 else 'not met'} in this run, {best} at {ratio:.2f}x uniform's "
              f"wall time ({1 / ratio:.2f}x the throughput) and {sum(r['measured'][best]['cpu_s_per_rank']) / base_cpu:.2f}x "
              "its CPU time. The h200 column is the cost model only, not measured; its profile prices no per-operator "
              "overhead (`op_overhead: 0`), which for a model this small (about 2000 kernels a step) would dominate "
              "on a GPU, so it is no prediction of this model's H200 step.", ""]
    from lightning_vescale.plan._hardware import load_profile

    cpu = load_profile("cpu")
    lines += [f"The `cpu` profile's overheads (`lightning_vescale/plan/profiles/cpu.yaml`): op_overhead "
              f"{cpu.op_overhead:.2g} s, microbatch_overhead {cpu.microbatch_overhead:.2g} s, tensor_overhead "
              f"{cpu.tensor_overhead:.2g} s, cores {cpu.cores}, fitted to the CPU seconds per rank of two earlier runs "
              "of these layouts (`--calibrate` fits them to a run)."]
    if r.get("calibration"):
        c = r["calibration"]
        lines += [f"This run's fit over {c['ranks']} ranks: op_overhead {c['op_overhead']:.2g} s, microbatch_overhead "
                  f"{c['microbatch_overhead']:.2g} s, tensor_overhead {c['tensor_overhead']:.2g} s, rms residual "
                  f"{1e3 * c['rms_residual_s']:.1f} ms per rank."]
    lines.append("")
    if r.get("memory_peak_rss_bytes"):
        lines += ["Peak resident set per rank during a step, above the baseline after the imports and the process "
                  "group (`--memory`: each layout in 4 fresh processes, glibc returning freed blocks of 128 KiB and "
                  "more), MiB:", "", "| layout | rank 0 | rank 1 | rank 2 | rank 3 |", "|---|---:|---:|---:|---:|"]
        for name, peaks in r["memory_peak_rss_bytes"].items():
            lines.append(f"| {name} | " + " | ".join(f"{b / 2**20:.1f}" for b in peaks) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

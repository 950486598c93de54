"""The cost of RaggedTensor parameters in the optimizer step: AdamW on the sharded parameters vs on plain pieces.

    python benchmarks/optim_bench.py                      # 2 gloo ranks, writes benchmarks/results/optim.*

Each rank shards the training benchmark's 34M-parameter model (``bench_small``: every block, then the root),
gives every parameter a gradient, and builds two AdamW optimizers that do the same arithmetic on the same
amount of data: one on the model's RaggedTensor parameters (``model.parameters()``, what users pass), one on
plain ``nn.Parameter`` copies of the local pieces (``p.to_local()``) with copies of the gradient pieces. Their
steps alternate (which goes first alternates too), so background load hits both alike; the report is the
median step time of each and their ratio, for the single-tensor path (the CPU default) and ``foreach``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train_bench  # noqa: E402

from lightning_vescale.engine.tensor import RaggedTensor  # noqa: E402


def _pair(setup: train_bench.Setup, world: int, foreach: bool):
    model, _, _, _ = train_bench.build("vescale", setup, world)
    ragged = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(dist.get_rank())
    plain = []
    for p in ragged:
        local = p.to_local()
        grad = torch.randn(local.shape, generator=gen, dtype=local.dtype)
        p.grad = RaggedTensor(grad.clone(), p.layout_info)
        q = nn.Parameter(local.detach().clone())
        q.grad = grad
        plain.append(q)
    return (model, torch.optim.AdamW(ragged, lr=1e-4, foreach=foreach)), torch.optim.AdamW(plain, lr=1e-4, foreach=foreach)


def _time(optimizer: torch.optim.Optimizer) -> tuple[float, float]:
    """(CPU time of this thread, wall time) of one step: the step is single-threaded, so its CPU time is what it
    costs, whatever else the shared machine runs meanwhile."""
    cpu, wall = time.thread_time(), time.perf_counter()
    optimizer.step()
    return time.thread_time() - cpu, time.perf_counter() - wall


def worker(rank: int, world: int, init_file: str, args, out_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    setup = train_bench.SETUPS["dense"]
    results = {}
    for foreach in (False, True):
        (model, on_ragged), on_plain = _pair(setup, world, foreach)
        times = {"ragged": [], "plain": []}
        walls = {"ragged": [], "plain": []}
        for i in range(args.warmup + args.steps):
            order = [("ragged", on_ragged), ("plain", on_plain)]
            if i % 2:
                order.reverse()
            for name, optimizer in order:
                cpu, wall = _time(optimizer)
                if i >= args.warmup:
                    times[name].append(cpu)
                    walls[name].append(wall)
        # Same arithmetic on the same data: the two must end with the same parameters.
        same = all(torch.equal(p.to_local(), q) for p, q in zip(
            [p for p in model.parameters() if p.requires_grad], on_plain.param_groups[0]["params"]))
        results["foreach" if foreach else "single-tensor"] = {
            "ragged_s": statistics.median(times["ragged"]),
            "plain_s": statistics.median(times["plain"]),
            "ragged_wall_s": statistics.median(walls["ragged"]),
            "plain_wall_s": statistics.median(walls["plain"]),
            "ragged_times": times["ragged"],
            "plain_times": times["plain"],
            # Each pair of adjacent steps shares the machine's load: the median of their ratios is steadier than the
            # ratio of the medians.
            "paired_ratio": statistics.median(r / q for r, q in zip(times["ragged"], times["plain"])),
            "same_result": same,
            "num_params": len(on_plain.param_groups[0]["params"]),
            "local_numel": sum(q.numel() for q in on_plain.param_groups[0]["params"]),
        }
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out_file).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def to_markdown(per_rank: list, args) -> str:
    lines = [
        "# Optimizer step: RaggedTensor parameters vs plain local pieces",
        "",
        f"AdamW on the `bench_small` model (34M parameters) sharded over {args.world_size} gloo ranks, CPU, "
        f"{os.cpu_count()} cores shared with other engineers' jobs; {args.steps} timed steps after {args.warmup} "
        "warm-up steps, the two optimizers alternating step by step. Times are the median CPU time of the step's thread "
        "(`time.thread_time`; the step is single-threaded, so this is its cost whatever else the shared machine "
        "runs); median wall times alongside. Paired ratio: the median over adjacent step pairs of ragged / plain.",
        "",
        "Command: `" + " ".join(["python benchmarks/optim_bench.py", *sys.argv[1:]]) + "`",
        "",
        "| AdamW path | rank | params | local elements | plain pieces CPU (ms) | RaggedTensors CPU (ms) | ratio | "
        "paired ratio | wall plain / ragged (ms) | wall ratio | same result |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in ("single-tensor", "foreach"):
        for rank, res in enumerate(per_rank):
            r = res[mode]
            lines.append(f"| {mode} | {rank} | {r['num_params']} | {r['local_numel']} | {1e3 * r['plain_s']:.1f} | "
                         f"{1e3 * r['ragged_s']:.1f} | {r['ragged_s'] / r['plain_s']:.3f} | {r['paired_ratio']:.3f} | "
                         f"{1e3 * r['plain_wall_s']:.1f} / {1e3 * r['ragged_wall_s']:.1f} | "
                         f"{r['ragged_wall_s'] / r['plain_wall_s']:.3f} | {r['same_result']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "optim"))
    args = parser.parse_args()
    per_rank = train_bench.run_processes(args.world_size, worker, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({"args": vars(args), "argv": sys.argv[1:], "per_rank": per_rank},
                                                   indent=1))
    Path(args.out + ".md").write_text(to_markdown(per_rank, args))
    print(to_markdown(per_rank, args))


if __name__ == "__main__":
    main()

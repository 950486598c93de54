"""Muon's cost in a training step: the same sharded model trained with Muon (+ AdamW for embeddings, head and norms)
and with AdamW alone, side by side on 2 and 4 gloo ranks.

    python benchmarks/muon_overhead_bench.py --world-sizes 2 4 --steps 6 --batch 4 --seq 128

The model is the benchmarks' ``bench_small`` (33.6M-parameter Llama shape), sharded with the ``llama`` plan; Muon's
run shards with ``granularity="muon"`` (every Muon matrix whole on one rank: Newton-Schulz runs where the momentum
is, no optimizer communication) and :func:`lightning_vescale.optim.build_optimizer`. Steps of the two are
interleaved (other users' load hits both alike); per step: the wall time of forward + backward + optimizer step,
the optimizer step alone, and the CPU seconds summed over the ranks. Also: the Newton-Schulz load per rank (max /
mean, Muon's own plan report) and the arithmetic: Newton-Schulz FLOPs per rank against the step's forward and
backward FLOPs (6 x tokens x parameters per rank), which sets the overhead a compute-bound machine would see.

Writes ``benchmarks/results/muon_overhead.{md,json}``.
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


def _config():
    from lightning_vescale.models.llama import LlamaConfig

    return LlamaConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=1536,
                       max_seq_len=512)


def _ns_flops(shape: tuple[int, ...], steps: int = 5) -> float:
    """Newton-Schulz FLOPs of one m x n matrix (m <= n after the transpose): per iteration A = X X^T (2 m^2 n),
    B = b A + c A A (2 m^3), X = a X + B X (2 m^2 n)."""
    m, n = sorted(shape[-2:])
    return steps * (4 * m * m * n + 2 * m**3)


def _worker(rank: int, world: int, init_file: str, args: dict, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    import lightning_vescale as lv
    from lightning_vescale.models.llama import Llama
    from lightning_vescale.optim import build_optimizer

    mesh = init_device_mesh("cpu", (world,))
    config = _config()
    engines = {}
    for name in ("adamw", "muon"):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Llama(config)
        lv.parallelize(model, "llama", mesh, granularity="muon" if name == "muon" else None)
        opt = (build_optimizer(model, lr=1e-3, mode="auto") if name == "muon"
               else torch.optim.AdamW(model.parameters(), lr=1e-3))
        engines[name] = (model, opt)
    report = engines["muon"][1].plan_report()
    loads = [sum(b["ns_cost_per_rank"][r] for b in report["buckets"]) for r in range(world)] if report["buckets"] else []
    wall: dict = {n: [] for n in engines}
    opt_wall: dict = {n: [] for n in engines}
    cpu: dict = {n: [] for n in engines}
    batch, seq = args["batch"], args["seq"]
    for i in range(args["warmup"] + args["steps"]):
        tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(i * 97 + rank))
        for name, (model, opt) in engines.items():
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            dist.barrier()
            start_opt = time.perf_counter()
            opt.step()
            opt.zero_grad()
            dist.barrier()
            end = time.perf_counter()
            if i >= args["warmup"]:
                wall[name].append(end - start)
                opt_wall[name].append(end - start_opt)
                cpu[name].append(time.process_time() - start_cpu)
    cpu_med = torch.tensor([statistics.median(cpu[n]) for n in engines], dtype=torch.float64)
    dist.all_reduce(cpu_med)
    params = sum(p.numel() for p in engines["adamw"][0].parameters())
    matrices = [tuple(p.shape) for n, p in engines["muon"][0].named_parameters()
                if p.ndim == 2 and ("attention" in n or "feed_forward" in n)]
    if rank == 0:
        Path(out).write_text(json.dumps({
            "wall": wall, "optimizer_wall": opt_wall, "cpu_s_sum_over_ranks": dict(zip(engines, cpu_med.tolist())),
            "ns_cost_per_rank": loads, "params": params, "muon_matrices": len(matrices),
            "ns_flops_total": sum(_ns_flops(s) for s in matrices),
            "train_flops_per_rank": 6 * batch * seq * params,
        }))
    dist.destroy_process_group()


def _run(world: int, args: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(tmp, "pg"), args, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    load_start = os.getloadavg()
    results = {str(w): _run(w, vars(args)) for w in args.world_sizes}
    out = {"command": "python benchmarks/muon_overhead_bench.py " + " ".join(sys.argv[1:]), "results": results,
           "load_average_start": load_start, "load_average_end": os.getloadavg()}
    path = ROOT / "benchmarks" / "results"
    (path / "muon_overhead.json").write_text(json.dumps(out, indent=2))
    (path / "muon_overhead.md").write_text(_markdown(out, vars(args)))
    print(_markdown(out, vars(args)))


def _markdown(r: dict, args: dict) -> str:
    lines = [
        "# Muon's cost in a training step (bench_small, 33.6M parameters, sharded with the llama plan)",
        "",
        f"`{r['command']}`; batch {args['batch']}x{args['seq']} tokens per rank, fp32, gloo on CPU; load average "
        f"{r['load_average_start'][0]:.1f} at the start, {r['load_average_end'][0]:.1f} at the end (2 cores shared "
        f"with other users). Medians of the timed steps, the two optimizers interleaved step by step.",
        "",
        "| ranks | step AdamW (s) | step Muon (s) | Muon / AdamW | optimizer step AdamW (s) | optimizer step Muon (s) "
        "| CPU s/step AdamW | CPU s/step Muon | CPU ratio | NS load max/mean | NS FLOPs per rank / fwd+bwd FLOPs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for world, res in r["results"].items():
        w = {n: statistics.median(t) for n, t in res["wall"].items()}
        o = {n: statistics.median(t) for n, t in res["optimizer_wall"].items()}
        c = res["cpu_s_sum_over_ranks"]
        loads = res["ns_cost_per_rank"]
        balance = max(loads) / (sum(loads) / len(loads)) if loads and sum(loads) else float("nan")
        ns_share = res["ns_flops_total"] / int(world) / res["train_flops_per_rank"]
        lines.append(f"| {world} | {w['adamw']:.3f} | {w['muon']:.3f} | {w['muon'] / w['adamw']:.2f}x | "
                     f"{o['adamw']:.3f} | {o['muon']:.3f} | {c['adamw']:.2f} | {c['muon']:.2f} | "
                     f"{c['muon'] / c['adamw']:.2f}x | {balance:.3f} | {ns_share:.2f} |")
    lines += ["", "The last column is arithmetic, not a measurement: Newton-Schulz FLOPs per rank (5 iterations on "
              "every Muon matrix, spread over the ranks) over the forward and backward FLOPs of the rank's batch "
              "(6 x tokens x parameters). Newton-Schulz work does not grow with the batch, so the overhead falls "
              "as tokens per rank grow."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

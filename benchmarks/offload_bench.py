"""Optimizer states on the disk tier: peak memory (as the operating system sees it) and step time, side by side.

    python benchmarks/offload_bench.py                      # bench_small (33.6M), 2 ranks, 6 steps
    python benchmarks/offload_bench.py --world-size 2 --steps 6 --model bench_small

Each configuration runs in fresh rank processes (the peak resident set is a high-water mark), with glibc told
to return freed blocks of 128 KiB or more to the system (``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``),
so the peak follows live memory. Reported per rank (max over ranks): peak RSS growth over the baseline taken
after imports, and the median step time after one warm-up step. Configurations: states in memory; states on
disk with prefetch; states on disk without prefetch (the cost prefetch hides).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "131072")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning_vescale as lv  # noqa: E402
from lightning_vescale.memory import MemoryPolicy, offload_optimizer_states  # noqa: E402
from lightning_vescale.models import Llama, LlamaConfig  # noqa: E402

MODELS = {
    "bench_small": LlamaConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=1536,
                               max_seq_len=256),
    "bench_tiny": LlamaConfig(vocab_size=1024, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=352,
                              max_seq_len=128),
}
CONFIGS = {
    "in memory": None,
    "disk, prefetch": dict(optimizer_states="disk", prefetch=True),
    "disk, no prefetch": dict(optimizer_states="disk", prefetch=False),
}


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rank(rank: int, world: int, init: str, model_name: str, config_name: str, steps: int, swap: str, out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    baseline = _rss_now()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(MODELS[model_name])
    for block in model.layers:
        lv.fully_shard(block)
    lv.fully_shard(model)
    lv.init_sharded_weights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    spec = CONFIGS[config_name]
    if spec is not None:
        offload_optimizer_states(opt, MemoryPolicy(disk_dir=os.path.join(swap, f"rank{rank}"), **spec))
    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps):
        tokens = torch.randint(0, MODELS[model_name].vocab_size, (2, 129), generator=g)
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    out.put((rank, _peak_rss() - baseline, statistics.median(times[1:])))
    dist.destroy_process_group()


def run(model_name: str, config_name: str, world: int, steps: int) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/pg"
        procs = [ctx.Process(target=_rank, args=(r, world, init, model_name, config_name, steps, tmp, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"{config_name}: a rank failed")
    rows = [out.get() for _ in range(world)]
    return {"peak_rss_mb": max(r[1] for r in rows) / 2**20, "step_s": max(r[2] for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench_small", choices=sorted(MODELS))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "offload"))
    args = parser.parse_args()
    results = {name: run(args.model, name, args.world_size, args.steps) for name in CONFIGS}
    base = results["in memory"]
    lines = [
        "# Optimizer states on the disk tier",
        "",
        f"Model `{args.model}`, {args.world_size} gloo ranks on this machine's CPUs (shared with other work), AdamW "
        f"fp32, batch 2x128 tokens per rank, {args.steps} steps (median after the first).",
        f"Command: `python benchmarks/offload_bench.py --model {args.model} --world-size {args.world_size} "
        f"--steps {args.steps}`",
        "",
        "| optimizer states | peak RSS growth / rank (MiB) | vs in memory | median step (s) | vs in memory |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(f"| {name} | {r['peak_rss_mb']:.1f} | {r['peak_rss_mb'] / base['peak_rss_mb']:.3f} | "
                     f"{r['step_s']:.3f} | {r['step_s'] / base['step_s']:.3f} |")
    Path(args.out + ".md").parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    Path(args.out + ".json").write_text(json.dumps(results, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

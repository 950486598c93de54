"""A plan's per-parameter tiers: peak memory (as the operating system sees it) and step time, side by side.

    python benchmarks/plan_tier_bench.py                    # bench_small (33.6M), 2 ranks, 6 steps, 2 repeats
    python benchmarks/plan_tier_bench.py --suite gathered   # gathered parameters on disk vs gathered again

The same measure as ``offload_bench.py`` (its rank launcher and peak-RSS reading: fresh rank processes per run,
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` at 128 KiB, peak RSS growth over the baseline after imports
and the process group, max over ranks; median step time after the first step; configurations interleaved,
medians of the repeats). Configurations: everything in memory (the default plan); a plan putting half the
transformer blocks' weights, gradient pieces and optimizer states on disk (``tier: disk``); every block; and, for
reference, ``MemoryPolicy`` placing the same classes of the whole model (embedding and head included) on disk.
``--suite gathered``: the gathered parameters of the blocks (which reshard after forward) on disk between forward
and backward instead of gathered again, alone and with everything else on disk; AllGather bytes per step from
``comm_stats``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "131072")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from offload_bench import _TMP, BUCKET_BYTES, MODELS, _peak_rss, _rss_now, _spawn, add_run_arguments, interleaved  # noqa: E402

import lightning_vescale as lv  # noqa: E402
from lightning_vescale.memory import MemoryPolicy, apply_memory_policy, memory_stats  # noqa: E402
from lightning_vescale.models import Llama  # noqa: E402

GROUPS = [{"match": "tok_embeddings", "group": True, "reshard_after_forward": False},
          {"match": "layers.*", "group": True}]  # the default plan of these models
ALL = {"params": "disk", "grads": "disk", "optimizer_states": "disk"}
SUITES: dict[str, dict[str, tuple[Optional[dict], dict]]] = {  # suite -> name -> (plan, MemoryPolicy placements)
    "tiers": {
        "in memory": (None, {}),
        "plan: blocks 0-3 on disk (tier: disk)": ({"rules": GROUPS + [{"match": "layers.[0-3]", "tier": "disk"}]}, {}),
        "plan: every block on disk (tier: disk)": ({"rules": GROUPS + [{"match": "layers.*", "tier": "disk"}]}, {}),
        "policy: whole model's weights + grads + states on disk": (None, ALL),
    },
    # Gathered parameters between forward and backward: gathered again (the default) or read back from disk.
    "gathered": {
        "in memory": (None, {}),
        "policy: gathered params on disk": (None, {"gathered_params": "disk"}),
        "policy: weights + grads + states on disk": (None, ALL),
        "policy: weights + grads + states + gathered params on disk": (None, {**ALL, "gathered_params": "disk"}),
    },
}
CONFIGS = {name: config for suite in SUITES.values() for name, config in suite.items()}


def _rank(rank: int, world: int, init: str, model_name: str, name: str, steps: int, swap: str, out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    baseline = _rss_now()
    torch.manual_seed(0)
    config = MODELS[model_name]
    with torch.device("meta"):
        model = Llama(config)
    plan, classes = CONFIGS[name]
    lv.parallelize(model, plan, init_weights=False)
    lv.init_sharded_weights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if plan is not None or classes:
        apply_memory_policy(model, [opt], MemoryPolicy(disk_dir=swap, bucket_bytes=BUCKET_BYTES, **classes),
                            rank=rank)
    g = torch.Generator().manual_seed(rank)
    times, gathered = [], []
    for _ in range(steps):
        lv.comm_stats.step()
        tokens = torch.randint(0, config.vocab_size, (2, 129), generator=g)
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        gathered.append(lv.comm_stats.step().get("all_gather", 0))
    on_disk = sum(v for (_, tier), v in memory_stats.peak.items() if tier == "disk")
    out.put((rank, _peak_rss() - baseline, statistics.median(times[1:]), on_disk, statistics.median(gathered)))
    dist.destroy_process_group()


def run(model_name: str, name: str, world: int, steps: int) -> dict:
    rows = _spawn(_rank, world, model_name, name, steps, _TMP, what=name)
    return {"peak_rss_mb": max(r[1] for r in rows) / 2**20, "step_s": max(r[2] for r in rows),
            "on_disk_peak_mb": max(r[3] for r in rows) / 2**20, "all_gather_mb": max(r[4] for r in rows) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser)
    parser.add_argument("--suite", default="tiers", choices=sorted(SUITES),
                        help="tiers: a plan's per-parameter tiers; gathered: gathered parameters on disk")
    parser.add_argument("--out", default=None, help="default: results/plan_tier (tiers), results/gathered")
    args = parser.parse_args()
    args.out = args.out or str(Path(__file__).resolve().parent / "results" / (
        "plan_tier" if args.suite == "tiers" else args.suite))
    configs = SUITES[args.suite]
    load_before = os.getloadavg()[0]
    results = interleaved(run, configs, args)
    load_after = os.getloadavg()[0]
    base = results["in memory"]
    params = sum(p.numel() for p in Llama(dataclasses.replace(MODELS[args.model])).parameters())
    lines = [
        "# A plan's per-parameter tiers" if args.suite == "tiers" else "# Gathered parameters on disk between forward "
        "and backward",
        "",
        f"Model `{args.model}` ({params / 1e6:.1f}M parameters, {MODELS[args.model].n_layers} blocks), "
        f"{args.world_size} gloo ranks on this machine's CPUs (2 cores shared with other work), AdamW fp32, batch "
        f"2x128 tokens per rank, {args.steps} steps (median step time after the first); each configuration run "
        f"{args.repeats} times interleaved, medians shown. Peak RSS: the OS high-water mark over the baseline after "
        f"imports and the process group (MALLOC_MMAP_THRESHOLD_=131072 MALLOC_TRIM_THRESHOLD_=131072), max over "
        f"ranks; on disk: the ledger's peak bytes on the disk tier.",
        f"Command: `python benchmarks/plan_tier_bench.py --suite {args.suite} --model {args.model} --world-size "
        f"{args.world_size} --steps {args.steps} --repeats {args.repeats}`",
        "",
        "| placement | peak RSS growth / rank (MiB) | vs in memory | on disk, ledger peak (MiB) | AllGather / step "
        "(MiB, comm_stats) | vs in memory | median step (s) | vs in memory |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(f"| {name} | {r['peak_rss_mb']:.1f} | {r['peak_rss_mb'] / base['peak_rss_mb']:.3f} | "
                     f"{r['on_disk_peak_mb']:.1f} | {r['all_gather_mb']:.1f} | "
                     f"{r['all_gather_mb'] / base['all_gather_mb']:.3f} | {r['step_s']:.3f} | "
                     f"{r['step_s'] / base['step_s']:.3f} |")
    lines += ["", f"Load average (1 min) of the machine: {load_before:.1f} before, {load_after:.1f} after these runs "
              f"(2 cores)."]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    Path(args.out + ".json").write_text(json.dumps(results, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

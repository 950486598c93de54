"""Training state on the disk tier: peak memory (as the operating system sees it) and step time, side by side.

    python benchmarks/offload_bench.py                      # bench_small (33.6M), 2 ranks, 6 steps, 2 repeats
    python benchmarks/offload_bench.py --world-size 2 --steps 6 --repeats 2 --model bench_small

Each configuration runs in fresh rank processes (the peak resident set is a high-water mark), with glibc told
to return freed blocks of 128 KiB or more to the system (``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``),
so the peak follows live memory. Reported per rank (max over ranks): peak RSS growth (``ru_maxrss``, the
``VmHWM`` high-water mark) over the baseline taken after imports and the process group, and the median step
time after one warm-up step; each configuration runs ``--repeats`` times, interleaved with the others (the
machine is shared), and the median of the repeats is reported. Configurations (``MemoryPolicy`` placements,
applied by ``apply_memory_policy``): everything in memory; optimizer states on disk with and without prefetch;
optimizer states + master weights; + gradient pieces; + the blocks' activations (goal a).

Two more passes: goal (d) paired -- in one set of rank processes, three copies of the model (states in memory,
on disk with prefetch and write-back in the background, on disk with both synchronous) take turns, the order
rotated every step, so the shared machine's load hits all three alike; a turn is a copy's backward, optimizer step
and next forward, and a wait for its write-back still in flight; the cost of offloading is each turn minus the
in-memory copy's in the same step (median over steps, max over ranks). And the
ledger (``benchmarks/_memory.py``: every live storage by class after every op, beside the OS peak per phase) for
everything in memory and for states + weights on disk: what the remaining peak is made of.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "131072")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning_vescale as lv  # noqa: E402
from lightning_vescale.engine.fully_shard import sharded_groups  # noqa: E402
from lightning_vescale.memory import MemoryPolicy, apply_memory_policy, memory_stats  # noqa: E402
from lightning_vescale.models import Llama, LlamaConfig  # noqa: E402

MODELS = {
    "bench_small": LlamaConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=1536,
                               max_seq_len=256),
    "bench_tiny": LlamaConfig(vocab_size=1024, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=352,
                              max_seq_len=128),
}
BUCKET_BYTES = 16 * 2**20  # optimizer-step buckets: a quarter of this model's per-rank states
CONFIGS = {
    "in memory": None,
    "states on disk, prefetch": dict(optimizer_states="disk", prefetch=True),
    "states on disk, no prefetch": dict(optimizer_states="disk", prefetch=False),
    "states + weights on disk": dict(optimizer_states="disk", params="disk"),
    "states + weights + grads on disk": dict(optimizer_states="disk", params="disk", grads="disk"),
    "states + weights + grads + activations on disk": dict(optimizer_states="disk", params="disk", grads="disk",
                                                            activations="disk"),
}


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rank(rank: int, world: int, init: str, model_name: str, spec, shape: dict, steps: int, swap: str, out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    baseline = _rss_now()
    torch.manual_seed(0)
    config = dataclasses.replace(MODELS[model_name], n_layers=shape.get("n_layers", MODELS[model_name].n_layers),
                                 max_seq_len=max(MODELS[model_name].max_seq_len, shape["seq"]))
    with torch.device("meta"):
        model = Llama(config)
    first_use = _rss_now() - baseline  # torch's first use in the process (not state: the same in every run)
    lv.parallelize(model, init_weights=False)  # the default plan, as users get it
    lv.init_sharded_weights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if spec is not None:
        apply_memory_policy(model, [opt], MemoryPolicy(disk_dir=swap, bucket_bytes=BUCKET_BYTES, **spec), rank=rank)
    g = torch.Generator().manual_seed(rank)
    times, opt_times = [], []
    for _ in range(steps):
        tokens = torch.randint(0, config.vocab_size, (shape["batch"], shape["seq"] + 1), generator=g)
        start = time.perf_counter()
        _loss(model, tokens).backward()  # as a training loop does: the logits die with the step's forward
        opt_start = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        opt_times.append(time.perf_counter() - opt_start)
    off_device = sum(v for (_, tier), v in memory_stats.peak.items() if tier != "device")
    out.put((rank, _peak_rss() - baseline, statistics.median(times[1:]), off_device, statistics.median(opt_times[1:]),
             first_use))
    dist.destroy_process_group()


_TMP = object()
"""In :func:`_spawn`'s arguments: the run's temporary directory."""


def _spawn(fn, world: int, *args, results: Optional[int] = None, what: Optional[str] = None) -> list:
    """Run ``fn(rank, world, init, *args, out)`` in ``world`` fresh processes; the items they put on ``out``
    (``results`` of them; default one per rank). ``what`` names the run in the error if a rank fails."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=fn, args=(r, world, f"file://{tmp}/pg", *[tmp if a is _TMP else a for a in args],
                                              out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"{what or fn.__name__}: a rank failed")
        return [out.get() for _ in range(world if results is None else results)]


def run(model_name: str, config_name: str, world: int, steps: int, shape: Optional[dict] = None,
        spec: Optional[dict] = None) -> dict:
    shape = shape or {"batch": 2, "seq": 128}
    spec = CONFIGS.get(config_name) if spec is None else spec
    rows = _spawn(_rank, world, model_name, spec, shape, steps, _TMP, what=config_name)
    return {"peak_rss_mb": max(r[1] for r in rows) / 2**20, "step_s": max(r[2] for r in rows),
            "off_device_peak_mb": max(r[3] for r in rows) / 2**20, "optimizer_step_s": max(r[4] for r in rows),
            "first_use_mb": max(r[5] for r in rows) / 2**20}


def _build(model_name: str, spec: Optional[dict], swap: str, rank: int, tag: str = ""):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(MODELS[model_name])
    lv.parallelize(model, init_weights=False)  # the default plan, as users get it
    lv.init_sharded_weights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    handles = apply_memory_policy(model, [opt], None if spec is None else MemoryPolicy(
        disk_dir=os.path.join(swap, tag), bucket_bytes=BUCKET_BYTES, **spec), rank=rank)
    return model, opt, handles


PAIRED = {"in memory": None, "prefetch on": dict(optimizer_states="disk", prefetch=True),
          "prefetch off": dict(optimizer_states="disk", prefetch=False)}


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _paired_rank(rank: int, world: int, init: str, model_name: str, steps: int, tokens_shape: tuple, swap: str,
                 out) -> None:
    """Goal (d): the three copies of :data:`PAIRED` in the same processes, taking turns. A copy's turn (timed) is
    its backward, optimizer step and next forward, then a wait for any write-back still in flight: everything the
    offload does for one step (reads during backward and the step, writes during the step and the next forward)
    falls in the copy's own turn and can only overlap the copy's own compute."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    built = {name: _build(model_name, spec, swap, rank, tag=f"p{i}") for i, (name, spec) in enumerate(PAIRED.items())}
    runs = {name: b[:2] for name, b in built.items()}
    handles = {name: b[2] for name, b in built.items()}
    vocab = MODELS[model_name].vocab_size
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, vocab, tokens_shape, generator=g) for _ in range(steps + 1)]
    losses = {name: _loss(model, batches[0]) for name, (model, _) in runs.items()}  # the first forward: untimed
    times: dict[str, list[float]] = {name: [] for name in runs}
    opt_times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for step in range(steps):
        for name in names[step % 3:] + names[: step % 3]:  # rotated: no copy always first or last
            model, opt = runs[name]
            dist.barrier()
            start = time.perf_counter()
            losses[name].backward()
            opt_start = time.perf_counter()
            opt.step()
            opt_end = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            losses[name] = _loss(model, batches[step + 1])
            for offload in handles[name].states:
                offload.flush()  # inside the turn: no write-back overlaps another copy's compute
            times[name].append(time.perf_counter() - start)
            opt_times[name].append(opt_end - opt_start)
    losses.clear()  # the last forward's graph: no backward follows
    pieces = [[b.local for grp in sharded_groups(runs[n][0]) for b in grp.buffers.values()] for n in PAIRED]
    same = all(all(torch.equal(a, b) for a, b in zip(pieces[0], other)) for other in pieces[1:])
    out.put((rank, {name: t[1:] for name, t in times.items()}, same, {name: t[1:] for name, t in opt_times.items()}))
    dist.destroy_process_group()


def paired(model_name: str, world: int, steps: int, tokens_shape: tuple = (2, 129)) -> dict:
    load = os.getloadavg()[0]
    rows = _spawn(_paired_rank, world, model_name, steps, tokens_shape, _TMP, what="paired prefetch run")
    result: dict = {"load_before": load, "load_after": os.getloadavg()[0], "bitwise": all(r[2] for r in rows)}
    for name in PAIRED:
        result[name + " turn_s"] = max(statistics.median(r[1][name]) for r in rows)
        result[name + " optimizer_step_s"] = max(statistics.median(r[3][name]) for r in rows)
        if name != "in memory":
            result[name + " cost_s"] = max(statistics.median(a - b for a, b in zip(r[1][name], r[1]["in memory"]))
                                           for r in rows)
            result[name + " optimizer_step_cost_s"] = max(
                statistics.median(a - b for a, b in zip(r[3][name], r[3]["in memory"])) for r in rows)
    result["steps"] = {r[0]: r[1] for r in rows}
    result["optimizer_steps"] = {r[0]: r[3] for r in rows}
    return result


LEDGER = {"in memory": None, "states + weights on disk": dict(optimizer_states="disk", params="disk")}


def _ledger_rank(rank: int, world: int, init: str, model_name: str, spec, staging: dict, swap: str, out) -> None:
    """What the peak is made of: the ledger's classes at each phase's peak (two warm-up steps, then two)."""
    import _memory
    from train_bench import _classes_vescale, step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    baseline = _memory.rss_bytes()
    model, opt, _ = _build(model_name, spec, swap, rank)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, MODELS[model_name].vocab_size, (2, 129), generator=g) for _ in range(4)]
    step(model, opt, batches[0])
    step(model, opt, batches[1])
    classify = lambda: _classes_vescale(model, opt)  # noqa: E731
    ledger = _memory.MemoryLedger(classify, baseline_rss=baseline, staging=staging)
    for tensors in classify().values():
        ledger.track(*[t for t in tensors if isinstance(t, torch.Tensor)])
    ledger.start()
    with ledger:
        for tokens in batches[2:]:
            step(model, opt, tokens, phase=ledger.phase)
        ledger.phase("end")
    out.put((rank, ledger.results()))
    dist.destroy_process_group()


def _staging_rank(rank: int, world: int, init: str, out) -> None:
    import _memory

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    ratios = _memory.measure_staging()
    if rank == 0:
        out.put(ratios)
    dist.destroy_process_group()




def ledger_breakdown(model_name: str, world: int) -> dict:
    staging = _spawn(_staging_rank, world, results=1)[0]
    result = {}
    for name, spec in LEDGER.items():
        rows = _spawn(_ledger_rank, world, model_name, spec, staging, _TMP)
        worst = max(rows, key=lambda r: r[1]["os_peak"])[1]  # the rank with the highest peak
        result[name] = worst
    return result


CAPACITY = {
    # (b) the largest model (more blocks of bench_small) whose peak stays within the budget, batch 2x128 per rank
    "model": {
        "in memory": None,
        "states + weights + grads + activations on disk": dict(optimizer_states="disk", params="disk", grads="disk",
                                                                activations="disk"),
    },
    # (c) the longest sequence (batch 1 per rank) whose peak stays within the budget
    "sequence": {
        "in memory": None,
        "states + weights + grads on disk (activations on the device)": dict(optimizer_states="disk", params="disk",
                                                                             grads="disk"),
        "activations checkpointed, states + weights + grads on disk": dict(optimizer_states="disk", params="disk",
                                                                           grads="disk", activations="checkpoint"),
        "activations + states + weights + grads on disk": dict(optimizer_states="disk", params="disk", grads="disk",
                                                               activations="disk"),
    },
}


def _largest(fits, start: int, limit: int, unit: int) -> tuple[int, list]:
    """The largest multiple of ``unit`` in [start, limit] for which ``fits`` holds (doubling, then one bisection
    between the last that fit and the first that did not); 0 if ``start`` does not fit. Returns it and the trials."""
    trials, good, bad, n = [], 0, None, start
    while n <= limit:
        ok, record = fits(n)
        trials.append(record)
        if not ok:
            bad = n
            break
        good, n = n, 2 * n
    if good and bad is not None:
        mid = (good + bad) // 2 // unit * unit
        if good < mid < bad:
            ok, record = fits(mid)
            trials.append(record)
            good = mid if ok else good
    return good, trials


def capacity(args) -> None:
    """Goals (b) and (c): under a per-rank budget on the OS peak, the largest model and the longest sequence."""
    budget = args.budget_mib
    result: dict = {"budget_mib": budget}
    lines = [
        "# What fits under a per-rank memory budget, with and without offload",
        "",
        f"Budget: {budget} MiB of peak RSS growth per rank (the OS high-water mark over the baseline after imports and "
        f"the process group, max over ranks; the same measure as `offload.md`; the budget is enforced on that measure, "
        f"not on the ledger). {args.world_size} gloo ranks, AdamW fp32, {args.capacity_steps} steps per trial; "
        f"search: doubling, then one bisection.",
        f"Command: `python benchmarks/offload_bench.py --capacity --budget-mib {budget} --world-size {args.world_size}`",
        "",
    ]
    n_params = {}

    def model_fits(spec):
        def fits(layers):
            r = run(args.model, "", args.world_size, args.capacity_steps, {"batch": 2, "seq": 128, "n_layers": layers},
                    spec=spec)
            cfg = dataclasses.replace(MODELS[args.model], n_layers=layers)
            with torch.device("meta"):
                n_params[layers] = sum(p.numel() for p in Llama(cfg).parameters())
            return r["peak_rss_mb"] <= budget, {"n_layers": layers, "params": n_params[layers], **r}
        return fits

    lines += [f"## (b) Largest model (blocks of `{args.model}`, batch 2x128 tokens per rank)", "",
              "| placement | largest that fits (blocks) | parameters | trials (blocks: peak MiB) |", "|---|---|---|---|"]
    result["model"] = {}
    for name, spec in CAPACITY["model"].items():
        best, trials = _largest(model_fits(spec), 2, args.max_layers, 1)
        result["model"][name] = {"n_layers": best, "params": n_params.get(best, 0), "trials": trials}
        lines.append(f"| {name} | {best} | {n_params.get(best, 0) / 1e6:.1f}M | "
                     + ", ".join(f"{t['n_layers']}: {t['peak_rss_mb']:.0f}" for t in trials) + " |")
    sizes = [v["params"] for v in result["model"].values()]
    lines += ["", f"Ratio (offload / in memory): {sizes[1] / sizes[0]:.2f}x parameters"
              + (f" (the search stopped at --max-layers {args.max_layers})"
                 if result["model"][list(CAPACITY['model'])[1]]["n_layers"] >= args.max_layers else "") + ".", ""]

    def seq_fits(spec):
        def fits(seq):
            r = run(args.model, "", args.world_size, args.capacity_steps, {"batch": 1, "seq": seq}, spec=spec)
            return r["peak_rss_mb"] <= budget, {"seq": seq, **r}
        return fits

    lines += [f"## (c) Longest sequence (`{args.model}`, batch 1 per rank)", "",
              "| placement | longest that fits (tokens) | trials (tokens: peak MiB) |", "|---|---|---|"]
    result["sequence"] = {}
    for name, spec in CAPACITY["sequence"].items():
        best, trials = _largest(seq_fits(spec), 256, args.max_seq, 64)
        result["sequence"][name] = {"seq": best, "trials": trials}
        lines.append(f"| {name} | {best} | " + ", ".join(f"{t['seq']}: {t['peak_rss_mb']:.0f}" for t in trials) + " |")
    base_name = list(CAPACITY["sequence"])[1]  # the same placement but activations: what they alone change
    base_seq = result["sequence"][base_name]["seq"]
    lines.append("")
    for name in list(CAPACITY["sequence"])[2:]:
        seq = result["sequence"][name]["seq"]
        lines.append(f"Ratio ({name} / {base_name}): {seq / base_seq:.2f}x tokens" if base_seq else "")
    Path(args.out + "_capacity.md").write_text("\n".join(lines) + "\n")
    Path(args.out + "_capacity.json").write_text(json.dumps(result, indent=2))
    print("\n".join(lines))


_CLASS_COLUMNS = ("sharded params", "gradients", "optimizer states", "unsharded params", "unsharded grads",
                  "activations", "comm staging (backend)", "not tensors")


def prefetch_pairs(args) -> None:
    """Goal (d) alone: ``--repeats`` paired passes (fresh processes each), batch 1x64 tokens per rank (a short
    forward and backward: more steps per minute, and less compute for the offload's I/O to hide behind)."""
    passes = [paired(args.model, args.world_size, args.paired_steps, tokens_shape=(1, 65)) for _ in range(args.repeats)]
    write_prefetch_pairs(args, passes)


_TURN = ("A copy's turn, timed, is its backward, optimizer step and next forward, followed by a wait for any "
         "write-back still in flight: all the disk I/O of one step (reads during backward and the step, writes "
         "during the step and the next forward) lies in the copy's own turn and can overlap only its own compute")


def write_prefetch_pairs(args, passes: list[dict]) -> None:
    ratios = [p["prefetch on cost_s"] / p["prefetch off cost_s"] for p in passes]
    lines = [
        "# Goal (d): the cost of optimizer states on disk, prefetch on vs off, paired",
        "",
        f"Model `{args.model}`, {args.world_size} gloo ranks, AdamW fp32, optimizer-step buckets of "
        f"{BUCKET_BYTES // 2**20} MiB, batch 1x64 tokens per rank. In each pass, three copies of the model live in "
        f"the same rank processes: states in memory; states on disk with prefetch on (on background threads: the "
        f"step's first buckets read at the end of backward, the next ones while earlier ones step, the stepped "
        f"ones written back, the last completing during the next forward; at most "
        f"{MemoryPolicy.prefetch_buckets} buckets in memory at a time, read, stepping or being written); states "
        f"on disk with prefetch off (every read and write synchronous, in the step). States move with `O_DIRECT`, so every "
        f"read comes from the device, not the page cache. Each step the three copies take turns, in rotated order. "
        f"{_TURN}. Cost = a copy's turn minus the in-memory copy's in the same step; median over "
        f"{args.paired_steps - 1} steps after the first, max over ranks; {args.repeats} passes in fresh processes. "
        f"The machine's 2 cores and its disk are shared with other work: load averages per pass below.",
        f"Command: `python benchmarks/offload_bench.py --prefetch-pairs --model {args.model} --world-size "
        f"{args.world_size} --paired-steps {args.paired_steps} --repeats {args.repeats}`",
        "",
        "| pass | load before / after | in memory turn (s) | prefetch on turn (s) | prefetch off turn (s) | cost on "
        "| cost off | on / off | of which in the optimizer step: on / off (s) | bitwise |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, (p, r) in enumerate(zip(passes, ratios)):
        lines.append(f"| {i + 1} | {p['load_before']:.1f} / {p['load_after']:.1f} | "
                     f"{p['in memory turn_s']:.3f} | {p['prefetch on turn_s']:.3f} | "
                     f"{p['prefetch off turn_s']:.3f} | {p['prefetch on cost_s']:+.3f} | "
                     f"{p['prefetch off cost_s']:+.3f} | {r:.2f} | {p['prefetch on optimizer_step_cost_s']:+.3f} / "
                     f"{p['prefetch off optimizer_step_cost_s']:+.3f} | {p['bitwise']} |")
    lines += [
        "",
        f"- Goal (d), the cost with prefetch at most half the cost without: median over passes "
        f"{statistics.median(ratios):.2f} of it (passes: {', '.join(f'{r:.2f}' for r in ratios)}).",
        "- The cost without prefetch is the disk's time for each rank's states (read and written every step, the "
        "ranks sharing one disk) and the CPU time of moving them. With prefetch, the reads of the first "
        f"{MemoryPolicy.prefetch_buckets} buckets overlap the end of backward and the last writes the next "
        "forward; what remains is about half inside the optimizer step (last column: the reads and writes that "
        "the bound on buckets in memory leaves to the step take longer than its compute) and half in backward, "
        "which runs slower while the first buckets are read (the I/O threads' CPU time -- huge-page faults, "
        "system calls, copies of the small states that go through the page cache -- has no idle core when 2 "
        "ranks share 2 cores). The bound trades hidden time for memory: 4 buckets left 0.55 of the cost (median of "
        "5 passes) and, with 16 MiB buckets, about 12 MiB less at the peak of goal (a).",
        "",
    ]
    Path(args.out + "_prefetch.md").write_text("\n".join(lines) + "\n")
    Path(args.out + "_prefetch.json").write_text(json.dumps({"passes": passes, "ratios": ratios}, indent=2))
    print("\n".join(lines))


def _median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]} | {"repeats": runs}


def interleaved(run_one, configs, args) -> dict[str, dict]:
    """``run_one(model, name, world_size, steps)`` for every configuration, ``args.repeats`` times interleaved (a
    slow spell of the shared machine hits every configuration); the medians of each configuration's runs."""
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name in configs:
            runs[name].append(run_one(args.model, name, args.world_size, args.steps))
    return {name: _median_of(r) for name, r in runs.items()}


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every configuration run takes (see :func:`interleaved`)."""
    parser.add_argument("--model", default="bench_small", choices=sorted(MODELS))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "offload"))
    parser.add_argument("--capacity", action="store_true", help="goals (b) and (c) instead: what fits in a budget")
    parser.add_argument("--budget-mib", type=float, default=512.0)
    parser.add_argument("--capacity-steps", type=int, default=3)
    parser.add_argument("--max-layers", type=int, default=64)
    parser.add_argument("--max-seq", type=int, default=8192)
    parser.add_argument("--paired-steps", type=int, default=12, help="steps of the paired prefetch pass (goal d)")
    parser.add_argument("--prefetch-pairs", action="store_true", help="goal (d) alone: --repeats paired passes")
    args = parser.parse_args()
    if args.capacity:
        capacity(args)
        return
    if args.prefetch_pairs:
        prefetch_pairs(args)
        return
    load_before = os.getloadavg()[0]
    results = interleaved(run, CONFIGS, args)
    load_after = os.getloadavg()[0]
    pair = paired(args.model, args.world_size, args.paired_steps)
    breakdown = ledger_breakdown(args.model, args.world_size)
    base = results["in memory"]
    params = sum(p.numel() for p in Llama(MODELS[args.model]).parameters()) if args.model else 0
    cost = {name: results[name]["step_s"] - base["step_s"] for name in results}
    full = results["states + weights on disk"]
    lines = [
        "# Training state on the disk tier",
        "",
        f"Model `{args.model}` ({params / 1e6:.1f}M parameters), {args.world_size} gloo ranks on this machine's CPUs "
        f"(2 cores shared with other work), AdamW fp32, batch 2x128 tokens per rank, {args.steps} steps (median "
        f"step time after the first), optimizer-step buckets of {BUCKET_BYTES // 2**20} MiB; each configuration "
        f"run {args.repeats} times interleaved, medians shown. Peak RSS: the OS high-water mark (ru_maxrss) over "
        f"the baseline after imports and the process group, with MALLOC_MMAP_THRESHOLD_=131072 "
        f"MALLOC_TRIM_THRESHOLD_=131072; max over ranks. Off the device: the ledger's peak bytes on the disk tier.",
        f"Command: `python benchmarks/offload_bench.py --model {args.model} --world-size {args.world_size} "
        f"--steps {args.steps} --repeats {args.repeats} --paired-steps {args.paired_steps}`",
        "",
        "| placement | peak RSS growth / rank (MiB) | vs in memory | on disk, ledger peak (MiB) | median step (s) "
        "| vs in memory | of which optimizer step (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(f"| {name} | {r['peak_rss_mb']:.1f} | {r['peak_rss_mb'] / base['peak_rss_mb']:.3f} | "
                     f"{r['off_device_peak_mb']:.1f} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.3f} | "
                     f"{r['optimizer_step_s']:.3f} |")
    with_grads = results["states + weights + grads on disk"]
    pre, nopre = cost["states on disk, prefetch"], cost["states on disk, no prefetch"]
    lines += [
        "",
        f"Load average (1 min) of the machine: {load_before:.1f} before, {load_after:.1f} after these runs "
        f"(2 cores).",
        "",
        f"- Goal (a), peak RSS at least 40% lower with optimizer states and master weights on disk: "
        f"{1 - full['peak_rss_mb'] / base['peak_rss_mb']:.1%} lower (gradient pieces too: "
        f"{1 - with_grads['peak_rss_mb'] / base['peak_rss_mb']:.1%}; with the activations too: "
        f"{1 - results[list(CONFIGS)[-1]]['peak_rss_mb'] / base['peak_rss_mb']:.1%}), at "
        f"{full['step_s'] / base['step_s']:.2f}x (resp. {with_grads['step_s'] / base['step_s']:.2f}x) the step time. "
        f"Every peak includes about {base['first_use_mb']:.0f} MiB that torch's first use in the process adds "
        f"(measured after building the model on the meta device, before any state exists). What the peaks are "
        f"made of: below.",
        f"- Separate processes per configuration (the table): the extra step time with states on disk, prefetch on vs "
        f"off: {pre:+.3f} s vs {nopre:+.3f} s (medians of runs at different moments of the shared machine: see the "
        f"paired pass for goal d).",
        "",
        "## Goal (d): prefetch on vs off, paired in the same processes",
        "",
        f"Three copies of the model in the same {args.world_size} rank processes (batch 2x128 tokens per rank): "
        f"states in memory, states on disk with prefetch (reads and writes on background threads, overlapping the "
        f"end of backward, the step and the next forward; `O_DIRECT`: the reads are the device's, not the page "
        f"cache's), states on disk with prefetch off (every read and write synchronous). Each step, the three take "
        f"turns, in rotated order. {_TURN}. Cost = a copy's turn minus the in-memory copy's in the same step; "
        f"median over {args.paired_steps - 1} steps after the first, max over ranks. Load average "
        f"{pair['load_before']:.1f} before, {pair['load_after']:.1f} after. Bitwise (every master-weights piece of "
        f"the three copies after the run): {pair['bitwise']}.",
        "",
        "| states | turn (s) | cost vs in memory (s) | optimizer step (s) | its cost vs in memory (s) |",
        "|---|---|---|---|---|",
        f"| in memory | {pair['in memory turn_s']:.3f} | | {pair['in memory optimizer_step_s']:.3f} | |",
        f"| on disk, prefetch on | {pair['prefetch on turn_s']:.3f} | {pair['prefetch on cost_s']:+.3f} | "
        f"{pair['prefetch on optimizer_step_s']:.3f} | {pair['prefetch on optimizer_step_cost_s']:+.3f} |",
        f"| on disk, prefetch off | {pair['prefetch off turn_s']:.3f} | {pair['prefetch off cost_s']:+.3f} | "
        f"{pair['prefetch off optimizer_step_s']:.3f} | {pair['prefetch off optimizer_step_cost_s']:+.3f} |",
        "",
        f"- Goal (d), the cost with prefetch at most half the cost without: "
        f"{pair['prefetch on cost_s'] / pair['prefetch off cost_s']:.2f} of it"
        if pair["prefetch off cost_s"] > 0 else "- Goal (d): no measurable cost without prefetch in this run",
        "",
        "## What the peak is made of (goal a)",
        "",
        "The ledger (`benchmarks/_memory.py`: every live tensor storage by class after every op, the backend's "
        "collective staging, and the non-tensor memory measured once) at the peak of each phase, beside the OS peak "
        "of the same phase; the rank with the highest peak; MiB above the baseline.",
        "",
        "| placement | phase | OS peak | ledger | " + " | ".join(_CLASS_COLUMNS) + " |",
        "|---|---|---|---|" + "---|" * len(_CLASS_COLUMNS),
    ]
    for name, r in breakdown.items():
        for phase, d in r["phases"].items():
            if phase == "end":
                continue
            lines.append(f"| {name} | {phase} | {d['os_peak'] / 2**20:.1f} | {d['ledger_peak'] / 2**20:.1f} | "
                         + " | ".join(f"{d['breakdown'].get(c, 0) / 2**20:.1f}" for c in _CLASS_COLUMNS) + " |")
    mem = breakdown["in memory"]["phases"]
    top = max((ph for ph in mem if ph != "end"), key=lambda ph: mem[ph]["os_peak"])
    movable = mem[top]["breakdown"]["sharded params"] + mem[top]["breakdown"]["optimizer states"]
    lines += [
        "",
        f"- With everything in memory the peak is in {top} ({mem[top]['os_peak'] / 2**20:.1f} MiB); the master "
        f"weights and optimizer states alive at that moment are {movable / 2**20:.1f} MiB of it, "
        f"{movable / mem[top]['os_peak']:.1%}: the most that moving those two classes off the device can take off "
        f"that peak (the rest -- activations, gathered parameters and their gradients, gloo's staging, torch's "
        f"non-tensor memory -- is the same with and without offload).",
        "- Where the ledger is above the OS peak with states on disk (backward), the difference is the storage of "
        "the buckets being read: the ledger counts a storage's bytes from its allocation (with up to 2 MiB of "
        "huge-page alignment per bucket), the OS its pages once the read has filled them.",
        "",
    ]
    results = {"configs": results, "paired_prefetch": pair, "ledger": breakdown,
               "load": {"before": load_before, "after": load_after}}
    Path(args.out + ".md").parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    Path(args.out + ".json").write_text(json.dumps(results, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

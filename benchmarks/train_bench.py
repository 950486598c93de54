"""Side-by-side training benchmark: lightning-vescale vs FSDP2 vs DDP on the same models.

    python benchmarks/train_bench.py                     # every setup on 2 and 4 gloo ranks
    python benchmarks/train_bench.py --setups dense --world-sizes 2 --repeats 1

Setups: ``dense`` (a 34M-parameter Llama, fp32 AdamW), ``dense-bf16`` (the same, bf16-mixed: bf16
gathered parameters and compute, fp32 reduction and master weights), ``moe`` (a 37M-parameter MoE, all
parameters sharded like the dense model) and ``moe-ep`` (the MoE with its experts split over 2 ranks by
expert parallelism, each rank's experts sharded over the remaining data-parallel ranks).

Three passes per setup and world size:

* time: one set of processes runs every engine on the same model, data and seed, the engines' steps
  interleaved so that background load affects all alike: median step time after warm-up, bytes sent per
  rank per step (ring formula for every engine: AllGather/ReduceScatter (N-1)·shard bytes, AllReduce
  2(N-1)/N·bytes; FSDP2's counted by wrapping the torch.distributed calls it makes, DDP's computed from the
  gradient size since its all-reduce runs in C++), padding;
* memory (the operating system): a fresh set of processes per engine and repeat, run with glibc returning
  freed blocks of 128 KiB or more to the system; peak resident set above the baseline taken after imports
  and process-group setup, per phase (sharding, forward, backward, optimizer step) over all steps;
* memory (the ledger): one more fresh set per engine with :class:`_memory.MemoryLedger`, which samples the
  live tensor storages by class after every op and the system's peak during it.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _memory  # noqa: E402

import lightning_vescale as lv  # noqa: E402
from lightning_vescale.engine.fully_shard import sharded_groups  # noqa: E402
from lightning_vescale.models import Llama, LlamaConfig, MoE, MoEConfig  # noqa: E402
from lightning_vescale.models.moe import GroupedExperts  # noqa: E402
from lightning_vescale.recipe.builders import share_cpu_threads  # noqa: E402

MODELS = {
    # ~34M parameters: Llama-shaped (GQA, SwiGLU, untied head), small enough for 4 ranks on 2 cores.
    "bench_small": LlamaConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=1536,
                               max_seq_len=256),
    "bench_tiny": LlamaConfig(vocab_size=1024, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=352,
                              max_seq_len=128),
    # ~37M parameters (~14M active): 8 experts top-2 with a shared expert, untied head.
    "bench_moe": MoEConfig(vocab_size=8192, dim=512, n_layers=4, n_heads=8, n_kv_heads=4, num_experts=8, top_k=2,
                           moe_hidden=512, shared_expert_hidden=512, max_seq_len=256),
}


@dataclass(frozen=True)
class Setup:
    model: str
    precision: str = "fp32"  # or "bf16-mixed"
    ep: int = 1  # expert-parallel degree (1: none)


SETUPS = {
    "dense": Setup("bench_small"),
    "dense-bf16": Setup("bench_small", precision="bf16-mixed"),
    "moe": Setup("bench_moe"),
    "moe-ep": Setup("bench_moe", ep=2),
}
ENGINES = ("fsdp2", "vescale", "ddp", "vescale-idiom", "vescale-bp", "vescale-rootemb", "vescale-overlap",
           "vescale-rootreshard", "fsdp2-emb")
"""``vescale`` is lightning-vescale with its default plan (``lv.parallelize``); ``vescale-idiom`` is the FSDP2
tutorial's idiom with ``lightning_vescale.fully_shard`` in place of torch's (each block, then the root; no plan).
Variants, to measure the choices the defaults make: ``vescale-bp``, lightning-vescale with
``set_backward_prefetch(True)`` (the default on accelerators; CPU's is off; FSDP2 always prefetches);
``vescale-rootemb``, the idiom with the token
embedding kept in the root group (``split_embeddings=False``; the default plan and the idiom give it a group of
its own); ``vescale-overlap``, one ReduceScatter left
in flight during backward (``set_reduces_in_flight(1)``, the default on accelerators; CPU's is 0);
``vescale-rootreshard``, the default plan with ``set_reshard_after_forward(True, recurse=False)`` on the root (its
norm and head freed after forward and gathered again when backward reaches the logits: one more AllGather);
``fsdp2-emb``, FSDP2 with the embedding in its own group as well (``reshard_after_forward=False``)."""
PHASES = ("forward", "backward", "optimizer")

_counted: dict[str, int] = {}
_STAGING: dict[int, dict] = {}  # per world size: the backend's staging, measured once


def _wrap_torch_collectives() -> None:
    """Count FSDP2's collectives (it calls these torch.distributed functions from Python)."""
    def wrap(name, nbytes):
        original = getattr(dist, name, None)
        if original is None:
            return

        def counting(*args, **kwargs):
            group = kwargs.get("group")
            n = dist.get_world_size(group)
            tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            _counted[name] = _counted.get(name, 0) + nbytes(n, *tensors)
            return original(*args, **kwargs)

        setattr(dist, name, counting)

    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    wrap("all_gather_single", lambda n, out, inp, *a: (n - 1) * size(inp))
    wrap("all_gather_into_tensor", lambda n, out, inp, *a: (n - 1) * size(inp))
    wrap("reduce_scatter_single", lambda n, out, inp, *a: (n - 1) * size(out))
    wrap("reduce_scatter_tensor", lambda n, out, inp, *a: (n - 1) * size(out))
    wrap("all_reduce", lambda n, t, *a: 2 * (n - 1) * size(t) // n)


# --------------------------------------------------------------------------------------------------------
# Models and engines


def make_model(setup: Setup) -> nn.Module:
    torch.manual_seed(0)
    config = MODELS[setup.model]
    return MoE(config) if isinstance(config, MoEConfig) else Llama(config)


def _meshes(world: int, ep: int):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp", "ep"))
    return mesh, mesh._flatten()


def _padding_fsdp2(model: nn.Module) -> float:
    from torch.distributed.tensor import DTensor

    padded = real = 0
    for p in model.parameters():
        n = p.device_mesh.size() if isinstance(p, DTensor) else 1
        rows = p.shape[0]
        padded += -(-rows // n) * n * (p.numel() // max(rows, 1))
        real += p.numel()
    return padded / real - 1


def base_engine(engine: str) -> str:
    return engine.split("-")[0]


def build(engine: str, setup: Setup, world: int):
    """The model sharded by ``engine``, its AdamW, its padding and the autocast dtype of its forward."""
    variant, engine = engine, base_engine(engine)
    model = make_model(setup)
    bf16 = setup.precision == "bf16-mixed"
    padding, autocast = 0.0, None
    if engine == "vescale":
        policy = lv.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                         output_dtype=torch.float32) if bf16 else None
        if setup.ep > 1:
            mesh, _ = _meshes(world, setup.ep)
            lv.parallelize(model, mesh=mesh, mp_policy=policy)  # the default plan on a ("dp", "ep") mesh
        elif variant in ("vescale-idiom", "vescale-rootemb"):
            # The FSDP2 tutorial's idiom, lightning_vescale.fully_shard in place of torch's: each block, then the root.
            for block in model.layers:
                lv.fully_shard(block, mp_policy=policy)
            lv.fully_shard(model, mp_policy=policy, split_embeddings=variant == "vescale-idiom")
        else:
            lv.parallelize(model, mp_policy=policy)  # the default plan, as users get it
        if variant == "vescale-rootreshard":
            model.set_reshard_after_forward(True, recurse=False)  # the root gathered again for backward
        if variant == "vescale-overlap":
            model.set_reduces_in_flight(1)
        if variant == "vescale-bp":
            model.set_backward_prefetch(True)
        plans = [p for g in sharded_groups(model) for p in g.plans]
        padding = sum(p.padding for p in plans) / sum(p.total_numel for p in plans)
    elif engine == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # As lightning-vescale's policy: fp32 outputs of the model only (blocks feed each other in bf16).
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else (
            MixedPrecisionPolicy())
        root_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                           output_dtype=torch.float32) if bf16 else policy
        dense_mesh = None
        if setup.ep > 1:
            from lightning_vescale.parallel import apply_expert_parallel

            mesh, dense_mesh = _meshes(world, setup.ep)
            apply_expert_parallel(model, mesh["ep"])
            for experts in [m for m in model.modules() if isinstance(m, GroupedExperts)]:
                fully_shard(experts, mesh=mesh["dp"], mp_policy=policy)
                experts.set_gradient_divide_factor(float(world))  # see fully_shard_expert_parallel's note
        if variant == "fsdp2-emb":
            fully_shard(model.tok_embeddings, mesh=dense_mesh, mp_policy=policy, reshard_after_forward=False)
        for block in model.layers:
            fully_shard(block, mesh=dense_mesh, mp_policy=policy)
        fully_shard(model, mesh=dense_mesh, mp_policy=root_policy)
        padding = _padding_fsdp2(model)
    elif engine == "ddp":
        if setup.ep > 1:
            raise ValueError("DDP replicates every parameter: no expert-parallel setup")
        model = torch.nn.parallel.DistributedDataParallel(model)
        autocast = torch.bfloat16 if bf16 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer, padding, autocast


def engines_for(setup: Setup, engines: list) -> list:
    return [e for e in engines if not (e == "ddp" and setup.ep > 1)]


def step(model, optimizer, tokens, autocast=None, phase: Callable[[str], None] = lambda name: None):
    phase("forward")
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
    del logits
    phase("backward")
    loss.backward()
    phase("optimizer")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def step_bytes(engine: str, model, world: int) -> int:
    engine = base_engine(engine)
    if engine == "vescale":
        return sum(lv.comm_stats.step().values())
    if engine == "fsdp2":
        total = sum(_counted.values())
        _counted.clear()
        return total
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return 2 * (world - 1) * grad_bytes // world


def _batches(setup: Setup, rank: int, n: int, args) -> list:
    gen = torch.Generator().manual_seed(1234 + rank)
    vocab = MODELS[setup.model].vocab_size
    return [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(n)]


# --------------------------------------------------------------------------------------------------------
# Pass 1: time (engines interleaved in one set of processes)


def time_engines(rank: int, world: int, setup: Setup, engines: list, args) -> dict:
    """Time the engines interleaved step by step, so background load drifts affect all of them alike."""
    batches = _batches(setup, rank, args.steps + 2, args)
    built = {engine: build(engine, setup, world) for engine in engines}
    times = {e: [] for e in engines}
    sent = {e: [] for e in engines}
    losses = {e: [] for e in engines}
    for i, tokens in enumerate(batches):
        for engine in engines:
            model, optimizer, _, autocast = built[engine]
            dist.barrier()
            start = time.perf_counter()
            losses[engine].append(step(model, optimizer, tokens, autocast).item())
            elapsed = time.perf_counter() - start
            sent[engine].append(step_bytes(engine, model, world))
            if i >= 2:  # warm-up: lazy init, first allocations
                times[engine].append(elapsed)
    base = times.get("fsdp2")
    return {
        engine: {
            "median_step_s": statistics.median(times[engine]),
            # Step i of every engine ran back to back: the median of the per-step ratios is steadier on a shared
            # machine than the ratio of the medians.
            "paired_vs_fsdp2": statistics.median(a / b for a, b in zip(times[engine], base)) if base else None,
            "step_times_s": times[engine],
            "bytes_per_step": statistics.median(sent[engine][2:]),
            "padding": built[engine][2],
            "final_loss": losses[engine][-1],
        }
        for engine in engines
    }


def time_worker(rank: int, world: int, init_file: str, setup: Setup, engines: list, args, out_file: str) -> None:
    faulthandler.enable()
    share_cpu_threads(world)  # the recipes' split: torch's default (every core per rank) oversubscribes them
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    _wrap_torch_collectives()
    results = time_engines(rank, world, setup, engines, args)
    # Report the worst rank (max over ranks) for time and bytes, as a user would feel it.
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        merged = {
            e: {**results[e], **{k: max(r[e][k] for r in gathered) for k in ("median_step_s", "bytes_per_step")
                                 if results[e][k] is not None},
                "paired_vs_fsdp2": max(r[e]["paired_vs_fsdp2"] for r in gathered) if results[e]["paired_vs_fsdp2"] else None}
            for e in engines
        }
        Path(out_file).write_text(json.dumps(merged))
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------------
# Passes 2 and 3: memory (one engine per set of processes)


def _classes_vescale(model: nn.Module, optimizer) -> dict[str, list]:
    named: dict[str, list] = {c: [] for c in _memory.CLASSES}
    for group in sharded_groups(model):
        for buf in group.buffers.values():
            named["sharded params"].append(buf.local)
            named["gradients"].append(buf.local_grad)
            named["unsharded params"].append(buf.unsharded)
            named["unsharded grads"].append(buf.unsharded_grad)
            named["comm buffers"] += [buf._reduce_output, getattr(buf, "_reduce_send", None)]
    named["sharded params"] += list(model.parameters()) + list(model.buffers())
    named["gradients"] += [p.grad for p in model.parameters()]
    named["optimizer states"] = _optimizer_states(optimizer)
    return named


def _classes_fsdp2(model: nn.Module, optimizer) -> dict[str, list]:
    from torch.distributed.fsdp import FSDPModule

    named: dict[str, list] = {c: [] for c in _memory.CLASSES}
    seen_ctx = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for pg in module._get_fsdp_state()._fsdp_param_groups:
            for fp in pg.fsdp_params:
                named["sharded params"].append(fp._sharded_param_data)
                named["gradients"].append(fp.sharded_param.grad)
                named["unsharded params"] += list(getattr(fp, "all_gather_outputs", []))
                unsharded = getattr(fp, "_unsharded_param", None)
                if unsharded is not None:
                    named["unsharded params"].append(unsharded)
                    named["unsharded grads"].append(unsharded.grad)
            if pg._all_gather_result is not None:
                named["comm buffers"].append(pg._all_gather_result.all_gather_output)
            named["comm buffers"].append(getattr(pg, "_partial_reduce_output", None))
            ctx = pg.comm_ctx
            if id(ctx) not in seen_ctx:
                seen_ctx.add(id(ctx))
                state = getattr(ctx, "all_gather_state", None)  # set by the comm context's lazy init
                if state is not None:
                    named["comm buffers"].append(state.all_gather_result.all_gather_output)
                named["comm buffers"] += [s.reduce_scatter_input for s in getattr(ctx, "reduce_scatter_states", [])]
    named["sharded params"] += list(model.parameters()) + list(model.buffers())
    named["gradients"] += [p.grad for p in model.parameters()]
    named["optimizer states"] = _optimizer_states(optimizer)
    return named


def _classes_ddp(model: nn.Module, optimizer) -> dict[str, list]:
    named: dict[str, list] = {c: [] for c in _memory.CLASSES}
    named["sharded params"] = list(model.parameters()) + list(model.buffers())  # replicas: whole parameters
    named["gradients"] = [p.grad for p in model.parameters()]
    named["comm buffers"] = list(getattr(model, "bench_buckets", {}).values())
    named["optimizer states"] = _optimizer_states(optimizer)
    return named


def _record_ddp_buckets(model: nn.Module) -> None:
    """Keep DDP's flat gradient buckets (allocated in C++, out of the ledger's sight, then touched by its ops):
    tracked from the start they count once, as communication buffers, instead of inside "not tensors" and again
    as untracked tensors. The hook is DDP's default all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model.bench_buckets = {}

    def hook(state, bucket):
        model.bench_buckets[bucket.index()] = bucket.buffer()
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook)


def _optimizer_states(optimizer) -> list:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


CLASSIFIERS = {"vescale": _classes_vescale, "fsdp2": _classes_fsdp2, "ddp": _classes_ddp}


def staging_worker(rank: int, world: int, init_file: str, out_file: str) -> None:
    """The backend's staging per collective (:func:`_memory.measure_staging`), in processes of its own: the buffers
    gloo keeps after its first calls would otherwise sit in the memory runs' baselines."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ratios = _memory.measure_staging()
    if rank == 0:
        Path(out_file).write_text(json.dumps(ratios))
    dist.destroy_process_group()


def memory_worker(rank: int, world: int, init_file: str, setup: Setup, engine: str, staging: Optional[dict], args,
                  out_file: str) -> None:
    """One engine in fresh processes: the system's peak per phase, and with ``staging`` (the backend's staging
    ratios) the ledger's."""
    faulthandler.enable()
    share_cpu_threads(world)  # the recipes' split: torch's default (every core per rank) oversubscribes them
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    use_ledger = staging is not None
    batches = _batches(setup, rank, args.memory_steps, args)
    dist.barrier()
    baseline = _memory.rss_bytes()
    _memory.reset_peak_rss()
    model, optimizer, _, autocast = build(engine, setup, world)
    record = {"sharding": _memory.peak_rss_bytes() - baseline, "after_sharding": _memory.rss_bytes() - baseline}
    classify = lambda: CLASSIFIERS[base_engine(engine)](model, optimizer)  # noqa: E731
    if use_ledger:
        # Two warm-up steps first: libraries set up their workspaces and the optimizer its states, and DDP rebuilds
        # its gradient buckets at the start of its second step (storage the ledger would otherwise count twice:
        # the old buckets inside "not tensors", the new ones as untracked tensors), so "not tensors" is measured
        # once and the ledger's steps are the steady state the peak comes from.
        if base_engine(engine) == "ddp":
            _record_ddp_buckets(model)
        step(model, optimizer, batches[0], autocast)
        step(model, optimizer, batches[0], autocast)
        ledger = _memory.MemoryLedger(classify, baseline_rss=baseline, staging=staging)
        for tensors in classify().values():
            ledger.track(*[t for t in tensors if isinstance(t, torch.Tensor)])
        ledger.start()
        with ledger:
            for tokens in batches[1:]:
                step(model, optimizer, tokens, autocast, phase=ledger.phase)
            ledger.phase("end")
        record["ledger"] = ledger.results()
        record["staging_ratio"] = staging
    else:
        peaks = dict.fromkeys(PHASES, 0)
        current = [None]

        def phase(name: Optional[str]) -> None:
            if current[0] is not None:
                peaks[current[0]] = max(peaks[current[0]], _memory.peak_rss_bytes() - baseline)
            _memory.reset_peak_rss()
            current[0] = name

        for tokens in batches:
            step(model, optimizer, tokens, autocast, phase=phase)
        phase(None)
        record["phases"] = peaks
    record["end_of_step"] = _memory.rss_bytes() - baseline
    gathered = [None] * world
    dist.all_gather_object(gathered, record)
    if rank == 0:
        Path(out_file).write_text(json.dumps(gathered))
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------------
# Orchestration


def _context():
    """Processes fork from a server that imported torch and the package once (seconds saved per start), and
    that runs with the glibc settings that make the resident set follow live memory."""
    os.environ.update(_memory.MALLOC_ENV)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "lightning_vescale", "torch.distributed.fsdp"])
    return ctx


def run_processes(world: int, target, *args):
    ctx = _context()
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "out.json")
        procs = [ctx.Process(target=target, args=(r, world, init_file, *args, out_file)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"benchmark processes ({target.__name__}) failed on {world} ranks")
        return json.loads(Path(out_file).read_text())


def run_setup(name: str, world: int, args) -> dict:
    setup = SETUPS[name]
    engines = engines_for(setup, args.engines)
    result = {e: {} for e in engines}
    if not args.skip_time:
        for engine, r in run_processes(world, time_worker, setup, engines, args).items():
            result[engine].update(r)
    os_runs: dict[str, list] = {e: [] for e in engines}
    for repeat in range(args.repeats):
        order = engines if repeat % 2 == 0 else engines[::-1]  # alternate, so drifts hit engines alike
        for engine in order:
            os_runs[engine].append(run_processes(world, memory_worker, setup, engine, None, args))
    for engine in engines:
        runs = os_runs[engine]
        # Per run the worst rank; over runs the median.
        per_run = [max(max(r["sharding"], *r["phases"].values()) for r in ranks) for ranks in runs]
        result[engine]["os_peak"] = statistics.median(per_run) if per_run else None
        result[engine]["os_peak_runs"] = per_run
        result[engine]["os_phases"] = {
            ph: statistics.median(max(r["phases"][ph] for r in ranks) for ranks in runs) for ph in PHASES
        } if runs else {}
        if runs:
            result[engine]["os_sharding"] = statistics.median(max(r["sharding"] for r in ranks) for ranks in runs)
            result[engine]["os_end_of_step"] = statistics.median(max(r["end_of_step"] for r in ranks) for ranks in runs)
        if not args.skip_ledger and engine in args.ledger_engines:
            staging = _STAGING.get(world) or _STAGING.setdefault(world, run_processes(world, staging_worker))
            ranks = run_processes(world, memory_worker, setup, engine, staging, args)
            worst = max(range(world), key=lambda q: ranks[q]["ledger"]["os_peak"])
            result[engine]["ledger"] = ranks[worst]["ledger"]
            result[engine]["ledger_rank"] = worst
            result[engine]["staging_ratio"] = ranks[worst]["staging_ratio"]
    return result


# --------------------------------------------------------------------------------------------------------
# Report


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def _ratio(value, base) -> str:
    return f"{value / base:.3f}" if value is not None and base else "-"


def to_markdown(all_results: dict, args) -> str:
    lines = [
        "# Training benchmark: lightning-vescale vs FSDP2 vs DDP",
        "",
        f"Batch {args.batch}x{args.seq} tokens per rank, AdamW (torch default: single-tensor on CPU), gloo on CPU "
        f"({os.cpu_count()} cores shared by all ranks and by other engineers' jobs). Time: median of {args.steps} "
        f"timed steps after 2 warm-up steps, engines interleaved step by step. Memory: peak resident set per rank "
        f"above the baseline after imports and process-group setup, over sharding and {args.memory_steps} steps "
        f"(glibc: {' '.join(f'{k}={v}' for k, v in _memory.MALLOC_ENV.items())}); the worst rank, median of "
        f"{args.repeats} fresh runs per engine. Ledger: `benchmarks/_memory.py` in one more run.",
        "",
        "Command: `" + " ".join(["python benchmarks/train_bench.py", *sys.argv[1:]]) + "`",
        "",
        "| setup | ranks | engine | median step (s) | vs FSDP2 | paired vs FSDP2 | peak RSS / rank (MiB) | vs FSDP2 "
        "| ledger peak (MiB) | ledger / OS | sent / rank / step (MiB) | vs FSDP2 | padding |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, res in all_results.items():
        name, world = key.rsplit("@", 1)
        base = res.get("fsdp2", {})
        for engine, r in res.items():
            ledger = r.get("ledger") or {}
            lines.append(
                f"| {name} | {world} | {engine} | {r.get('median_step_s', float('nan')):.3f} | "
                f"{_ratio(r.get('median_step_s'), base.get('median_step_s'))} | "
                f"{'-' if r.get('paired_vs_fsdp2') is None else format(r['paired_vs_fsdp2'], '.3f')} | "
                f"{_mib(r.get('os_peak'))} | "
                f"{_ratio(r.get('os_peak'), base.get('os_peak'))} | {_mib(ledger.get('ledger_peak'))} | "
                f"{_ratio(ledger.get('ledger_peak'), ledger.get('os_peak'))} | "
                f"{_mib(r.get('bytes_per_step'))} | {_ratio(r.get('bytes_per_step'), base.get('bytes_per_step'))} | "
                f"{100 * r.get('padding', 0.0):.3f}% |"
            )
    lines += ["", "## Peak per phase (system's measure, MiB above the baseline; worst rank, median of runs)", "",
              "| setup | ranks | engine | sharding | forward | backward | optimizer step | end of step |",
              "|---|---|---|---|---|---|---|---|"]
    for key, res in all_results.items():
        name, world = key.rsplit("@", 1)
        for engine, r in res.items():
            ph = r.get("os_phases") or {}
            lines.append(f"| {name} | {world} | {engine} | {_mib(r.get('os_sharding'))} | "
                         + " | ".join(_mib(ph.get(p)) for p in PHASES) + f" | {_mib(r.get('os_end_of_step'))} |")
    lines += ["", "## Ledger breakdown at each phase's peak (MiB; the rank with the highest peak)", "",
              "Columns are the classes of `_memory.CLASSES`; `OS` is the system's peak in the same phase of the same "
              "run, `ledger/OS` their agreement.", "",
              "| setup | ranks | engine | phase | " + " | ".join(_memory.CLASSES) + " | ledger | OS | ledger/OS |",
              "|---|---|---|---|" + "---|" * (len(_memory.CLASSES) + 3)]
    for key, res in all_results.items():
        name, world = key.rsplit("@", 1)
        for engine, r in res.items():
            for ph, rec in ((r.get("ledger") or {}).get("phases") or {}).items():
                if ph == "end":
                    continue
                cells = " | ".join(_mib(rec["breakdown"].get(c, 0)) for c in _memory.CLASSES)
                lines.append(f"| {name} | {world} | {engine} | {ph} | {cells} | {_mib(rec['ledger_peak'])} | "
                             f"{_mib(rec['os_peak'])} | {_ratio(rec['ledger_peak'], rec['os_peak'])} |")
    lines += ["", "## At each engine's peak, in five classes (MiB; ledger, the rank and phase with the highest peak)", "",
              "sharded states: sharded parameters + sharded gradients + optimizer states; gathered buffers: unsharded "
              "parameters; gradient buffers: unsharded gradients; transient copies: the engine's communication buffers "
              "+ the backend's staging.", "",
              "| setup | ranks | engine | phase | op at the peak | " + " | ".join(SUMMARY) + " | not tensors | ledger | OS "
              "| ledger/OS |", "|---|---|---|---|---|" + "---|" * (len(SUMMARY) + 4)]
    for key, res in all_results.items():
        name, world = key.rsplit("@", 1)
        for engine, r in res.items():
            phases = {ph: rec for ph, rec in ((r.get("ledger") or {}).get("phases") or {}).items() if ph != "end"}
            if not phases:
                continue
            ph, rec = max(phases.items(), key=lambda kv: kv[1]["ledger_peak"])
            cells = " | ".join(_mib(sum(rec["breakdown"].get(c, 0) for c in classes)) for classes in SUMMARY.values())
            lines.append(f"| {name} | {world} | {engine} | {ph} | `{rec.get('op_at_peak', '')}` | {cells} | "
                         f"{_mib(rec['breakdown'].get('not tensors', 0))} | {_mib(rec['ledger_peak'])} | "
                         f"{_mib(rec['os_peak'])} | {_ratio(rec['ledger_peak'], rec['os_peak'])} |")
    return "\n".join(lines) + "\n"


SUMMARY = {
    "sharded states": ("sharded params", "gradients", "optimizer states"),
    "activations": ("activations",),
    "gathered buffers": ("unsharded params",),
    "gradient buffers": ("unsharded grads",),
    "transient copies": ("comm buffers", "comm staging (backend)"),
}
"""The ledger's classes (``_memory.CLASSES``) summed into the five a memory budget is read in."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=sorted(SETUPS))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--engines", nargs="+", default=list(ENGINES[:3]), choices=ENGINES)
    parser.add_argument("--steps", type=int, default=6, help="timed steps (after 2 warm-up steps)")
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="fresh memory runs per engine (median)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--skip-time", action="store_true")
    parser.add_argument("--skip-ledger", action="store_true")
    parser.add_argument("--ledger-engines", nargs="+", default=["fsdp2", "vescale", "ddp"], choices=ENGINES)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "train"))
    args = parser.parse_args()
    all_results = {}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    setups = {name: asdict(SETUPS[name]) for name in args.setups}
    for name in args.setups:
        for world in args.world_sizes:
            all_results[f"{name}@{world}"] = run_setup(name, world, args)
            print(json.dumps({f"{name}@{world}": all_results[f"{name}@{world}"]}), flush=True)
            # Written after every setup: a long run that stops keeps what it measured.
            Path(args.out + ".json").write_text(json.dumps(
                {"args": vars(args), "argv": sys.argv[1:], "setups": setups, "staging": _STAGING,
                 "results": all_results}, indent=1))
            Path(args.out + ".md").write_text(to_markdown(all_results, args))
    print(to_markdown(all_results, args))


if __name__ == "__main__":
    main()

"""The parts of ``benchmarks/gpu_check.sh``: one GPU check, prepared before any device ran this code.

    python benchmarks/gpu_check.py env|train|profile|host_tier|quant|summary  [--engine vescale|fsdp2]

Each part runs in its own process (the shell script starts them under a time budget) and writes
``$OUT/parts/<part>.json`` with ``status`` PASS, SKIP or FAIL and what it measured; ``summary`` collects them into
``$OUT/gpu_check_summary.md`` and ``$OUT/gpu_check_summary.json`` (a part whose JSON is missing crashed or ran out of
time: FAIL, with the tail of its log).

On CUDA: a Llama-1B-shaped model (``llama_config("1b")``, 1.24B parameters, tied embeddings) in bf16 mixed precision
(bf16 gathered parameters and compute, fp32 reduction and master weights), sharded by lightning-vescale and by
torch's FSDP2 the same way (``fully_shard`` per block, then the root) on a 1-rank NCCL process group, AdamW, random
tokens from a fixed seed. Without CUDA every part runs the same code on the ``tiny`` preset on gloo for a step or two
(a dry check that the script starts and its code paths run) and reports SKIP for what needs a GPU.

Environment (all optional): ``GPU_CHECK_STEPS`` timed steps (CUDA 10, CPU 1), ``GPU_CHECK_WARMUP`` (CUDA 3, CPU 1),
``GPU_CHECK_BATCH`` / ``GPU_CHECK_SEQ`` (CUDA 4 x 2048, CPU 2 x 32), ``GPU_CHECK_MODEL`` (a llama preset; CUDA
``1b``, CPU ``tiny``), ``GPU_CHECK_SIDE_LAYERS`` (layers of the 1B-shaped model in the host-tier and quantization
parts, 4), ``GPU_CHECK_PEAK_FLOPS`` (the device's dense bf16 peak for MFU; default 989e12, an H100/H200 SXM),
``GPU_CHECK_PROFILE_FSDP2`` (0 skips FSDP2's profile next to ours).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PEAK_BF16_FLOPS = 989e12
"""Dense bf16 tensor-core peak of an H100 / H200 SXM (NVIDIA datasheet: 1979 TFLOPS with 2:4 sparsity, half that
dense). MFU is achieved model FLOPs per second over this; set ``GPU_CHECK_PEAK_FLOPS`` for another device."""

TRACE_KEEP_BYTES = 40 * 2**20
"""A compressed trace larger than this is not kept (the top-kernel table and the copy analysis are)."""

PARTS = ("env", "train_vescale", "train_fsdp2", "profile", "host_tier", "quant")


# --------------------------------------------------------------------------------------------------------
# Settings and helpers


def out_dir() -> Path:
    out = Path(os.environ.get("OUT") or "gpu_check_out")
    (out / "parts").mkdir(parents=True, exist_ok=True)
    return out


def cuda() -> bool:
    return torch.cuda.is_available()


def _env_int(name: str, cuda_default: int, cpu_default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else (cuda_default if cuda() else cpu_default)


def settings() -> dict[str, Any]:
    return {
        "device": "cuda" if cuda() else "cpu",
        "backend": "nccl" if cuda() else "gloo",
        "model": os.environ.get("GPU_CHECK_MODEL") or ("1b" if cuda() else "tiny"),
        "steps": _env_int("GPU_CHECK_STEPS", 10, 1),
        "warmup": _env_int("GPU_CHECK_WARMUP", 3, 1),
        "batch": _env_int("GPU_CHECK_BATCH", 4, 2),
        "seq": _env_int("GPU_CHECK_SEQ", 2048, 32),
        "side_layers": _env_int("GPU_CHECK_SIDE_LAYERS", 4, 2),
        "peak_flops": float(os.environ.get("GPU_CHECK_PEAK_FLOPS") or PEAK_BF16_FLOPS),
    }


_STORES: list[Path] = []  # the file stores this process made, removed when its part ends


def init_process_group(part: str) -> None:
    """A 1-rank process group (NCCL on CUDA, gloo on CPU) from a file store under ``$OUT``."""
    store = Path(tempfile.gettempdir()) / f"gpu_check_pg_{part}_{os.getpid()}"
    store.unlink(missing_ok=True)
    _STORES.append(store)
    if cuda():
        torch.cuda.set_device(0)
    dist.init_process_group(settings()["backend"], init_method=f"file://{store}", rank=0, world_size=1)


def model_config(layers: Optional[int] = None):
    from lightning_vescale.models import llama_config

    s = settings()
    config = llama_config(s["model"])
    config.max_seq_len = s["seq"]  # RoPE tables for the sequence trained, not 131072 positions
    if layers is not None:
        config.n_layers = layers
    return config


def build(engine: str, config, *, quant: Optional[str] = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``config``'s Llama built on the device from seed 0, sharded by ``engine`` in bf16 mixed precision (``fully_shard``
    per block, then the root), and its AdamW."""
    from lightning_vescale.models import Llama

    torch.manual_seed(0)
    with torch.device(settings()["device"]):
        model = Llama(config)
    if engine == "vescale":
        import lightning_vescale as lv

        if quant is not None:
            from lightning_vescale.quant import BlockFormat, quantize_all_gather

            quantize_all_gather(model, BlockFormat(quant, 128), exclude=("tok_embeddings.*", "output.*"))
        policy = lv.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                         output_dtype=torch.float32)
        for block in model.layers:
            lv.fully_shard(block, mp_policy=policy)
        lv.fully_shard(model, mp_policy=policy)
    elif engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(settings()["device"], (1,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32))
    else:
        raise ValueError(f"engine must be 'vescale' or 'fsdp2', got {engine!r}")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def batches(config, n: int) -> list[torch.Tensor]:
    s = settings()
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, config.vocab_size, (s["batch"], s["seq"] + 1), generator=gen).to(s["device"])
            for _ in range(n)]


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    del logits
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def sync() -> None:
    if cuda():
        torch.cuda.synchronize()


def memory_stats() -> dict[str, int]:
    if not cuda():
        return {}
    return {"max_memory_allocated": torch.cuda.max_memory_allocated(),
            "max_memory_reserved": torch.cuda.max_memory_reserved(),
            "memory_allocated": torch.cuda.memory_allocated()}


def gib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def write_part(part: str, result: dict[str, Any]) -> None:
    path = out_dir() / "parts" / f"{part}.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    print(f"[gpu_check] {part}: {result['status']}" + (f" ({result['reason']})" if result.get("reason") else ""))


def skip_reason(what: str) -> str:
    return f"SKIP (no CUDA): {what}"


# --------------------------------------------------------------------------------------------------------
# Part 1: the environment


def part_env() -> dict[str, Any]:
    import lightning_vescale

    info: dict[str, Any] = {
        "python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "lightning_vescale": getattr(lightning_vescale, "__version__", None),
        "lightning_vescale_path": str(Path(lightning_vescale.__file__).parent),
        "cuda_available": cuda(), "nccl_available": dist.is_nccl_available(), "gloo_available": dist.is_gloo_available(),
        "cpu_count": os.cpu_count(), "settings": settings(),
    }
    if cuda():
        props = torch.cuda.get_device_properties(0)
        info.update(device_count=torch.cuda.device_count(), device_name=props.name,
                    capability=f"{props.major}.{props.minor}", device_memory=props.total_memory,
                    bf16_supported=torch.cuda.is_bf16_supported())
        try:
            version = torch.cuda.nccl.version()
            info["nccl_version"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            info["nccl_version"] = f"unknown ({exc})"
        if "H100" not in props.name and "H200" not in props.name and not os.environ.get("GPU_CHECK_PEAK_FLOPS"):
            info["peak_flops_note"] = f"MFU uses the H100/H200 peak ({PEAK_BF16_FLOPS:.3g}), not {props.name}'s"
        init_process_group("env")
        ones = torch.ones(4, device="cuda")
        dist.all_reduce(ones)  # NCCL on one rank
        torch.cuda.synchronize()
        info["nccl_all_reduce"] = bool(torch.equal(ones, torch.ones_like(ones)))
        dist.destroy_process_group()
        return {"status": "PASS" if info["nccl_all_reduce"] else "FAIL", **info}
    return {"status": "SKIP", "reason": skip_reason("no device to report; torch and lightning_vescale import"), **info}


# --------------------------------------------------------------------------------------------------------
# Part 2: tokens/s, MFU and CUDA memory, one engine per process


def part_train(engine: str) -> dict[str, Any]:
    s = settings()
    init_process_group(f"train_{engine}")
    if cuda():
        torch.cuda.reset_peak_memory_stats()
    config = model_config()
    model, optimizer = build(engine, config)
    from lightning_vescale.models import num_params

    params = num_params(model)
    setup_mem = memory_stats()
    data = batches(config, s["warmup"] + s["steps"])
    losses, times = [], []
    for i, tokens in enumerate(data):
        if i == s["warmup"] and cuda():
            torch.cuda.reset_peak_memory_stats()  # the steady state: optimizer states exist from here
        sync()
        start = time.perf_counter()
        losses.append(train_step(model, optimizer, tokens).item())
        sync()
        if i >= s["warmup"]:
            times.append(time.perf_counter() - start)
    step_mem = memory_stats()
    dist.destroy_process_group()
    tokens_per_step = s["batch"] * s["seq"]
    median = statistics.median(times)
    tokens_per_s = tokens_per_step / median
    # 6N per token (forward 2N, backward 4N) as the brief's MFU; with attention scores: + 12 * layers * dim * seq
    # (PaLM, appendix B; causal masking not discounted).
    flops_6n = 6 * params
    flops_attn = flops_6n + 12 * config.n_layers * config.dim * s["seq"]
    result = {
        "engine": engine, "model": s["model"], "params": params, "tokens_per_step": tokens_per_step,
        "losses": losses, "step_times_s": times, "median_step_s": median, "tokens_per_s": tokens_per_s,
        "mfu_6n": flops_6n * tokens_per_s / s["peak_flops"], "mfu_with_attention": flops_attn * tokens_per_s /
        s["peak_flops"], "peak_flops_assumed": s["peak_flops"], "memory_after_setup": setup_mem,
        "memory_steady_steps": step_mem,
    }
    if not all(math.isfinite(v) for v in losses):
        return {"status": "FAIL", "reason": f"non-finite loss: {losses}", **result}
    if not cuda():
        return {"status": "SKIP", "reason": skip_reason(f"tokens/s, MFU and max_memory_allocated/reserved of {engine} "
                                                        f"(the CPU dry run trained {len(losses)} steps, finite losses)"),
                **result}
    return {"status": "PASS", **result}


# --------------------------------------------------------------------------------------------------------
# Part 3: a profile of one step, and the copies at the collectives

COPY_OPS = ("aten::copy_", "aten::_to_copy", "aten::cat", "aten::_chunk_cat", "aten::split_with_sizes_copy",
            "aten::_foreach_copy_", "aten::clone", "aten::contiguous", "aten::index_copy_")
CPU_COPY_OPS = ("aten::copy_", "aten::cat", "aten::_chunk_cat", "aten::split_with_sizes_copy")
"""The innermost copy ops on CPU (``_to_copy``, ``clone``, ``contiguous`` and ``_foreach_copy_`` end in ``copy_``)."""
COPY_KERNEL = re.compile(r"memcpy|copy|CatArray|chunk_cat|split_with_sizes|^aten::cat$", re.IGNORECASE)
"""Copy work by name: CUDA memcpys, copy / cat / split kernels, and on CPU the ops themselves (not "scatter")."""
SITES = {
    "vescale": re.compile(r"^lv::(unshard|reduce_grad|all_gather|reduce_scatter)"),
    # FSDP2 unshards inside its pre-forward / pre-backward hooks (and their prefetches); at N = 1 it names no
    # "FSDP::all_gather" region, so the hooks are its sites.
    "fsdp2": re.compile(r"^FSDP::(all_gather|pre_forward|pre_backward|post_backward_reduce|forward_prefetch|"
                        r"backward_prefetch)"),
}
STAND_IN = re.compile(r"^lv::(all_gather|reduce_scatter)")
"""At N = 1 ``collectives.py`` skips the collective and copies its input to its output when they differ."""


def _mark_collective_sites() -> None:
    """Name lightning-vescale's collective sites in the profile: a group's unshard (the bf16 cast into the AllGather
    buffer, the AllGather), its gradient reduction (the fp32 cast, the ReduceScatter), and the collectives."""
    from torch.profiler import record_function

    import lightning_vescale.engine.collectives as collectives
    from lightning_vescale.engine.dbuffer import DBuffer

    def named(name: str, fn: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with record_function(name):
                return fn(*args, **kwargs)
        return wrapper

    collectives.all_gather_into_tensor = named("lv::all_gather", collectives.all_gather_into_tensor)
    collectives.reduce_scatter_tensor = named("lv::reduce_scatter", collectives.reduce_scatter_tensor)
    DBuffer.unshard = named("lv::unshard", DBuffer.unshard)
    DBuffer.reduce_grad = named("lv::reduce_grad", DBuffer.reduce_grad)


def _end(e: dict) -> float:
    return e["ts"] + e.get("dur", 0)


def _enclosing(intervals: list[dict], points: list[tuple[float, Any]]) -> list[list[dict]]:
    """For each ``(ts, tid)`` point, the intervals of its thread that contain it, outermost first (one sweep per
    thread: a step's trace has tens of thousands of ops)."""
    by_tid: dict[Any, list[dict]] = {}
    for e in intervals:
        by_tid.setdefault(e["tid"], []).append(e)
    order = sorted(range(len(points)), key=lambda i: (points[i][1] is None, str(points[i][1]), points[i][0]))
    result: list[list[dict]] = [[] for _ in points]
    tid, stack, pending = object(), [], []
    for i in order:
        ts, point_tid = points[i]
        if point_tid != tid:
            tid, stack = point_tid, []
            pending = sorted(by_tid.get(tid, []), key=lambda e: (e["ts"], -e.get("dur", 0)))[::-1]
        while pending and pending[-1]["ts"] <= ts:
            e = pending.pop()
            while stack and _end(stack[-1]) < e["ts"]:
                stack.pop()
            stack.append(e)
        result[i] = [e for e in stack if _end(e) >= ts]
    return result


def copies_at_collectives(trace: dict, engine: str) -> dict[str, Any]:
    """Copy work (GPU kernels on CUDA, CPU copy ops without one) launched inside ``engine``'s collective sites, and
    copy kernels next to an NCCL kernel in GPU order. A copy whose input and output dtypes differ is the
    mixed-precision cast (both engines need it); any other is a staging copy."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    sites = [e for e in events if e.get("cat") in ("user_annotation", "cpu_op") and SITES[engine].match(e["name"])]
    runtime = {e["args"]["correlation"]: e for e in events
               if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    work = []  # (name, launch ts, launching thread)
    for k in kernels:
        launch = runtime.get(k.get("args", {}).get("correlation"))
        if launch is not None:
            work.append((k["name"], launch["ts"], launch["tid"]))
    if not kernels:  # CPU: the copy ops themselves (innermost ones: a copy_ inside _to_copy counts once)
        work = [(e["name"], e["ts"], e["tid"]) for e in ops if e["name"] in CPU_COPY_OPS]
    found: dict[tuple, dict] = {}
    site_ids = {id(e) for e in sites}
    stacks = _enclosing(ops + [e for e in sites if e.get("cat") != "cpu_op"], [(ts, tid) for _, ts, tid in work])
    for (name, _, _), stack in zip(work, stacks):
        enclosing_sites = [e for e in stack if id(e) in site_ids]
        if not enclosing_sites or "nccl" in name.lower():
            continue
        enclosing_ops = [e for e in stack if e.get("cat") == "cpu_op"]
        op = enclosing_ops[-1]["name"] if enclosing_ops else ""
        copy_op = next((e for e in reversed(enclosing_ops) if e["name"] in COPY_OPS), None)
        if not (COPY_KERNEL.search(name) or copy_op is not None):
            continue
        types = [t for t in (copy_op or {}).get("args", {}).get("Input type", [])[:2] if t]
        site = min(enclosing_sites, key=lambda e: e.get("dur", 0))["name"]  # the innermost site
        is_cast = (copy_op is not None and copy_op["name"] in ("aten::copy_", "aten::_to_copy") and len(types) == 2
                   and types[0] != types[1] and "Scalar" not in types)  # copy_(dst, src): their dtypes differ
        kind = "cast" if is_cast else "n1_stand_in" if STAND_IN.match(site) else "staging"
        key = (re.sub(r" \(.*\)$", "", site), kind, name[:120], op)
        entry = found.setdefault(key, {"site": key[0], "kind": kind, "work": key[2], "op": op, "dtypes": types[:2],
                                       "count": 0})
        entry["count"] += 1
    nccl = [i for i, k in enumerate(kernels) if "nccl" in k["name"].lower()]
    adjacent = []
    for i in nccl:
        for j in (i - 1, i + 1):
            if 0 <= j < len(kernels) and COPY_KERNEL.search(kernels[j]["name"]) and "nccl" not in kernels[j]["name"].lower():
                adjacent.append({"nccl": kernels[i]["name"][:80], "neighbour": kernels[j]["name"][:120]})
    rows = sorted(found.values(), key=lambda r: (r["site"], r["kind"], -r["count"]))
    return {"sites": len(sites), "copies": rows, "nccl_kernels": len(nccl), "copies_adjacent_to_nccl": adjacent,
            "staging_copies": sum(r["count"] for r in rows if r["kind"] == "staging")}


def _profile_one(engine: str, config, out: Path) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    model, optimizer = build(engine, config)
    data = batches(config, 3 if cuda() else 2)
    for tokens in data[:-1]:
        train_step(model, optimizer, tokens)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda() else [])
    with profile(activities=activities, record_shapes=True) as prof:
        train_step(model, optimizer, data[-1])
        sync()
    sort = "self_device_time_total" if cuda() else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=30)
    (out / f"profile_{engine}_top.txt").write_text(table)
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace_path))
        trace = json.loads(trace_path.read_text())
    kept = out / f"profile_{engine}_trace.json.gz"
    with gzip.open(kept, "wt") as f:
        json.dump(trace, f)
    if kept.stat().st_size > TRACE_KEEP_BYTES:  # too big to come back from the device: the summaries stay
        kept.unlink()
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"]
    by_name: dict[str, list[float]] = {}
    for k in kernels:
        by_name.setdefault(k["name"], []).append(k.get("dur", 0))
    top = sorted(((sum(v), len(v), n) for n, v in by_name.items()), reverse=True)[:15]
    del model, optimizer
    if cuda():
        torch.cuda.empty_cache()
    return {"top_kernels": [{"name": n[:140], "total_us": t, "calls": c} for t, c, n in top],
            "gpu_kernel_time_us": sum(k.get("dur", 0) for k in kernels), **copies_at_collectives(trace, engine)}


def part_profile() -> dict[str, Any]:
    out = out_dir()
    init_process_group("profile")
    _mark_collective_sites()
    config = model_config()
    engines = ("vescale", "fsdp2") if os.environ.get("GPU_CHECK_PROFILE_FSDP2", "1") != "0" else ("vescale",)
    result: dict[str, Any] = {}
    for engine in engines:  # FSDP2's profile is worth having even when ours fails
        try:
            result[engine] = _profile_one(engine, config, out)
        except Exception as exc:  # noqa: BLE001 - reported in the part's JSON
            traceback.print_exc()
            result[engine] = {"error": f"{type(exc).__name__}: {exc}"[:500], "traceback": traceback.format_exc()}
            _empty_cache()
    dist.destroy_process_group()
    ours = result["vescale"]
    if "error" in ours:
        return {"status": "FAIL", "reason": f"profiling lightning-vescale failed: {ours['error']}", **result}
    lines = ["# Copies at the collective sites (one profiled step)", "",
             "kind: `cast` = the mixed-precision cast (input and output dtypes differ; both engines need it), "
             "`n1_stand_in` = the copy lightning-vescale's collectives make at N = 1 in place of the collective, "
             "`staging` = any other copy (FSDP2's copy-in / copy-out / chunk-cat; the engine should have none).", ""]
    for engine, r in result.items():
        if "error" in r:
            lines += [f"## {engine}: profiling failed: {r['error']}", ""]
            continue
        lines += [f"## {engine}: {r['sites']} sites, {r['nccl_kernels']} NCCL kernels, {r['staging_copies']} staging "
                  f"copies, {len(r['copies_adjacent_to_nccl'])} copy kernels next to an NCCL kernel", "",
                  "| site | kind | copy | op | dtypes | count |", "|---|---|---|---|---|---|"]
        lines += [f"| {c['site']} | {c['kind']} | `{c['work']}` | {c['op']} | {', '.join(c['dtypes'])} | {c['count']} |"
                  for c in r["copies"]]
        lines += [""]
    (out / "profile_copies.md").write_text("\n".join(lines))
    clean = ours["staging_copies"] == 0 and not ours["copies_adjacent_to_nccl"] and ours["sites"] > 0
    verdict = (f"lightning-vescale: {ours['staging_copies']} staging copies at {ours['sites']} collective sites, "
               f"{len(ours['copies_adjacent_to_nccl'])} copy kernels next to NCCL kernels")
    if ours["sites"] == 0:
        return {"status": "FAIL", "reason": "no collective site was seen in the profile", **result}
    if cuda() and not ours["top_kernels"]:
        return {"status": "FAIL", "reason": "the profile recorded no CUDA kernels (is CUPTI available?)", **result}
    if not cuda():
        return {"status": "SKIP", "reason": skip_reason(f"CUDA kernels and NCCL adjacency (CPU ops checked: {verdict})"),
                **result}
    return {"status": "PASS" if clean else "FAIL", "reason": verdict, **result}


# --------------------------------------------------------------------------------------------------------
# Parts 4 and 5: the host memory tier and the block-quantized AllGather, against device-only bf16


def _run_steps(model: nn.Module, optimizer: torch.optim.Optimizer, data: list[torch.Tensor]) -> dict[str, Any]:
    if cuda():
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for tokens in data:
        sync()
        start = time.perf_counter()
        losses.append(train_step(model, optimizer, tokens).item())
        sync()
        times.append(time.perf_counter() - start)
    return {"losses": losses, "step_times_s": times, **memory_stats()}


def _compare(name: str, base: dict, other: dict, rtol: float) -> tuple[bool, str]:
    finite = all(math.isfinite(v) for v in other["losses"])
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(other["losses"], base["losses"]))
    ok = finite and worst <= rtol
    return ok, f"{name} losses {'finite' if finite else 'NOT finite'}, worst relative difference {worst:.2e} " \
               f"(allowed {rtol:g})"


def _empty_cache() -> None:
    if cuda():
        torch.cuda.empty_cache()


def part_host_tier() -> dict[str, Any]:
    from lightning_vescale.memory import MemoryPolicy, apply_memory_policy

    s = settings()
    init_process_group("host_tier")
    config = model_config(layers=s["side_layers"])
    data = batches(config, s["steps"] + 1)
    model, optimizer = build("vescale", config)
    device_only = _run_steps(model, optimizer, data)
    del model, optimizer
    _empty_cache()
    model, optimizer = build("vescale", config)
    handles = apply_memory_policy(model, [optimizer], MemoryPolicy(optimizer_states="host"))
    host = _run_steps(model, optimizer, data)
    states_device = sorted({str(v.device) for st in optimizer.state.values() for v in st.values()
                            if isinstance(v, torch.Tensor) and v.dim() > 0})
    handles.close()
    dist.destroy_process_group()
    # Bitwise is expected (the same ops on the same bytes, README "Memory tiers"); bf16 noise is the bar.
    ok, verdict = _compare("host tier", device_only, host, rtol=1e-2)
    result = {"layers": config.n_layers, "device_only": device_only, "host": host,
              "optimizer_state_devices_between_steps": states_device,
              "bitwise_equal_losses": host["losses"] == device_only["losses"]}
    if cuda():
        saved = device_only.get("max_memory_allocated", 0) - host.get("max_memory_allocated", 0)
        verdict += f"; max_memory_allocated {gib(host.get('max_memory_allocated'))} vs " \
                   f"{gib(device_only.get('max_memory_allocated'))} device-only ({gib(saved)} less)"
        return {"status": "PASS" if ok else "FAIL", "reason": verdict, **result}
    if not ok:
        return {"status": "FAIL", "reason": verdict, **result}
    return {"status": "SKIP", "reason": skip_reason(f"pinned host memory (on CPU the host tier is the device's memory; "
                                                    f"{verdict})"), **result}


def part_quant() -> dict[str, Any]:
    s = settings()
    init_process_group("quant")
    config = model_config(layers=s["side_layers"])
    data = batches(config, s["steps"] + 1)
    runs: dict[str, dict] = {}
    errors: dict[str, str] = {}
    for fmt in (None, "fp8_e4m3", "int8"):  # each format on its own: one failing leaves the others' results
        try:
            model, optimizer = build("vescale", config, quant=fmt)
            runs[fmt or "bf16"] = _run_steps(model, optimizer, data)
            del model, optimizer
        except Exception as exc:  # noqa: BLE001 - reported in the part's JSON
            traceback.print_exc()
            errors[fmt or "bf16"] = f"{type(exc).__name__}: {exc}"[:500]
        _empty_cache()
    dist.destroy_process_group()
    if errors:
        return {"status": "FAIL", "reason": "; ".join(f"{k} failed: {v}" for k, v in errors.items()), "runs": runs,
                "errors": errors}
    checks = [_compare(fmt, runs["bf16"], runs[fmt], rtol=5e-2) for fmt in ("fp8_e4m3", "int8")]
    ok = all(c[0] for c in checks)
    verdict = "; ".join(c[1] for c in checks) + " against the bf16 AllGather"
    result = {"layers": config.n_layers, "runs": runs}
    if cuda() or not ok:
        return {"status": "PASS" if ok else "FAIL", "reason": verdict, **result}
    return {"status": "SKIP", "reason": skip_reason(f"the quantized AllGather on CUDA (CPU dry run: {verdict})"),
            **result}


# --------------------------------------------------------------------------------------------------------
# Summary


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def summary() -> dict[str, Any]:
    out = out_dir()
    parts: dict[str, dict] = {}
    for part in PARTS:
        path = out / "parts" / f"{part}.json"
        if path.exists():
            parts[part] = json.loads(path.read_text())
        else:
            log = out / "logs" / f"{part}.log"
            tail = log.read_text(errors="replace")[-1500:] if log.exists() else "(no log)"
            rc_path = out / "logs" / f"{part}.rc"
            rc = rc_path.read_text().strip() if rc_path.exists() else "not run"
            why = ("timed out" if rc in ("124", "137") else "not run: the time budget was spent" if rc == "budget"
                   else f"exit status {rc}")
            parts[part] = {"status": "FAIL", "reason": f"no result ({why}); see logs/{part}.log", "log_tail": tail}
    ours, theirs = parts["train_vescale"], parts["train_fsdp2"]
    compare: dict[str, Any] = {}
    if "tokens_per_s" in ours and "tokens_per_s" in theirs:
        compare = {
            "tokens_per_s_vs_fsdp2": _ratio(ours["tokens_per_s"], theirs["tokens_per_s"]),
            "first_loss_difference": abs(ours["losses"][0] - theirs["losses"][0]),
        }
        for key in ("max_memory_allocated", "max_memory_reserved"):
            compare[f"{key}_vs_fsdp2"] = _ratio(ours["memory_steady_steps"].get(key),
                                                theirs["memory_steady_steps"].get(key))
    statuses = {p: parts[p]["status"] for p in PARTS}
    overall = "FAIL" if "FAIL" in statuses.values() else "PASS" if all(v == "PASS" for v in statuses.values()) else "SKIP"
    result = {"overall": overall, "statuses": statuses, "compare": compare, "settings": settings(), "parts": parts}
    (out / "gpu_check_summary.json").write_text(json.dumps(result, indent=2, default=str))
    lines = ["# GPU check summary", "", f"overall: **{overall}** ({'CUDA' if cuda() else 'CPU dry check'}; "
             f"settings {json.dumps(settings())})", "", "| part | status | detail |", "|---|---|---|"]
    for part in PARTS:
        detail = str(parts[part].get("reason", "")).replace("|", "/").replace("\n", " ")
        lines.append(f"| {part} | {statuses[part]} | {detail} |")
    env = parts["env"]
    lines += ["", f"torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), device {env.get('device_name', 'none')}, "
              f"NCCL {env.get('nccl_version', env.get('nccl_available'))}", ""]
    if "tokens_per_s" in ours or "tokens_per_s" in theirs:
        lines += ["## Training (N = 1, bf16 mixed precision, AdamW)" + ("" if cuda() else
                  ": CPU dry run, a step or two of the tiny model, not a measurement"), "",
                  "| engine | params | tokens/s | MFU (6N) | MFU (6N + attention) | median step | max allocated | "
                  "max reserved | first loss |", "|---|---|---|---|---|---|---|---|---|"]
        for r in (ours, theirs):
            if "tokens_per_s" not in r:
                continue
            mem = r.get("memory_steady_steps", {})
            lines.append(f"| {r['engine']} | {r['params'] / 1e6:.1f}M | {r['tokens_per_s']:.0f} | {r['mfu_6n']:.1%} | "
                         f"{r['mfu_with_attention']:.1%} | {r['median_step_s'] * 1e3:.1f} ms | "
                         f"{gib(mem.get('max_memory_allocated'))} | {gib(mem.get('max_memory_reserved'))} | "
                         f"{r['losses'][0]:.4f} |")
        if compare:
            lines += ["", "vs FSDP2: " + ", ".join(f"{k} {v:.3f}" for k, v in compare.items() if v is not None)]
        lines += ["", f"MFU assumes a dense bf16 peak of {settings()['peak_flops'] / 1e12:.0f} TFLOPS (H100/H200 SXM; "
                  "GPU_CHECK_PEAK_FLOPS overrides) and 6 FLOPs per parameter per token (tied embedding counted once); "
                  "memory is the steady state after warm-up (torch.cuda.max_memory_allocated / reserved)."]
    lines += ["", "Files: parts/*.json, logs/*.log, profile_copies.md, profile_*_top.txt, profile_*_trace.json.gz", ""]
    for part in PARTS:
        tail = parts[part].get("log_tail") or parts[part].get("traceback", "")[-1500:]
        if tail:
            lines += [f"## {part}: {'log tail' if 'log_tail' in parts[part] else 'traceback'}", "", "```", tail, "```",
                      ""]
    (out / "gpu_check_summary.md").write_text("\n".join(lines))
    print("\n".join(lines[:len(PARTS) + 6]))
    return result


# --------------------------------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("env", "train", "profile", "host_tier", "quant", "summary"))
    parser.add_argument("--engine", choices=("vescale", "fsdp2"), default="vescale")
    args = parser.parse_args(argv)
    if args.part == "summary":
        summary()
        return 0
    name = f"train_{args.engine}" if args.part == "train" else args.part
    run = {"env": part_env, "train": lambda: part_train(args.engine), "profile": part_profile,
           "host_tier": part_host_tier, "quant": part_quant}[args.part]
    started = time.perf_counter()
    try:
        result = run()
    except Exception as exc:  # noqa: BLE001 - every failure is reported in the part's JSON
        traceback.print_exc()
        result = {"status": "FAIL", "reason": f"{type(exc).__name__}: {exc}"[:500], "traceback": traceback.format_exc()}
    finally:
        for store in _STORES:
            store.unlink(missing_ok=True)
    result["wall_s"] = time.perf_counter() - started
    write_part(name, result)
    return 0 if result["status"] != "FAIL" else 1


if __name__ == "__main__":
    sys.exit(main())

"""The dry run against reality on this machine: bytes per step and peak memory per rank.

    python benchmarks/plan_check.py                       # bench_small (33.6M), 2 and 4 gloo ranks
    python benchmarks/plan_check.py --world-sizes 2 --steps 3 --batch 4
    python benchmarks/plan_check.py --model bench_tiny --world-sizes 4 --replicate 2 --plan my_fp8_plan.yaml

Each world size is one set of processes. Each rank builds the benchmark model on the meta device,
``lightning_vescale.parallelize`` shards and initializes it, and it trains a few AdamW steps (fp32) on random
tokens. Measured per rank:

* bytes sent per step by collective kind, from ``lightning_vescale.comm_stats`` (steps after the first, whose
  plan-agreement check is extra);
* the operating system's peak resident set (in the JSON also the last step's high-water marks of forward and
  backward and of the optimizer step, the mark reset between steps): the kernel's high-water mark (``VmHWM``) is reset (write ``5`` to
  ``/proc/self/clear_refs``) after imports, process-group setup (the device mesh and its sub-meshes included)
  and one step of a tiny unsharded model (so the
  kernels' code and thread pools a first step brings in, about 80 MiB here, are resident before), read back
  after the steps, and the resident set at the reset is subtracted. glibc is told to return freed blocks of 128 KiB or more to the
  system (``MALLOC_MMAP_THRESHOLD_=131072 MALLOC_TRIM_THRESHOLD_=131072``), so the high-water mark follows live
  memory rather than allocator slack. (This is this script's own minimal measurement; ``train_bench.py`` gets
  a fuller one.)

``--replicate R`` shards on an HSDP mesh (``build_mesh(..., replicate_size=R)``) and predicts with
``replicate=R``; a plan with ``quantization`` is sized with the engine's quantized buffers. ``--tp T`` shards on a
``("dp", "tp")`` mesh with the plan's tp rules (``--plan llama``) and predicts with ``tp=T``. ``--ep E`` (with ``--model
bench_moe --plan moe``) shards on a ``("dp", "ep")`` mesh, or ``("dp", "ep", "tp")`` with ``--tp``, and predicts with
``ep=E``: the routers route evenly (token ``i`` to experts ``i k ..``), the balanced routing the dry run sizes, and the
peak is measured from after setup (the whole model is built before expert parallelism splits it). Torch's tensor-parallel
collectives are counted at dispatch (``FunctionalCollectiveCounter``: ``all_reduce_tp``, and with sequence
parallelism, ``--plan llama_sp --tp 2``, ``all_gather_tp`` / ``reduce_scatter_tp``), as the dry run counts them.

Predicted, in the parent process, by ``python -m lightning_vescale.plan``'s code (``dry_run``) for the same
model, plan, mesh, batch and world size: bytes per collective kind and the peak per rank. Results go to
``benchmarks/results/plan_check.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODELS = {
    # As train_bench.py: ~33.6M parameters, Llama-shaped.
    "bench_small": dict(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=1536, max_seq_len=256),
    "bench_tiny": dict(vocab_size=1024, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=352, max_seq_len=128),
}
MOE_MODELS = {
    # MoE-shaped (lightning_vescale.models.MoE): 8 routed experts of 4 layers, top 2, a shared expert; ~18M parameters.
    "bench_moe": dict(vocab_size=8192, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, num_experts=8, top_k=2,
                      moe_hidden=512, shared_expert_hidden=512, max_seq_len=256),
}
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> int:
    """Reset the kernel's high-water mark of this process's resident set; return the resident set now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def peak_rss() -> int:
    return _status("VmHWM")


def lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy (the logits are not kept past it, as in the recipes' training step)."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def warm_up(llama, llama_config) -> None:
    """One training step of a tiny unsharded model before the baseline: the kernels' code, thread pools and
    allocator arenas a first step brings in are resident before it, so the measured growth is the model's."""
    model = llama(llama_config(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=64, max_seq_len=16))
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 64, (2, 9))
    lm_loss(model, tokens).backward()
    optimizer.step()


def build(name: str, device: str = "meta") -> torch.nn.Module:
    """The benchmark model ``name`` (Llama- or MoE-shaped) on ``device`` (an MoE for expert parallelism: materialized,
    seeded, identical on every rank)."""
    from lightning_vescale.models import Llama, LlamaConfig, MoE, MoEConfig

    torch.manual_seed(0)
    with torch.device(device):
        return MoE(MoEConfig(**MOE_MODELS[name])) if name in MOE_MODELS else Llama(LlamaConfig(**MODELS[name]))


def even_routing(router, x_ND: torch.Tensor):
    """``TopKRouter.forward`` routing token ``i`` to experts ``i k .. i k + k - 1`` (mod E): every expert gets the same
    rows from every rank, the balanced routing the dry run sizes."""
    from lightning_vescale.models.moe import RouterOutput

    scores_NE = torch.softmax(F.linear(x_ND, router.weight).float(), dim=-1)
    N, k, E = x_ND.shape[0], router.top_k, router.num_experts
    selected_NA = (torch.arange(N)[:, None] * k + torch.arange(k)) % E
    weights_NA = scores_NE.gather(-1, selected_NA)
    counts_E = torch.bincount(selected_NA.flatten(), minlength=E)
    return RouterOutput(weights_NA.to(x_ND.dtype), selected_NA, scores_NE, counts_E)


def worker(rank: int, world: int, init_file: str, args, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import gc

    import lightning_vescale as lv
    from lightning_vescale.models import Llama, LlamaConfig
    from lightning_vescale.models.moe import TopKRouter
    from lightning_vescale.plan._hardware import FunctionalCollectiveCounter

    TopKRouter.forward = even_routing  # type: ignore[method-assign]  # (a MoE's routers only)
    vocab = (MOE_MODELS.get(args.model) or MODELS[args.model])["vocab_size"]
    warm_up(Llama, LlamaConfig)
    gen = torch.Generator().manual_seed(1234 + rank)
    batches = [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(args.steps)]
    from lightning_vescale.parallel.parallelize import build_mesh

    mesh = build_mesh(torch.device("cpu"), world, args.replicate) if args.replicate > 1 else None
    if args.tp > 1 or args.ep > 1:
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = ((world // (args.ep * args.tp), args.ep, args.tp), ("dp", "ep", "tp")) if args.ep > 1 else \
            ((world // args.tp, args.tp), ("dp", "tp"))
        if args.tp == 1:
            shape, names = shape[:2], names[:2]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        replica = rank // args.tp  # the ranks of one tp group read the same tokens
        batches = [torch.randint(0, vocab, (args.batch, args.seq + 1),
                                 generator=torch.Generator().manual_seed(1000 * replica + i)) for i in range(args.steps)]
        if args.ep > 1:  # process-group setup too: the flattened meshes expert parallelism shards over (cached)
            mesh._flatten()
            if args.tp > 1:
                mesh["dp", "ep"]._flatten()
                mesh["dp", "tp"]._flatten()
    dist.barrier()
    baseline = reset_peak()
    model = build(args.model, "cpu" if args.ep > 1 else "meta")
    lv.parallelize(model, args.plan, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    after_setup = peak_rss() - baseline
    if args.ep > 1:  # the whole model built before expert parallelism split it: measure training from here
        gc.collect()
        reset_peak()
    sent = []
    train_peak = peak_rss() - baseline
    for tokens in batches:
        with FunctionalCollectiveCounter("tp", all_to_all="ep") as tp_sent:
            lm_loss(model, tokens).backward()
        forward_backward = peak_rss() - baseline  # since the last step's end
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train_peak = max(train_peak, peak_rss() - baseline)
        in_step = peak_rss() - baseline
        reset_peak()  # the next step's high-water marks start from here (train_peak keeps the largest)
        step = dict(lv.comm_stats.step())
        step.update({k: int(v) for k, v in tp_sent.sent.items()})
        sent.append(step)
    result = {"baseline_rss": baseline, "setup_peak": after_setup, "train_peak": train_peak,
              "forward_backward_peak": forward_backward, "optimizer_step_peak": in_step,
              "bytes": sent[-1], "bytes_steps": sent}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out_file).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def measure(world: int, args) -> list:
    os.environ.update(MALLOC_ENV)  # read by glibc when the spawned interpreters start
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "out.json")
        procs = [ctx.Process(target=worker, args=(r, world, init_file, args, out_file)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"plan check processes failed on {world} ranks")
        return json.loads(Path(out_file).read_text())


def predict(world: int, args):
    from lightning_vescale.plan import resolve_plan
    from lightning_vescale.plan._dry_run import Workload, dry_run
    from lightning_vescale.plan._hardware import load_profile

    model = build(args.model)
    resolved = resolve_plan(model, args.plan and __import__("lightning_vescale").load_plan(args.plan))
    workload = Workload(batch_size=args.batch, seq_len=args.seq, precision="32-true", optimizer="adamw", clip_grad=False)
    return dry_run(model, resolved, world, workload=workload, hardware=load_profile("cpu"), replicate=args.replicate,
                   tensor_parallel=args.tp, expert_parallel=args.ep)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench_small", choices=sorted([*MODELS, *MOE_MODELS]))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--plan", default=None, help="a plan name or file (default: the default plan)")
    parser.add_argument("--replicate", type=int, default=1, help="HSDP replicas (default 1: a 1-D mesh)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (with a plan with tp rules)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (--model bench_moe --plan moe)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "plan_check"))
    args = parser.parse_args()
    default_out = parser.get_default("out")
    args.out_name = None if args.out == default_out else os.path.relpath(args.out, Path(__file__).resolve().parent.parent)
    rows = []
    for world in args.world_sizes:
        start = time.perf_counter()
        ranks = measure(world, args)
        predicted = predict(world, args)
        ve = predicted.vescale
        measured_peak = max(r["train_peak"] for r in ranks)
        measured_bytes = {k: max(r["bytes"].get(k, 0) for r in ranks) for k in ranks[0]["bytes"]}
        row = {
            "world_size": world, "measured_peak": measured_peak,
            "measured_peak_per_rank": [r["train_peak"] for r in ranks], "predicted_peak": ve.peak,
            "peak_error": ve.peak / measured_peak - 1, "measured_bytes": measured_bytes,
            "measured_forward_backward_peak": max(r["forward_backward_peak"] for r in ranks),
            "measured_optimizer_step_peak": max(r["optimizer_step_peak"] for r in ranks),
            "predicted_bytes": {k: int(v) for k, v in ve.collectives.items()},
            "bytes_equal": all(int(ve.collectives.get(k, 0)) == v for k, v in measured_bytes.items())
            and all(measured_bytes.get(k, 0) == int(v) for k, v in ve.collectives.items() if v),
            "predicted": {k: getattr(ve, k) for k in ("params", "grads", "optimizer", "gathered_peak", "activations")},
            "seconds": time.perf_counter() - start,
        }
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({"args": vars(args), "results": rows}, indent=1))
    Path(args.out + ".md").write_text(to_markdown(rows, args))


def to_markdown(rows: list, args) -> str:
    mib = 2**20
    lines = [
        "# Dry run vs measurement (this machine)",
        "",
        f"Model `{args.model}` ({'MoE' if args.model in MOE_MODELS else 'Llama'}-shaped, "
        f"{sum_params(args.model) / 1e6:.1f}M parameters), "
        f"{'plan ' + repr(args.plan) if args.plan else 'default plan'}, "
        f"{f'HSDP mesh ({args.replicate} replicas), ' if args.replicate > 1 else ''}"
        f"{f'(dp, tp) mesh with tp={args.tp}, ' if args.tp > 1 and args.ep == 1 else ''}"
        f"{f'(dp, ep) mesh with ep={args.ep}, ' if args.ep > 1 and args.tp == 1 else ''}"
        f"{f'(dp, ep, tp) mesh with ep={args.ep}, tp={args.tp}, ' if args.ep > 1 and args.tp > 1 else ''}"
        f"{'routers routing evenly (the balanced routing the dry run assumes), ' if args.model in MOE_MODELS else ''}"
        f"fp32 AdamW, "
        f"batch {args.batch}x{args.seq} tokens per rank, {args.steps} steps, gloo on CPU.",
        f"Command: `python benchmarks/plan_check.py --model {args.model} --world-sizes "
        f"{' '.join(map(str, args.world_sizes))} --steps {args.steps} --batch {args.batch} --seq {args.seq}"
        f"{f' --plan {args.plan}' if args.plan else ''}{f' --replicate {args.replicate}' if args.replicate > 1 else ''}"
        f"{f' --tp {args.tp}' if args.tp > 1 else ''}{f' --ep {args.ep}' if args.ep > 1 else ''}"
        f"{f' --out {args.out_name}' if args.out_name else ''}`",
        "",
        "| ranks | predicted peak / rank (MiB) | measured peak / rank, OS (MiB) | error | bytes / step predicted | "
        "measured (comm_stats) | equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pb = sum(r["predicted_bytes"].values())
        mb = sum(r["measured_bytes"].values())
        lines.append(
            f"| {r['world_size']} | {r['predicted_peak'] / mib:.1f} | {r['measured_peak'] / mib:.1f} | "
            f"{100 * r['peak_error']:+.1f}% | {pb:,} | {mb:,} | {'yes' if r['bytes_equal'] else 'NO'} |"
        )
    lines += ["", "Bytes per step by kind (the largest rank's):", "",
              "| ranks | kind | predicted | measured | equal |", "|---|---|---|---|---|"]
    for r in rows:
        for kind in sorted(set(r["predicted_bytes"]) | set(r["measured_bytes"])):
            p, m = r["predicted_bytes"].get(kind, 0), r["measured_bytes"].get(kind, 0)
            if p or m:
                lines.append(f"| {r['world_size']} | `{kind}` | {p:,} | {m:,} | {'yes' if p == m else 'NO'} |")
    lines += [
        "",
        "Measured peak: the kernel's high-water mark of each rank's resident set during setup and training, minus",
        "the resident set after imports, process-group and mesh setup and one step of a tiny unsharded model (VmHWM reset",
        "through /proc/self/clear_refs),",
        "with glibc returning freed blocks >= 128 KiB; the largest rank is shown. Predicted: `dry_run` with the",
        "`cpu` profile. Bytes: every collective kind `comm_stats` counted in the last step, and torch's",
        "tensor-parallel collectives counted at dispatch (`FunctionalCollectiveCounter`: `*_tp`), against the dry run.",
    ]
    return "\n".join(lines) + "\n"


def sum_params(model: str) -> int:
    return sum(p.numel() for p in build(model).parameters())


if __name__ == "__main__":
    main()

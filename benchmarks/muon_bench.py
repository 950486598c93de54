"""Distributed Muon optimizer step: bytes, time and Newton–Schulz balance, ours against FSDP2.

Run: ``python benchmarks/muon_bench.py`` (writes ``benchmarks/results/muon.{json,md}``); ``--quick`` runs a
smaller model for a smoke test. Spawns 2 and then 4 gloo ranks on CPU.

The model is a Llama-shaped stack of bias-free ``nn.Linear`` matrices per layer (wq, wk, wv, wo, w1, w2,
w3; GQA-sized wk/wv), one sharded group per layer. Every engine runs the same Muon update
(``torch.optim.Muon``'s numerics, lr 0.02, weight decay 0.1, Nesterov, 5 bf16 Newton–Schulz steps):

* ``vescale-local``: ``fully_shard(granularity=muon_granularity(model))`` keeps each matrix whole on one
  rank; ``Muon(mode="local")`` orthogonalizes it there.
* ``vescale-auto``: the same sharding, ``mode="auto"`` (may move matrices for balance per its cost model).
* ``vescale-gather``: element-granular sharding (matrices straddle ranks); ``Muon(mode="gather")`` sends
  every matrix to an LPT-chosen owner in one all-to-all and the results back in another.
* ``fsdp2-gather-everywhere``: ``torch.distributed.fsdp.fully_shard``; momentum on the local ``Shard(0)``
  rows, then ``full_tensor()`` of every update on every rank, Newton–Schulz everywhere, keep own rows.
* ``fsdp2-torch-muon``: ``torch.optim.Muon`` applied directly to FSDP2's DTensor parameters.

Bytes per rank and optimizer step are counted by wrapping ``torch.distributed`` and
``torch.distributed._functional_collectives`` (what DTensor calls) with ring-algorithm accounting, and,
for ours, also by ``lightning_vescale.comm_stats``. Correctness: for one step, every engine's updated
full parameters are compared with ``torch.optim.Muon`` on unsharded copies given the same gradients.
"""

from __future__ import annotations

import argparse
import copy
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
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"
HYPER = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
NS = dict(ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, eps=1e-7)
ENGINES = ["vescale-local", "vescale-auto", "vescale-gather", "fsdp2-gather-everywhere", "fsdp2-torch-muon"]


# -- model --------------------------------------------------------------------------------------------
class Layer(nn.Module):
    def __init__(self, dim: int, kv_dim: int, hidden: int) -> None:
        super().__init__()
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_dim, bias=False)
        self.wv = nn.Linear(dim, kv_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x_BD: torch.Tensor) -> torch.Tensor:
        # A stand-in for attention that uses every matrix; the optimizer step is what is measured.
        mix_B1 = self.wk(x_BD).mean(-1, keepdim=True) + self.wv(x_BD).mean(-1, keepdim=True)
        x_BD = x_BD + self.wo(self.wq(x_BD) * torch.sigmoid(mix_B1))
        return x_BD + self.w2(F.silu(self.w1(x_BD)) * self.w3(x_BD))


class Stack(nn.Module):
    def __init__(self, dim: int, kv_dim: int, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(dim, kv_dim, hidden) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# -- byte counting for the baselines --------------------------------------------------------------------
class ByteCounter:
    """Wraps torch.distributed / functional-collective entry points; ring accounting per call, this rank."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.bytes = 0
        self.calls: dict[str, int] = {}
        self._saved = []

    @staticmethod
    def _nbytes(t) -> int:
        t = getattr(t, "_local_tensor", t)
        return t.numel() * t.element_size()

    def _wrap(self, module, name: str, cost) -> None:
        orig = getattr(module, name, None)
        if orig is None:
            return
        counter = self

        def wrapped(*args, **kwargs):
            counter.bytes += int(cost(*args, **kwargs))
            counter.calls[name] = counter.calls.get(name, 0) + 1
            return orig(*args, **kwargs)

        self._saved.append((module, name, orig))
        setattr(module, name, wrapped)

    def __enter__(self):
        import torch.distributed._functional_collectives as funcol

        n = self.world
        nb = self._nbytes
        gather = lambda out, inp, *a, **k: (n - 1) * nb(inp)  # noqa: E731
        scatter = lambda out, inp, *a, **k: (n - 1) * nb(out)  # noqa: E731
        for name in ("all_gather_into_tensor", "all_gather_single"):
            self._wrap(dist, name, gather)
        for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
            self._wrap(dist, name, scatter)
        self._wrap(dist, "all_reduce", lambda t, *a, **k: 2 * (n - 1) * nb(t) // n)
        self._wrap(dist, "broadcast", lambda t, *a, **k: nb(t))

        def a2a_exact(out, inp, output_split_sizes=None, input_split_sizes=None, *a, **k):
            if input_split_sizes is None:
                return nb(inp) * (n - 1) // n
            rank = dist.get_rank(k.get("group"))
            item = inp.element_size()
            return (sum(input_split_sizes) - input_split_sizes[rank]) * item

        self._wrap(dist, "all_to_all_single", a2a_exact)
        self._wrap(funcol, "all_gather_single", lambda t, *a, **k: (n - 1) * nb(t))
        self._wrap(funcol, "all_gather_tensor", lambda t, *a, **k: (n - 1) * nb(t))
        self._wrap(funcol, "reduce_scatter_single", lambda t, *a, **k: (n - 1) * nb(t) // n)
        self._wrap(funcol, "reduce_scatter_tensor", lambda t, *a, **k: (n - 1) * nb(t) // n)
        self._wrap(funcol, "all_reduce", lambda t, *a, **k: 2 * (n - 1) * nb(t) // n)
        self._wrap(funcol, "all_to_all_single", lambda t, *a, **k: nb(t) * (n - 1) // n)  # even-split estimate
        return self

    def __exit__(self, *exc) -> None:
        for module, name, orig in reversed(self._saved):
            setattr(module, name, orig)
        self._saved.clear()


# -- engines ----------------------------------------------------------------------------------------------
def ns_cost_total(model: nn.Module) -> float:
    from lightning_vescale.optim import newton_schulz_cost

    return sum(newton_schulz_cost(tuple(p.shape), NS["ns_steps"]) for p in model.parameters())


def build_engine(name: str, base: nn.Module, world: int):
    """Returns (model, step_fn, full_param_fn, full_grad_fn, ns_cost_per_rank or None)."""
    import lightning_vescale as lv
    from lightning_vescale.optim import Muon, muon_granularity

    model = copy.deepcopy(base)
    if name.startswith("vescale"):
        gran = muon_granularity(model) if name in ("vescale-local", "vescale-auto") else "element"
        for layer in model.layers:
            lv.fully_shard(layer, granularity=gran)
        lv.fully_shard(model, granularity=gran)
        mode = {"vescale-local": "local", "vescale-auto": "auto", "vescale-gather": "gather"}[name]
        opt = Muon(model.named_parameters(), **HYPER, **NS, mode=mode)

        report = opt.plan_report()
        loads = report["buckets"][0]["ns_cost_per_rank"]
        # Sharded parameters and their gradients are RaggedTensors: full_tensor() gathers the whole value.
        return (model, opt.step, lambda p: p.detach().full_tensor(), lambda p: p.grad.full_tensor(), loads,
                report["modes"])

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as fsdp_fully_shard
    from torch.distributed.tensor import DTensor
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fsdp_fully_shard(layer, mesh=mesh)
    fsdp_fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    total = ns_cost_total(base)  # every rank orthogonalizes every matrix
    if name == "fsdp2-torch-muon":
        opt = torch.optim.Muon(params, **HYPER, **NS)
        return model, opt.step, lambda p: p.full_tensor(), lambda p: p.grad.full_tensor(), [total] * world, None

    state: dict = {}

    @torch.no_grad()
    def step_gather_everywhere():
        for p in params:
            g = p.grad.to_local()
            buf = state.setdefault(p, torch.zeros_like(g))
            buf.lerp_(g, 1 - HYPER["momentum"])
            update = g.lerp(buf, HYPER["momentum"])
            full_update = DTensor.from_local(update, p.device_mesh, p.placements, shape=p.shape,
                                             stride=p.stride()).full_tensor()
            ortho = _zeropower_via_newtonschulz(full_update, NS["ns_coefficients"], NS["ns_steps"], NS["eps"])
            local = p.to_local()
            rows = -(-p.shape[0] // world)
            r0 = min(dist.get_rank() * rows, p.shape[0])
            local.mul_(1 - HYPER["lr"] * HYPER["weight_decay"])
            local.add_(ortho[r0 : r0 + local.shape[0]], alpha=-_adjust_lr(HYPER["lr"], None, p.shape))

    full_param, full_grad = (lambda p: p.full_tensor()), (lambda p: p.grad.full_tensor())
    return model, step_gather_everywhere, full_param, full_grad, [total] * world, None


def check_step(model, step, full_param, full_grad) -> dict:
    """One step against torch.optim.Muon on unsharded copies with the same gradients."""
    params = list(model.parameters())
    before = [full_param(p).clone() for p in params]
    grads = [full_grad(p).clone() for p in params]
    step()
    after = [full_param(p) for p in params]
    ref = [nn.Parameter(b.clone()) for b in before]
    for r, g in zip(ref, grads):
        r.grad = g
    torch.optim.Muon(ref, **HYPER, **NS).step()
    bitwise = all(torch.equal(a, r.detach()) for a, r in zip(after, ref))
    rel = max(((a - r.detach()).norm() / (r.detach() - b).norm()).item() for a, b, r in zip(after, before, ref))
    return {"bitwise": bitwise, "max_update_rel_error": rel}


def worker(rank: int, world: int, init_file: str, cfg: dict, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import lightning_vescale as lv

    out = {}
    try:
        torch.manual_seed(0)
        base = Stack(cfg["dim"], cfg["kv_dim"], cfg["hidden"], cfg["layers"])
        for name in ENGINES:
            res: dict = {"error": None}
            try:
                model, step, full_param, full_grad, loads, modes = build_engine(name, base, world)
                res["ns_cost_per_rank"] = loads
                res["modes"] = modes

                def fwd_bwd(i):
                    torch.manual_seed(1000 * i + rank)
                    # At least `dim` tokens over the ranks: full-rank gradients, as in real training.
                    model(torch.randn(cfg["batch"], cfg["dim"])).square().mean().backward()

                fwd_bwd(0)
                res["check"] = check_step(model, step, full_param, full_grad)  # also the warm-up step
                times, sent, ours = [], [], []
                for i in range(1, cfg["steps"] + 1):
                    for p in model.parameters():
                        p.grad = None
                    fwd_bwd(i)
                    dist.barrier()
                    lv.comm_stats.step()
                    with ByteCounter(world) as counter:
                        t0 = time.perf_counter()
                        step()
                        times.append(time.perf_counter() - t0)
                    ours.append(sum(v for k, v in lv.comm_stats.step().items() if k != "setup"))
                    sent.append(counter.bytes)
                res["time_s"] = statistics.median(times)
                res["bytes"] = max(sent)
                res["bytes_comm_stats"] = max(ours) if name.startswith("vescale") else None
                res["calls_per_step"] = dict(counter.calls)  # the last measured step
            except Exception as e:  # noqa: BLE001 - reported, not hidden
                res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            out[name] = res
            dist.barrier()
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def run_world(world: int, cfg: dict) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, world, os.path.join(tmp, "pg"), cfg, queue)) for r in range(world)]
        for p in procs:
            p.start()
        results = {}
        for _ in procs:
            rank, out = queue.get()
            results[rank] = out
        for p in procs:
            p.join()
    merged = {}
    for name in ENGINES:
        per_rank = [results[r][name] for r in range(world)]
        err = next((r["error"] for r in per_rank if r["error"]), None)
        entry = {"error": err}
        if err is None:
            loads = per_rank[0]["ns_cost_per_rank"]
            mean = sum(loads) / len(loads)
            entry.update({
                "bytes_per_rank": [r["bytes"] for r in per_rank],
                "bytes_max_rank": max(r["bytes"] for r in per_rank),
                "bytes_comm_stats_max_rank": (max(r["bytes_comm_stats"] for r in per_rank)
                                              if per_rank[0]["bytes_comm_stats"] is not None else None),
                "time_s_max_rank": max(r["time_s"] for r in per_rank),
                "ns_cost_per_rank": loads,
                "ns_balance_max_over_mean": max(loads) / mean if mean else 1.0,
                "modes": per_rank[0]["modes"],
                "calls_per_step": per_rank[0]["calls_per_step"],
                "check": per_rank[0]["check"],
            })
        merged[name] = entry
    return merged


def goals(results: dict) -> dict:
    """The issue's goals, per world size: (a) local sends nothing, (b) gather <= 2/N of gather-everywhere,
    Newton-Schulz load max/mean <= 1.1 for our modes."""
    out = {}
    for world, res in results.items():
        n = int(world)
        everywhere = res["fsdp2-gather-everywhere"].get("bytes_max_rank")
        local, gather = res["vescale-local"], res["vescale-gather"]
        out[world] = {
            "local_sends_0_bytes": local.get("bytes_max_rank") == 0,
            "gather_at_most_2_over_N": (gather.get("bytes_max_rank") is not None and everywhere is not None
                                        and gather["bytes_max_rank"] <= 2 / n * everywhere),
            "gather_fraction_of_everywhere": (gather["bytes_max_rank"] / everywhere
                                              if everywhere and gather.get("bytes_max_rank") is not None else None),
            "ns_balance_local": local.get("ns_balance_max_over_mean"),
            "ns_balance_gather": gather.get("ns_balance_max_over_mean"),
            "ns_balance_at_most_1.1": all((r.get("ns_balance_max_over_mean") or 99) <= 1.1 for r in (local, gather)),
        }
    return out


def write(results: dict, cfg: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    met = goals(results)
    (RESULTS / "muon.json").write_text(json.dumps({"config": cfg, "goals": met, "results": results}, indent=2))
    lines = [
        "# Distributed Muon optimizer step (CPU, gloo)",
        "",
        f"Model: {cfg['layers']} Llama-shaped layers (dim {cfg['dim']}, kv {cfg['kv_dim']}, ffn {cfg['hidden']}), "
        f"{cfg['matrices']} matrices, {cfg['muon_numel'] / 1e6:.2f} M elements; one sharded group per layer; "
        f"{cfg['batch']} tokens per rank. Median of {cfg['steps']} optimizer steps. Bytes: sent per rank per "
        "optimizer step, max over ranks (counted by wrapping torch.distributed and functional collectives; for "
        "ours equal to `comm_stats`). NS max rank / ideal: the most Newton-Schulz work any rank does, over "
        "total/N. The last column compares one step with `torch.optim.Muon` on unsharded copies given the "
        "same gradients. Produced by `python benchmarks/muon_bench.py`.",
        "",
    ]
    for world, res in results.items():
        base = res["fsdp2-gather-everywhere"].get("bytes_max_rank") or 0
        lines += [f"## {world} ranks", "",
                  "| engine | bytes/rank/step | vs gather-everywhere | step time (s) | NS load max/mean | "
                  "NS max rank / ideal | vs torch.optim.Muon (1 step) |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for name, r in res.items():
            if r["error"]:
                lines.append(f"| {name} | error | | | | | {r['error'][:120]} |")
                continue
            share = max(r["ns_cost_per_rank"]) / (cfg["ns_cost_total"] / int(world))
            check = "bitwise" if r["check"]["bitwise"] else f"rel. err {r['check']['max_update_rel_error']:.1e}"
            ratio = f"{r['bytes_max_rank'] / base:.3f}" if base else "-"
            lines.append(f"| {name} | {r['bytes_max_rank']:,} | {ratio} | {r['time_s_max_rank']:.3f} | "
                         f"{r['ns_balance_max_over_mean']:.3f} | {share:.2f} | {check} |")
        g = met[world]
        lines += ["", f"Goals: local sends 0 bytes: {g['local_sends_0_bytes']}; gather <= 2/N of gather-everywhere: "
                  f"{g['gather_at_most_2_over_N']} ({g['gather_fraction_of_everywhere']:.3f} vs {2 / int(world):.3f}); "
                  f"NS load max/mean <= 1.1: {g['ns_balance_at_most_1.1']} (local {g['ns_balance_local']:.3f}, "
                  f"gather {g['ns_balance_gather']:.3f}).", ""]
    lines += ["## Reading", "", NOTES.strip(), ""]
    (RESULTS / "muon.md").write_text("\n".join(lines) + "\n")


NOTES = """
The local path sends nothing in the optimizer step: the planner put every matrix whole on one rank
(`muon_granularity`), so the Newton-Schulz runs where the momentum already is. The gather path moves each
rank's pieces of every matrix to its owner and the result back, in bf16 (torch's Newton-Schulz casts to
bf16 first, so this changes no bit), one all-to-all each way: about 1/N of what gathering every fp32
matrix on every rank sends, and each rank orthogonalizes ~1/N of the matrices instead of all of them.
Both are bitwise equal to `torch.optim.Muon` on the unsharded matrices. The local path's balance is the
planner's (whole matrices placed to minimize shard size, one group at a time); the gather path's is LPT's.
Times are CPU/gloo with N processes on a 2-core machine that other jobs were using at the same time
(load average 6-9): differences under ~2x are noise (local and auto take the identical path here), only
the order of magnitude means anything; on GPUs the Newton-Schulz matmuls and the collectives are both far
faster.
`torch.optim.Muon` on FSDP2's DTensor parameters runs, but each Newton-Schulz matmul redistributes
(many collectives per matrix and step), every rank computes every matrix, and tall matrices get their
Gram matrix as a bf16 `Partial` sum reduced across ranks: not bitwise; 2-4% relative update error with
the full-rank gradients here (last column), and 47% measured on a 176x64 matrix whose gradient came from a
4-token batch (rank-deficient): Newton-Schulz inflates rounding noise in the null space. The
gather-everywhere baseline is bitwise (each rank runs the exact reference computation), but sends N times
the bytes of ours and repeats all the Newton-Schulz work on every rank.
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    cfg = dict(dim=256, kv_dim=64, hidden=704, layers=4, batch=128, steps=5)
    if args.quick:
        cfg = dict(dim=64, kv_dim=16, hidden=176, layers=2, batch=32, steps=2)
    probe = Stack(cfg["dim"], cfg["kv_dim"], cfg["hidden"], cfg["layers"])
    cfg["matrices"] = sum(1 for _ in probe.parameters())
    cfg["muon_numel"] = sum(p.numel() for p in probe.parameters())
    cfg["ns_cost_total"] = ns_cost_total(probe)
    results = {}
    for world in (2, 4):
        t0 = time.perf_counter()
        results[str(world)] = run_world(world, cfg)
        print(f"{world} ranks: {time.perf_counter() - t0:.1f} s", flush=True)
        for name, r in results[str(world)].items():
            print(f"  {name}: {r.get('bytes_max_rank')} B, {r.get('time_s_max_rank')} s, balance "
                  f"{r.get('ns_balance_max_over_mean')}, check {r.get('check')}, error {r['error']}", flush=True)
    write(results, cfg)


if __name__ == "__main__":
    main()

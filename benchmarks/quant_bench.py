"""Block-quantized weights: planner padding of block-major codes, quantized AllGather, frozen-base memory.

Run: ``python benchmarks/quant_bench.py [--only padding,gather,memory,curves] [--quick]``; writes
``benchmarks/results/quant.{json,md}`` (and ``quant_loss.png`` for ``curves``). Each section merges its records
into ``quant.json``, so sections can be re-run one at a time.

Sections:

* ``padding`` (pure, no processes): the planner's padding for the codes of one transformer layer of
  DeepSeek-V3, GPT-OSS-120B and Llama-3-70B at N = 8 ... 512 with 128x128 blocks. *Block-major* codes (each tile
  contiguous) give every 2-D tensor the same granule (one tile); *row-major* codes with whole blocks on a rank
  need a granule of 128 rows of each matrix (a matrix whose rows are not a multiple of 128 cannot be cut at all
  without splitting its last block, so it stays whole), and tensors of different widths force the shard size
  to the lcm of their granules.
* ``gather``: AllGather bytes and step time of a quantized AllGather (FP8 / INT8) vs a bf16 one, 2 gloo ranks.
* ``memory``: bytes per rank of a frozen base stored block-quantized vs bf16 and fp32 sharding (measured on 2
  ranks, and from the planner at N = 8 ... 512), and the dequantize cost per step.
* ``curves``: ``recipes/train.py`` llama_tiny, 300 steps, bf16 AllGather vs FP8 AllGather (both loss curves in
  ``quant_loss.png``), and the same bf16 run under ``strategy=ddp`` as the noise floor: the same initial weights
  and data, bf16 compute through autocast instead of bf16 parameters, so it differs from the bf16 run only by
  rounding.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_vescale.engine.planner import TensorSpec, plan_buffer, shard_size_lower_bound

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = 128
WORLD_SIZES = [8, 16, 32, 64, 128, 256, 512]
GOAL_PADDING = 0.01


# -- layers (the quantizable weights of one layer; same shapes as planner_bench.py) ------------------------
def llama3_70b_layer() -> list[tuple[str, tuple]]:
    hidden, heads, kv_heads, head_dim, ffn = 8192, 64, 8, 128, 28672
    return [
        ("self_attn.q_proj.weight", (heads * head_dim, hidden)),
        ("self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
        ("self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
        ("self_attn.o_proj.weight", (hidden, heads * head_dim)),
        ("mlp.gate_proj.weight", (ffn, hidden)),
        ("mlp.up_proj.weight", (ffn, hidden)),
        ("mlp.down_proj.weight", (hidden, ffn)),
    ]


def deepseek_v3_layer(num_experts: int = 256, hidden: int = 7168, moe_ffn: int = 2048) -> list[tuple[str, tuple]]:
    params = [
        ("self_attn.q_a_proj.weight", (1536, hidden)),
        ("self_attn.q_b_proj.weight", (24576, 1536)),
        ("self_attn.kv_a_proj_with_mqa.weight", (576, hidden)),
        ("self_attn.kv_b_proj.weight", (32768, 512)),
        ("self_attn.o_proj.weight", (hidden, 16384)),
        ("mlp.gate.weight", (num_experts, hidden)),
    ]
    for e in range(num_experts):
        params += [
            (f"mlp.experts.{e}.gate_proj.weight", (moe_ffn, hidden)),
            (f"mlp.experts.{e}.up_proj.weight", (moe_ffn, hidden)),
            (f"mlp.experts.{e}.down_proj.weight", (hidden, moe_ffn)),
        ]
    params += [
        ("mlp.shared_experts.gate_proj.weight", (moe_ffn, hidden)),
        ("mlp.shared_experts.up_proj.weight", (moe_ffn, hidden)),
        ("mlp.shared_experts.down_proj.weight", (hidden, moe_ffn)),
    ]
    return params


def gpt_oss_120b_layer(num_experts: int = 128, hidden: int = 2880, heads: int = 64, kv_heads: int = 8,
                       head_dim: int = 64, expert_ffn: int = 2880) -> list[tuple[str, tuple]]:
    return [
        ("self_attn.q_proj.weight", (heads * head_dim, hidden)),
        ("self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
        ("self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
        ("self_attn.o_proj.weight", (hidden, heads * head_dim)),
        ("mlp.router.weight", (num_experts, hidden)),
        ("mlp.experts.gate_up_proj", (num_experts, hidden, 2 * expert_ffn)),
        ("mlp.experts.down_proj", (num_experts, expert_ffn, hidden)),
    ]


LAYERS = {
    "deepseek-v3": deepseek_v3_layer,
    "gpt-oss-120b": gpt_oss_120b_layer,
    "llama3-70b": llama3_70b_layer,
}


# -- padding ------------------------------------------------------------------------------------------------
def tiles_of(shape: tuple) -> int:
    *lead, rows, cols = shape
    return math.prod(lead) * -(-rows // BLOCK) * -(-cols // BLOCK)


def block_major_specs(params: list[tuple[str, tuple]]) -> list[TensorSpec]:
    """One spec per weight in units of tiles: every tensor has granule 1 (one tile of BLOCK x BLOCK codes)."""
    return [TensorSpec(name, (tiles_of(shape),), 1) for name, shape in params]


def row_major_specs(params: list[tuple[str, tuple]]) -> list[TensorSpec]:
    """Codes in the weight's row-major layout with whole blocks per rank: 128 rows of each matrix, or the whole
    matrix when its rows are not a multiple of 128 (a cut elsewhere would split its last block)."""
    specs = []
    for name, shape in params:
        rows, cols = shape[-2:]
        granule = BLOCK * cols if rows % BLOCK == 0 else rows * cols
        specs.append(TensorSpec(name, shape, granule))
    return specs


def padding_records(world_sizes: list[int]) -> list[dict]:
    records = []
    for model, layer in LAYERS.items():
        params = layer()
        numel = sum(math.prod(s) for _, s in params)
        blocks = block_major_specs(params)
        rows = row_major_specs(params)
        tiles = sum(s.numel for s in blocks)
        for n in world_sizes:
            bm = plan_buffer(blocks, n)
            rm = plan_buffer(rows, n)
            rec = {
                "model": model, "world_size": n, "num_tensors": len(params), "numel": numel,
                "block_size": BLOCK, "tiles": tiles,
                "tile_padding_ratio": (tiles * BLOCK * BLOCK - numel) / numel,
                "block_major_padding_ratio": bm.padding_ratio,
                "block_major_lower_bound_ratio": (n * shard_size_lower_bound(blocks, n) - tiles) / tiles,
                "row_major_padding_ratio": rm.padding_ratio,
                "row_major_lower_bound_ratio": (n * shard_size_lower_bound(rows, n) - numel) / numel,
            }
            records.append(rec)
            print(f"padding {model:13s} N={n:4d} block-major {rec['block_major_padding_ratio']:8.4%} "
                  f"row-major(128 rows) {rec['row_major_padding_ratio']:8.4%} tiles {rec['tile_padding_ratio']:.3%}",
                  flush=True)
    return records


def pct(x: float) -> str:
    if x == 0:
        return "0"
    return f"{x:.3%}" if x < 0.01 else f"{x:.2%}" if x < 10 else f"{x:.0%}"


def padding_markdown(records: list[dict]) -> list[str]:
    worst = max(records, key=lambda r: r["block_major_padding_ratio"])
    met = worst["block_major_padding_ratio"] <= GOAL_PADDING
    worst_rm = max(records, key=lambda r: r["row_major_padding_ratio"])
    out = [
        "## Planner padding of quantized codes (128x128 blocks)", "",
        ("Padding = (N*S - total) / total of one layer's codes as one group (`plan_buffer`, the public API). "
        "*Block-major*: each 128x128 tile contiguous, one tile is every tensor's granule (planned in units of tiles). "
        "*Row-major 128 rows*: the codes in the weight's own layout, cut only between 128-row bands of each "
        "matrix (a matrix with rows not a multiple of 128 stays whole). `lb` = padding at "
        "`shard_size_lower_bound`. *Tiles* = the storage added by padding edge tiles to 128x128 (block-major "
        "only; DeepSeek's 576-row `kv_a_proj_with_mqa` and GPT-OSS's 2880-row experts), the same at every N."), "",
        (f"* Block-major (goal <= 1% for N <= 512): **{'met' if met else 'NOT met'}**, worst "
        f"{pct(worst['block_major_padding_ratio'])} ({worst['model']}, N={worst['world_size']})."),
        (f"* Row-major 128-row bands, for comparison: worst {pct(worst_rm['row_major_padding_ratio'])} "
        f"({worst_rm['model']}, N={worst_rm['world_size']})."), "",
        "| model | N | block-major | (lb) | row-major 128 rows | (lb) | tiles |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        out.append(
            f"| {r['model']} | {r['world_size']} | {pct(r['block_major_padding_ratio'])} | "
            f"{pct(r['block_major_lower_bound_ratio'])} | {pct(r['row_major_padding_ratio'])} | "
            f"{pct(r['row_major_lower_bound_ratio'])} | {pct(r['tile_padding_ratio'])} |"
        )
    return out + [""]


# -- processes ----------------------------------------------------------------------------------------------
def _worker(rank: int, world: int, init_file: str, fn_name: str, args: tuple, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = globals()[fn_name](rank, world, *args)
        if rank == 0:
            Path(out_dir, "result.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_ranks(fn_name: str, world: int, *args) -> dict:
    """Run ``fn_name(rank, world, *args)`` on ``world`` gloo ranks; returns rank 0's JSON result."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "pg"), fn_name, args, tmp), nprocs=world, join=True)
        return json.loads(Path(tmp, "result.json").read_text())


def bench_config():
    from lightning_vescale.models import LlamaConfig

    # Llama-shaped, every dim a multiple of 128 (no edge tiles), small enough for 2 ranks on 2 shared cores.
    return LlamaConfig(vocab_size=4096, dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=1536, max_seq_len=128)


def _batch(step: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (4, 129), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


# -- gather: quantized AllGather of trained weights vs bf16 ------------------------------------------------
def _gather_worker(rank: int, world: int, steps: int, warmup: int) -> dict:
    import statistics
    import time

    import torch
    import torch.nn.functional as F

    import lightning_vescale as lv
    from lightning_vescale.models import Llama
    from lightning_vescale.quant import BlockFormat, quantize_all_gather

    config = bench_config()
    mp_policy = lv.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    engines = {}
    for name, kind in (("bf16", None), ("fp8_e4m3/128", "fp8_e4m3"), ("int8/128", "int8")):
        torch.manual_seed(0)
        model = Llama(config)
        if kind:
            quantize_all_gather(model, BlockFormat(kind, BLOCK))
        for block in model.layers:
            lv.fully_shard(block, mp_policy=mp_policy)
        lv.fully_shard(model, mp_policy=mp_policy)
        engines[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    times = {n: [] for n in engines}
    comm = {n: {} for n in engines}
    for step in range(warmup + steps):
        for name, (model, opt) in engines.items():  # interleaved: background load hits all alike
            x, y = _batch(step, config.vocab_size)
            lv.comm_stats.step()
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            dt = time.perf_counter() - t0
            by_kind = lv.comm_stats.step()
            if step >= warmup:
                times[name].append(dt)
                for k, v in by_kind.items():
                    comm[name][k] = comm[name].get(k, 0) + v / steps
    out = []
    for name in engines:
        gather = sum(v for k, v in comm[name].items() if k.startswith("all_gather"))
        out.append({"engine": name, "step_time_s": statistics.median(times[name]), "all_gather_bytes": gather,
                    "reduce_scatter_bytes": comm[name].get("reduce_scatter", 0), "by_kind": comm[name]})
    base = out[0]["all_gather_bytes"]
    for r in out:
        r["all_gather_ratio"] = r["all_gather_bytes"] / base
        r["step_time_ratio"] = r["step_time_s"] / out[0]["step_time_s"]
    return {"records": out, "world_size": world, "steps": steps, "model": repr(config)}


def gather_records(quick: bool = False) -> dict:
    return run_ranks("_gather_worker", 2, 2 if quick else 8, 1 if quick else 2)


def gather_markdown(result: dict) -> list[str]:
    out = ["## Quantized AllGather of trained weights vs a bf16 AllGather", "",
           f"Measured by `python benchmarks/quant_bench.py --only gather`: {result['world_size']} gloo ranks, a "
           f"Llama-shaped model (`{result['model']}`), bf16 compute (`param_dtype=bf16`, fp32 ReduceScatter), AdamW, "
           f"batch 4 x 128 tokens per rank; bytes are this rank's per step (`comm_stats`, ring formula: forward and "
           f"backward gathers of every group); time = median of {result['steps']} steps, the three engines' steps "
           "interleaved. On CPU the quantize/dequantize work is not hidden behind compute, and gloo's cost is not "
           "proportional to bytes as NCCL's is: read the time column as an upper bound of the overhead.", "",
           "| AllGather | bytes / step | vs bf16 | ReduceScatter bytes | step time (s) | vs bf16 |",
           "|---|---:|---:|---:|---:|---:|"]
    for r in result["records"]:
        out.append(f"| {r['engine']} | {r['all_gather_bytes'] / 2**20:.2f} MiB | {r['all_gather_ratio']:.3f}x | "
                   f"{r['reduce_scatter_bytes'] / 2**20:.2f} MiB | {r['step_time_s']:.3f} | {r['step_time_ratio']:.2f}x |")
    worst = max(r["all_gather_ratio"] for r in result["records"][1:])
    out += ["", f"Goal AllGather bytes <= 0.52x of bf16: **{'met' if worst <= 0.52 else 'NOT met'}** (worst "
            f"{worst:.3f}x; the rest above 0.5x is the scales, 4 bytes per 128x128 block, and the 1-D norms, which "
            "stay bf16).", ""]
    return out


# -- memory and dequantize cost of a frozen quantized base -------------------------------------------------
def _memory_worker(rank: int, world: int, steps: int) -> dict:
    import statistics
    import time

    import torch
    import torch.nn.functional as F

    import lightning_vescale as lv
    from lightning_vescale.engine.fully_shard import sharded_groups
    from lightning_vescale.models import Llama
    from lightning_vescale.quant import BlockFormat, QuantizedTensor, _storage, quantize_frozen_weights
    from lightning_vescale.quant.lora import LoRAConfig, apply_lora

    spent = {"s": 0.0}
    original = _storage.dequantize_block_major

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent["s"] += time.perf_counter() - t0

    _storage.dequantize_block_major = timed
    config = bench_config()
    exclude = ("tok_embeddings.*", "output.*")
    out = []
    for name in ("fp32", "bf16", "fp8_e4m3/128", "int8/128"):
        torch.manual_seed(0)
        model = Llama(config)
        apply_lora(model, LoRAConfig(rank=16, alpha=32.0))
        base_names = [n for n, p in model.named_parameters() if p.dim() == 2 and not p.requires_grad
                      and not any(n.startswith(e[:-2]) for e in exclude)]
        if name == "bf16":
            for n in base_names:
                model.get_parameter(n).data = model.get_parameter(n).data.to(torch.bfloat16)
        elif name != "fp32":
            quantize_frozen_weights(model, BlockFormat(name.split("/")[0], BLOCK), exclude=exclude)
        mp_policy = lv.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            lv.fully_shard(block, mp_policy=mp_policy)
        lv.fully_shard(model, mp_policy=mp_policy)
        numel = sum(p.numel() for block in model.layers for p in block.parameters() if not p.requires_grad)
        per_rank = 0  # every frozen buffer of the transformer blocks: the Linear weights and the (fp32) norms
        for block in model.layers:
            for group in sharded_groups(block):
                for buf in group.buffers.values():
                    if isinstance(buf, _storage.QuantizedStorage):
                        per_rank += buf.local_nbytes()
                    elif not buf.requires_grad:
                        per_rank += buf.local.numel() * buf.local.element_size()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        times, deq = [], []
        for step in range(steps + 1):
            x, y = _batch(step, config.vocab_size)
            spent["s"] = 0.0
            t0 = time.perf_counter()
            F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).backward()
            opt.step()
            opt.zero_grad()
            if step:
                times.append(time.perf_counter() - t0)
                deq.append(spent["s"])
        quantized = any(isinstance(p, QuantizedTensor) for p in model.parameters())
        out.append({"storage": name, "base_numel": numel, "base_bytes_per_rank": per_rank,
                    "step_time_s": statistics.median(times),
                    "dequantize_s_per_step": statistics.median(deq) if quantized else 0.0})
    for r in out:
        r["vs_bf16"] = r["base_bytes_per_rank"] / out[1]["base_bytes_per_rank"]
        r["vs_fp32"] = r["base_bytes_per_rank"] / out[0]["base_bytes_per_rank"]
    return {"records": out, "world_size": world, "steps": steps, "model": repr(config)}


def analytic_memory(world_sizes=(8, 64, 512)) -> list[dict]:
    """Per-rank bytes of one layer's frozen weights at scale, from the planner (no processes)."""
    rows = []
    for model, layer in LAYERS.items():
        params = layer()
        elems = [TensorSpec(n, (math.prod(s),), 1) for n, s in params]
        tiles = block_major_specs(params)
        for n in world_sizes:
            s_elem = plan_buffer(elems, n, alignment=8).shard_size
            s_tiles = plan_buffer(tiles, n).shard_size
            fp8 = s_tiles * (BLOCK * BLOCK + 4)
            rows.append({"model": model, "world_size": n, "fp32": 4 * s_elem, "bf16": 2 * s_elem, "block": fp8,
                         "vs_bf16": fp8 / (2 * s_elem)})
    return rows


def memory_records(quick: bool = False) -> dict:
    result = run_ranks("_memory_worker", 2, 2 if quick else 6)
    result["analytic"] = analytic_memory()
    return result


def memory_markdown(result: dict) -> list[str]:
    out = ["## Frozen base: memory per rank and dequantize cost", "",
           f"Measured by `python benchmarks/quant_bench.py --only memory`: {result['world_size']} gloo ranks, the model "
           f"of the gather section with LoRA (rank 16) on every attention and MLP Linear; the frozen base = those "
           f"Linears' weights (embeddings and head excluded), stored sharded in fp32, bf16, or block-quantized "
           f"(codes + one fp32 scale per 128x128 tile). Bytes = this rank's persistent storage of the base. Step = "
           f"forward + backward + AdamW on the adapters with bf16 compute; dequantize = time inside the frozen "
           f"groups' dequantization (forward and backward gathers), median of {result['steps']} steps.", "",
           "| base stored as | bytes per rank | vs bf16 | vs fp32 | step (s) | dequantize (s / step) | share |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["records"]:
        share = r["dequantize_s_per_step"] / r["step_time_s"]
        out.append(f"| {r['storage']} | {r['base_bytes_per_rank'] / 2**20:.2f} MiB | {r['vs_bf16']:.3f}x | "
                   f"{r['vs_fp32']:.3f}x | {r['step_time_s']:.3f} | {r['dequantize_s_per_step']:.4f} | {share:.1%} |")
    worst = max(r["vs_bf16"] for r in result["records"][2:])
    out += ["", f"Goal <= 0.55x of bf16 sharding: **{'met' if worst <= 0.55 else 'NOT met'}** (worst {worst:.3f}x).",
            "", "At scale (one layer's weights as one group, planner arithmetic, no processes): bytes per rank.", "",
            "| model | N | fp32 | bf16 | block-quantized | vs bf16 |", "|---|---:|---:|---:|---:|---:|"]
    for r in result["analytic"]:
        out.append(f"| {r['model']} | {r['world_size']} | {r['fp32'] / 2**20:.1f} MiB | {r['bf16'] / 2**20:.1f} MiB | "
                   f"{r['block'] / 2**20:.1f} MiB | {r['vs_bf16']:.3f}x |")
    return out + [""]


# -- curves: llama_tiny 300 steps, bf16 gather vs FP8 gather ----------------------------------------------
CURVE_SEEDS = (1234, 1, 2, 3, 4)  # 1234 is the recipes' default seed; the others show how much one run's gap varies


def _recipe_run(tmp: str, name: str, steps: int, seed: int, extra: list[str]) -> dict:
    import csv
    import subprocess

    root = Path(__file__).resolve().parents[1]
    run = Path(tmp) / name
    overrides = ["model=llama_tiny", "precision=bf16_mixed", f"trainer.max_steps={steps}", f"seed={seed}", *extra]
    cmd = [sys.executable, str(root / "recipes" / "train.py"), *overrides, "trainer.enable_progress_bar=false",
           "trainer.checkpoint_every_n_steps=0", f"output_root={tmp}", f"hydra.run.dir={run}"]
    subprocess.run(cmd, cwd=root, check=True, capture_output=True, text=True,
                   env=dict(os.environ, PYTHONPATH=str(root), PYTHONWARNINGS="ignore"))
    summary = json.loads((run / "summary.json").read_text())
    with open(run / "csv" / "metrics.csv") as f:
        losses = {int(float(r["step"])): float(r["loss"]) for r in csv.DictReader(f) if r.get("loss")}
    gather = sum(v for k, v in (summary["comm_bytes_per_step_by_kind"] or {}).items() if k.startswith("all_gather"))
    return {"command": "python recipes/train.py " + " ".join(overrides), "seed": seed,
            "final_loss": summary["final_loss"], "final_loss_mean_last_10": summary["final_loss_mean_last_10"],
            "val_loss": summary["val_loss"], "all_gather_bytes_per_step": gather,
            "step_time_s": summary["step_time_s"], "losses": sorted(losses.items())}


def _gap(a: dict, b: dict, key: str = "final_loss_mean_last_10") -> float:
    """``(b - a) / a`` of a summary figure."""
    return (b[key] - a[key]) / a[key]


def weight_error_records() -> list[dict]:
    """Relative error ``||deq(q(W)) - W|| / ||W||`` of each quantized llama_tiny weight, next to the bf16 cast.

    What the quantized AllGather hands forward (the gather is bitwise single-process band quantization of the fp32
    master, see tests/distributed/test_quant_gather.py), on the initial weights (``torch.manual_seed(1234)``).
    """
    import torch

    from lightning_vescale.models import Llama
    from lightning_vescale.models.llama import LLAMA_CONFIGS
    from lightning_vescale.quant import BlockFormat
    from lightning_vescale.quant.blocks import dequantize_band_piece, quantize_band_piece

    def rel(w: torch.Tensor, fmt: BlockFormat | None) -> float:
        flat = w.reshape(-1)
        if fmt is None:
            back = flat.to(torch.bfloat16)
        else:
            codes, scales = quantize_band_piece(flat, tuple(w.shape), 0, flat.numel(), fmt)
            back = dequantize_band_piece(codes, scales, tuple(w.shape), 0, flat.numel(), fmt, torch.bfloat16)
        return float((back.float() - flat).norm() / flat.norm())

    torch.manual_seed(1234)
    model = Llama(LLAMA_CONFIGS["tiny"])
    fmts = {"fp8_e4m3/128": BlockFormat("fp8_e4m3", 128), "fp8_e4m3/64": BlockFormat("fp8_e4m3", 64),
            "int8/128": BlockFormat("int8", 128), "int8/64": BlockFormat("int8", 64)}
    rows = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and name.startswith("layers."):
                rows.append({"name": name, "shape": list(p.shape), "bf16": rel(p, None),
                             **{k: rel(p, f) for k, f in fmts.items()}})
    return rows


def curves_records(quick: bool = False) -> dict:
    import tempfile

    steps = 20 if quick else 300
    seeds = CURVE_SEEDS[:1] if quick else CURVE_SEEDS
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            a = _recipe_run(tmp, f"bf16_{seed}", steps, seed, [])
            b = _recipe_run(tmp, f"fp8_{seed}", steps, seed, ["quant=fp8_gather"])
            # The noise floor: the same bf16 run by another engine (same initial weights and data, other rounding).
            c = _recipe_run(tmp, f"ddp_{seed}", steps, seed, ["strategy=ddp"])
            pairs.append({"seed": seed, "bf16": a, "fp8_gather": b, "bf16_ddp": c,
                          "final_loss_rel_diff": _gap(a, b), "val_loss_rel_diff": _gap(a, b, "val_loss"),
                          "noise_final_loss_rel_diff": _gap(a, c), "noise_val_loss_rel_diff": _gap(a, c, "val_loss"),
                          "all_gather_ratio": b["all_gather_bytes_per_step"] / a["all_gather_bytes_per_step"]})
    mean = lambda key: sum(p[key] for p in pairs) / len(pairs)  # noqa: E731
    result = {"steps": steps, "pairs": pairs, "weight_error": weight_error_records(),
              "mean_final_loss_rel_diff": mean("final_loss_rel_diff"),
              "mean_val_loss_rel_diff": mean("val_loss_rel_diff"),
              "mean_noise_final_loss_rel_diff": mean("noise_final_loss_rel_diff")}
    if not quick:
        plot_curves(result)
    return result


def plot_curves(result: dict) -> None:
    """``quant_loss.png``: the loss curves of every seed, and each run's loss relative to bf16's at each step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs, steps = result["pairs"], result["steps"]
    fig, (ax, rel) = plt.subplots(2, 1, figsize=(7, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    runs = (("bf16", "bf16 AllGather", "tab:blue", "-"), ("fp8_gather", "FP8 e4m3 block AllGather", "tab:orange", "-"),
            ("bf16_ddp", "bf16, DDP (noise floor)", "tab:gray", "--"))
    for i, pair in enumerate(pairs):
        base = dict(pair["bf16"]["losses"])
        for name, label, color, style in runs:
            xs, ys = zip(*pair[name]["losses"])
            kw = dict(color=color, linestyle=style, linewidth=1 if i == 0 else 0.6, alpha=1 if i == 0 else 0.35)
            ax.plot(xs, ys, label=f"{label} (seed {pair['seed']})" if i == 0 else None, **kw)
            if name != "bf16":
                rel.plot(xs, [100 * (y - base[x]) / base[x] for x, y in zip(xs, ys)], **kw)
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.set_title(f"llama_tiny, 2 ranks, bf16-mixed, {steps} steps "
                 f"(faint: seeds {', '.join(str(p['seed']) for p in pairs[1:])})")
    ax.legend()
    rel.axhline(0, color="black", linewidth=0.5)
    for y in (-2, 2):
        rel.axhline(y, color="tab:red", linewidth=0.5, linestyle=":")
    rel.set_ylabel("vs bf16 at the same step (%)")
    rel.set_xlabel("optimizer step")
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(RESULTS / "quant_loss.png", dpi=120)


def curves_markdown(result: dict) -> list[str]:
    first = result["pairs"][0]
    out = ["## llama_tiny: FP8 AllGather vs bf16 AllGather over the same run", "",
           f"Measured by `python benchmarks/quant_bench.py --only curves`: `{first['bf16']['command']}` and the same "
           f"with `quant=fp8_gather` (2 CPU ranks, {result['steps']} steps, the same seed and data for both), for "
           f"{len(result['pairs'])} seeds. Curves: `benchmarks/results/quant_loss.png`. Final loss = the recipe "
           "summary's mean of the last 10 training losses; gap = (FP8 - bf16) / bf16. The recipe's `quant.exclude` "
           "keeps the embedding and the head in bf16 on the wire: they are 44% of llama_tiny's weights, hence the "
           "bytes ratio above 0.5 here (0.500x on the gather section's model, where everything 2-D is quantized).", "",
           "*Noise floor*: the same bf16 run with `strategy=ddp` (the same initial weights and data; bf16 compute "
           "through autocast instead of bf16 parameters, so it differs from the bf16 run only by rounding); noise = "
           "(DDP - bf16) / bf16. A gap the noise floor also reaches says nothing about FP8.", "",
           "| seed | bf16 final | FP8 final | gap | DDP bf16 final | noise | bf16 val | FP8 val | val gap | "
           "AllGather bytes / step (bf16 -> FP8) |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in result["pairs"]:
        a, b, c = p["bf16"], p["fp8_gather"], p["bf16_ddp"]
        out.append(f"| {p['seed']} | {a['final_loss_mean_last_10']:.4f} | {b['final_loss_mean_last_10']:.4f} | "
                   f"{p['final_loss_rel_diff']:+.2%} | {c['final_loss_mean_last_10']:.4f} | "
                   f"{p['noise_final_loss_rel_diff']:+.2%} | {a['val_loss']:.4f} | {b['val_loss']:.4f} | "
                   f"{p['val_loss_rel_diff']:+.2%} | "
                   f"{a['all_gather_bytes_per_step'] / 2**10:.1f} -> {b['all_gather_bytes_per_step'] / 2**10:.1f} KiB "
                   f"({p['all_gather_ratio']:.3f}x) |")
    worst = max(abs(p["final_loss_rel_diff"]) for p in result["pairs"])
    worst_noise = max(abs(p["noise_final_loss_rel_diff"]) for p in result["pairs"])
    out += ["", f"Goal final loss within 2% of bf16: default seed {first['seed']}: "
            f"**{'met' if abs(first['final_loss_rel_diff']) <= 0.02 else 'NOT met'}** ({first['final_loss_rel_diff']:+.2%}); "
            f"mean over the seeds {result['mean_final_loss_rel_diff']:+.2%}, worst {worst:.2%} "
            f"(validation loss: mean {result['mean_val_loss_rel_diff']:+.2%}). Noise floor (bf16 DDP vs bf16): mean "
            f"{result['mean_noise_final_loss_rel_diff']:+.2%}, worst {worst_noise:.2%}.", ""]
    rows = result.get("weight_error") or []
    if rows:
        kinds = [k for k in rows[0] if k not in ("name", "shape")]
        out += ["What FP8 hands forward, per weight: relative error `||deq(q(W)) - W|| / ||W||` of the quantized "
                "llama_tiny weights (initial weights; the gathered weights are bitwise this band quantization of the "
                "fp32 master), next to the bf16 cast a bf16 AllGather makes. e4m3 keeps 3 mantissa bits: its "
                "relative rounding error does not depend on the block scale as long as no value falls to a "
                "subnormal code, so 64x64 blocks give the same error as 128x128; INT8's uniform grid does depend on "
                "it.", "",
                "| weight | shape | " + " | ".join(kinds) + " |", "|---|---|" + "---:|" * len(kinds)]
        for r in rows:
            if r["name"].startswith("layers.0."):
                out.append(f"| {r['name']} | {tuple(r['shape'])} | " + " | ".join(f"{r[k]:.2%}" for k in kinds) + " |")
        out.append("| mean of all " + str(len(rows)) + " | | " + " | ".join(
            f"{sum(r[k] for r in rows) / len(rows):.2%}" for k in kinds) + " |")
        out.append("")
    return out


# -- driver -------------------------------------------------------------------------------------------------
SECTIONS = {
    "padding": (padding_records, padding_markdown),
    "gather": (gather_records, gather_markdown),
    "memory": (memory_records, memory_markdown),
    "curves": (curves_records, curves_markdown),
}


def load_results() -> dict:
    path = RESULTS / "quant.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def write_results(results: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "quant.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = ["# Block-quantized weights", "",
             (f"Generated by `python benchmarks/quant_bench.py` on {os.cpu_count()} CPU cores (shared); see each "
             "section for what was measured and how."), ""]
    for name, (_, markdown) in SECTIONS.items():
        if name in results:
            lines += markdown(results[name])
    (RESULTS / "quant.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections to run")
    parser.add_argument("--quick", action="store_true", help="fewer cases, no files written")
    args = parser.parse_args()
    results = load_results()
    for name in args.only.split(","):
        if name not in SECTIONS:
            raise SystemExit(f"unknown section {name!r}; choose from {', '.join(SECTIONS)}")
        run, _ = SECTIONS[name]
        if name == "padding":
            results[name] = run([8, 512] if args.quick else WORLD_SIZES)
        else:
            results[name] = run(quick=args.quick)
        if args.quick:
            print("\n".join(SECTIONS[name][1](results[name])))
    if not args.quick:
        write_results(results)
        print(f"wrote {RESULTS / 'quant.json'} and {RESULTS / 'quant.md'}")


if __name__ == "__main__":
    main()

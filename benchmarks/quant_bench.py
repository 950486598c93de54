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
* ``gather``, ``memory``, ``curves``: measured on gloo ranks (see their functions).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_vescale.planner import TensorSpec, plan_buffer, shard_size_lower_bound

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


# -- driver -------------------------------------------------------------------------------------------------
SECTIONS = {"padding": (padding_records, padding_markdown)}


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
        results[name] = run([8, 512]) if (args.quick and name == "padding") else run(WORLD_SIZES) \
            if name == "padding" else run(quick=args.quick)
    if not args.quick:
        write_results(results)
        print(f"wrote {RESULTS / 'quant.json'} and {RESULTS / 'quant.md'}")


if __name__ == "__main__":
    main()

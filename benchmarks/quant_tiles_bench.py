"""Quantized AllGather of trained weights on whole 128x128 tiles: the padding the block granularity costs on real layers.

Run: ``python benchmarks/quant_tiles_bench.py [--world-sizes 8,16,...]``; writes ``benchmarks/results/quant_tiles.{json,md}``.
Pure (no processes): the engine's own :func:`~lightning_vescale.engine.group_plan.plan_group_buffers` with the engine's
buffer kind (:class:`~lightning_vescale.quant._kinds.QuantizedGatherKind`) on one transformer layer of DeepSeek-V3,
GPT-OSS-120B and Llama-3-70B as one group (fp32 master, bf16 ``param_dtype``, the routers left unquantized as
``quant.exclude`` does), at N = 8 ... 1024. Per layer and N:

* *default*: the padding of the fp32 master buffer (the codes mirror it byte for byte) with the default layout
  ``quantize_all_gather(..., layout="auto")``, which takes per group the one of the next two that pads less, and
  *lb*, the padding at the planner's lower bound for its granules (``shard_size_lower_bound``: what no order
  avoids); *tiles*: how many of the layer's quantized weights it keeps tile-major;
* *block-major*: ``layout="block_major"``: every weight's master tile-major, cut between any two 128x128 tiles
  (weights whose edge tiles the tile order cannot serve would keep 128-row bands; none here), and its lower bound;
* *128-row bands*: the padding with ``layout="bands"`` (the layout before: every cut between 128-row bands of a
  matrix, the last band holding the rows that remain) and its lower bound;
* *bf16*: the padding of a bf16 AllGather of the same weights at element granularity;
* *bytes vs bf16* (default; *block-major*, *bands*: in those layouts): what one quantized unshard gathers (one byte per element and padding, four per scale, the
  largest rank's scale count on every rank) over what the bf16 unshard gathers (two bytes per element and padding);
* *flag*: ``!`` where the padding exceeds the plan table's warning threshold (``BLOCK_PADDING_WARNING``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from quant_bench import LAYERS  # noqa: E402

from lightning_vescale.engine.group_plan import ParamEntry, plan_group_buffers  # noqa: E402
from lightning_vescale.engine.planner import TensorSpec, plan_buffer, shard_size_lower_bound  # noqa: E402
from lightning_vescale.engine.policies import MixedPrecisionPolicy  # noqa: E402
from lightning_vescale.plan._layout import BLOCK_PADDING_WARNING, quantized_gather_scales_per_rank  # noqa: E402
from lightning_vescale.quant._kinds import QuantizedGatherKind, is_tile_major  # noqa: E402
from lightning_vescale.quant.formats import BlockFormat  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
WORLD_SIZES = [8, 16, 32, 64, 128, 256, 512, 1024]
FMT = BlockFormat("fp8_e4m3", 128)
MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
ROUTERS = ("mlp.gate.weight", "mlp.router.weight")


def quantized_params(model: str) -> list[tuple[str, tuple]]:
    return [(n, s) for n, s in LAYERS[model]() if n not in ROUTERS]


def _quantized(params: list[tuple[str, tuple]], N: int, layout: str) -> tuple[dict, float]:
    kind = QuantizedGatherKind(FMT, layout)
    t0 = time.perf_counter()
    (quant,) = plan_group_buffers([ParamEntry(n, s, torch.float32, True, "element", kind) for n, s in params], N, MP)
    plan_s = time.perf_counter() - t0
    plan, numel = quant.plan, sum(math.prod(s) for _, s in params)
    lb = shard_size_lower_bound(plan.specs, N, alignment=plan.alignment)
    scales = quantized_gather_scales_per_rank(plan, FMT, layout)
    return {"padding": plan.padding_ratio, "lower_bound": (N * lb - numel) / numel, "scales_per_rank": scales,
            "gathered_bytes": N * (plan.shard_size + 4 * scales),
            "tile_major": sum(is_tile_major(s, FMT, layout) for s in plan.specs)}, plan_s


def record(model: str, N: int) -> dict:
    params = quantized_params(model)
    numel = sum(math.prod(s) for _, s in params)
    auto, plan_s = _quantized(params, N, "auto")
    tiles, _ = _quantized(params, N, "block_major")
    bands, _ = _quantized(params, N, "bands")
    (bf16,) = plan_group_buffers([ParamEntry(n, s, torch.float32, True, "element") for n, s in params], N, MP)
    # The layout of two sessions ago: uniform granules of gcd(rows, 128) rows of each matrix (another format).
    old_specs = [TensorSpec(n, s, math.gcd(s[-2], 128) * s[-1]) for n, s in params]
    old = plan_buffer(old_specs, N, alignment=16 // 2)
    bf16_bytes = N * bf16.plan.shard_size * 2
    rec = {
        "model": model, "world_size": N, "tensors": len(params), "numel": numel,
        "padding": auto["padding"], "lower_bound": auto["lower_bound"], "tile_major": auto["tile_major"],
        "block_major_padding": tiles["padding"], "block_major_lower_bound": tiles["lower_bound"],
        "bands_padding": bands["padding"], "bands_lower_bound": bands["lower_bound"],
        "gcd_bands_padding": old.padding_ratio, "bf16_padding": bf16.plan.padding_ratio,
        "scales_per_rank": auto["scales_per_rank"], "bytes_vs_bf16": auto["gathered_bytes"] / bf16_bytes,
        "block_major_bytes_vs_bf16": tiles["gathered_bytes"] / bf16_bytes,
        "bands_bytes_vs_bf16": bands["gathered_bytes"] / bf16_bytes,
        "flagged": auto["padding"] > BLOCK_PADDING_WARNING, "plan_seconds": plan_s,
        "odd_rows": sorted({s[-2] for _, s in params if s[-2] % 128}),
    }
    print(f"{model:13s} N={N:5d} default {rec['padding']:9.4%} (lb {rec['lower_bound']:9.4%}) tiles {rec['tile_major']} "
          f"block-major {rec['block_major_padding']:9.4%} "
          f"bands {rec['bands_padding']:9.4%} bf16 {rec['bf16_padding']:7.4%} bytes {rec['bytes_vs_bf16']:.4f}x "
          f"(bands {rec['bands_bytes_vs_bf16']:.4f}x) plan {plan_s:.2f}s", flush=True)
    return rec


def pct(x: float) -> str:
    if x == 0:
        return "0"
    return f"{x:.3%}" if x < 0.01 else f"{x:.2%}" if x < 10 else f"{x:.0%}"


def markdown(records: list[dict], command: str) -> str:
    ok = [r for r in records if r["bytes_vs_bf16"] <= 0.52]
    out = [
        "# Quantized AllGather on whole 128x128 tiles: padding on real layers", "",
        f"`{command}` (pure: the engine's `plan_group_buffers` with its `QuantizedGatherKind`; see the script's "
        "docstring for every column). One transformer layer as one group, fp8_e4m3 with 128x128 blocks, fp32 master, "
        "bf16 compute; routers unquantized (not counted). The gathered weights are bitwise DeepSeek's whole-matrix "
        "128x128 quantize-dequantize at every N, in every layout (`tests/distributed/test_quant_tiles.py`).", "",
        f"* Bytes <= 0.52x of bf16 (scales included) with the default layout: {len(ok)} of {len(records)} rows "
        f"(worst {max(r['bytes_vs_bf16'] for r in records):.3f}x); block-major: "
        f"{sum(r['block_major_bytes_vs_bf16'] <= 0.52 for r in records)}; 128-row bands (the layout before): "
        f"{sum(r['bands_bytes_vs_bf16'] <= 0.52 for r in records)}.",
        "* Block-major keeps each quantized weight's fp32 master tile-major, so a cut may fall between any two "
        "128x128 tiles: every 2-D weight and expert stack has the same granule (16,384 elements), and the lcm of "
        "the widths' 128-row bands (128x8192 and 128x28672 for Llama-3-70B) that forced the shard size up at large N "
        f"is gone. The default chose block-major in {sum(r['tile_major'] > 0 for r in records)} of {len(records)} rows "
        "(it keeps bands where they pad no more: on a tie, or on small models where a 16,384-element tile is a large "
        f"part of a shard, e.g. the Llama of `tests/distributed/test_quant_tiles.py` on 2 ranks). Its padding is on its lower bound in {sum(r['padding'] <= r['lower_bound'] for r in records)} of "
        f"{len(records)} rows and at most {max(r['padding'] - r['lower_bound'] for r in records):.3%} above it.",
        f"* `!`: default padding above {BLOCK_PADDING_WARNING:.0%}, where `python -m lightning_vescale.plan` "
        "prints a warning naming the groups (the format is kept). *tiles*: tile-major weights of the layer.", "",
        "| model | N | default | (lb) | tiles | block-major | (lb) | 128-row bands | (lb) | bf16 | bytes vs bf16 | "
        "block-major | bands | flag | plan s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|---:|",
    ]
    for r in records:
        out.append(f"| {r['model']} | {r['world_size']} | {pct(r['padding'])} | {pct(r['lower_bound'])} | "
                   f"{r['tile_major']}/{r['tensors']} | {pct(r['block_major_padding'])} | "
                   f"{pct(r['block_major_lower_bound'])} | {pct(r['bands_padding'])} | {pct(r['bands_lower_bound'])} | "
                   f"{pct(r['bf16_padding'])} | {r['bytes_vs_bf16']:.3f} | {r['block_major_bytes_vs_bf16']:.3f} | "
                   f"{r['bands_bytes_vs_bf16']:.3f} | {'!' if r['flagged'] else ''} | {r['plan_seconds']:.2f} |")
    odd = {r["model"]: r["odd_rows"] for r in records}
    out += ["", "Rows that are not a multiple of 128 (their last tile row is shorter): "
            + "; ".join(f"{m}: {v or 'none'}" for m, v in odd.items()) + "."]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-sizes", default=",".join(map(str, WORLD_SIZES)))
    args = parser.parse_args()
    sizes = [int(x) for x in args.world_sizes.split(",")]
    records = [record(model, N) for model in LAYERS for N in sizes]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "quant_tiles.json").write_text(json.dumps(records, indent=1))
    command = "python benchmarks/quant_tiles_bench.py" + (
        "" if sizes == WORLD_SIZES else f" --world-sizes {args.world_sizes}")
    (RESULTS / "quant_tiles.md").write_text(markdown(records, command))


if __name__ == "__main__":
    main()

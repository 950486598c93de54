"""Quantized AllGather of trained weights on whole 128x128 tiles: the padding the block granularity costs on real layers.

Run: ``python benchmarks/quant_tiles_bench.py [--world-sizes 8,16,...]``; writes ``benchmarks/results/quant_tiles.{json,md}``.
Pure (no processes): the engine's own :func:`~lightning_vescale.group_plan.plan_group_buffers` with the engine's
buffer kind (:class:`~lightning_vescale.quant._kinds.QuantizedGatherKind`) on one transformer layer of DeepSeek-V3,
GPT-OSS-120B and Llama-3-70B as one group (fp32 master, bf16 ``param_dtype``, the routers left unquantized as
``quant.exclude`` does), at N = 8 ... 1024. Per layer and N:

* *128-row blocks*: the padding of the fp32 master buffer (the codes mirror it byte for byte) when every cut falls
  between 128-row bands of a matrix (the last band of a matrix holding the rows that remain), and *lb*, the padding
  at the planner's lower bound for that granularity (``shard_size_lower_bound``: what no order avoids);
* *gcd bands (before)*: the padding of the former layout, cut between bands of ``gcd(rows, 128)`` rows (whose tiles
  were ``gcd(rows, 128) x 128``, another format);
* *bf16*: the padding of a bf16 AllGather of the same weights at element granularity;
* *bytes vs bf16*: what one quantized unshard gathers (one byte per element and padding, four per scale, the
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

from lightning_vescale._api import MixedPrecisionPolicy  # noqa: E402
from lightning_vescale.group_plan import ParamEntry, plan_group_buffers  # noqa: E402
from lightning_vescale.plan._layout import BLOCK_PADDING_WARNING, quantized_gather_scales_per_rank  # noqa: E402
from lightning_vescale.planner import TensorSpec, plan_buffer, shard_size_lower_bound  # noqa: E402
from lightning_vescale.quant._kinds import QuantizedGatherKind  # noqa: E402
from lightning_vescale.quant.formats import BlockFormat  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
WORLD_SIZES = [8, 16, 32, 64, 128, 256, 512, 1024]
FMT = BlockFormat("fp8_e4m3", 128)
MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
ROUTERS = ("mlp.gate.weight", "mlp.router.weight")


def quantized_params(model: str) -> list[tuple[str, tuple]]:
    return [(n, s) for n, s in LAYERS[model]() if n not in ROUTERS]


def record(model: str, N: int) -> dict:
    params = quantized_params(model)
    numel = sum(math.prod(s) for _, s in params)
    kind = QuantizedGatherKind(FMT)
    t0 = time.perf_counter()
    (quant,) = plan_group_buffers([ParamEntry(n, s, torch.float32, True, "element", kind) for n, s in params], N, MP)
    plan_s = time.perf_counter() - t0
    plan = quant.plan
    lb = shard_size_lower_bound(plan.specs, N, alignment=plan.alignment)
    scales = quantized_gather_scales_per_rank(plan, FMT)
    (bf16,) = plan_group_buffers([ParamEntry(n, s, torch.float32, True, "element") for n, s in params], N, MP)
    # The former layout: uniform granules of gcd(rows, 128) rows of each matrix.
    old_specs = [TensorSpec(n, s, math.gcd(s[-2], 128) * s[-1]) for n, s in params]
    old = plan_buffer(old_specs, N, alignment=plan.alignment)
    quant_bytes = N * (plan.shard_size + 4 * scales)
    bf16_bytes = N * bf16.plan.shard_size * 2
    rec = {
        "model": model, "world_size": N, "tensors": len(params), "numel": numel,
        "padding": plan.padding_ratio, "lower_bound": (N * lb - numel) / numel,
        "gcd_bands_padding": old.padding_ratio, "bf16_padding": bf16.plan.padding_ratio,
        "scales_per_rank": scales, "bytes_vs_bf16": quant_bytes / bf16_bytes,
        "flagged": plan.padding_ratio > BLOCK_PADDING_WARNING, "plan_seconds": plan_s,
        "odd_rows": sorted({s[-2] for _, s in params if s[-2] % 128}),
    }
    print(f"{model:13s} N={N:5d} blocks {rec['padding']:9.4%} (lb {rec['lower_bound']:9.4%}) gcd {rec['gcd_bands_padding']:9.4%} "
          f"bf16 {rec['bf16_padding']:7.4%} bytes {rec['bytes_vs_bf16']:.4f}x plan {plan_s:.2f}s", flush=True)
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
        "128x128 quantize-dequantize at every N (`tests/distributed/test_quant_tiles.py`).", "",
        f"* Bytes <= 0.52x of bf16 (scales included): {len(ok)} of {len(records)} rows.",
        f"* `!`: padding above {BLOCK_PADDING_WARNING:.0%}, where `python -m lightning_vescale.plan` prints a warning "
        "naming the groups (the format is kept). Where the padding equals `lb`, no order of these tensors does better "
        "at 128-row granularity: the shard size must be a multiple of the lcm of the widths' granules (e.g. "
        "128x8192 and 128x28672 for Llama-3-70B) once a tensor spans two shards; only a block-major layout of the "
        "trained weights (as the frozen storage has) would remove it.", "",
        "| model | N | 128-row blocks | (lb) | gcd bands (before) | bf16 | bytes vs bf16 | flag | plan s |",
        "|---|---:|---:|---:|---:|---:|---:|:-:|---:|",
    ]
    for r in records:
        out.append(f"| {r['model']} | {r['world_size']} | {pct(r['padding'])} | {pct(r['lower_bound'])} | "
                   f"{pct(r['gcd_bands_padding'])} | {pct(r['bf16_padding'])} | {r['bytes_vs_bf16']:.3f} | "
                   f"{'!' if r['flagged'] else ''} | {r['plan_seconds']:.2f} |")
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

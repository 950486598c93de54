"""AdamW8bit's optimizer step next to fp32 ``torch.optim.AdamW``: step time (ratio) and state bytes.

    python benchmarks/adamw8bit_bench.py                  # writes benchmarks/results/adamw8bit.{json,md}
    python benchmarks/adamw8bit_bench.py --preset tiny    # llama_tiny's parameters (the main job's model)

One process: the step runs on each rank's local pieces with no communication, so one process stepping a
rank's share is what each rank does. The parameters are a Llama preset's (``--preset``, default ``debug``),
every one with a gradient; the three optimizers (AdamW single-tensor, the CPU default; AdamW foreach; AdamW8bit)
step in turn, in an order that rotates, so background load hits them alike. Reported: the median step time of
each, AdamW8bit over each AdamW, and the bytes of ``optimizer.state`` (codes, scales, fp32 states of small
tensors and ``step`` included) over AdamW's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_vescale.models import Llama, llama_config  # noqa: E402
from lightning_vescale.optim import AdamW8bit, optimizer_state_bytes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "adamw8bit"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Llama(llama_config(args.preset))
    sets = {}
    for name in ("adamw", "adamw_foreach", "adamw8bit"):
        params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-2
        hyper = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
        opt = (AdamW8bit(params, **hyper) if name == "adamw8bit"
               else torch.optim.AdamW(params, **hyper, foreach=name == "adamw_foreach"))
        sets[name] = opt
    times = {name: [] for name in sets}
    names = list(sets)
    for i in range(args.warmup + args.steps):
        order = names[i % 3:] + names[: i % 3]
        for name in order:
            t0 = time.perf_counter()
            sets[name].step()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(t) for name, t in times.items()}
    state = {name: optimizer_state_bytes(opt) for name, opt in sets.items()}
    numel = sum(p.numel() for p in model.parameters())
    result = {
        "command": "python benchmarks/adamw8bit_bench.py " + " ".join(sys.argv[1:]),
        "preset": args.preset, "num_params": numel, "steps": args.steps, "threads": args.threads,
        "torch": torch.__version__, "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
        "load_average": os.getloadavg()[0],
        "median_step_s": median,
        "step_time_ratio_8bit_over_adamw": median["adamw8bit"] / median["adamw"],
        "step_time_ratio_8bit_over_adamw_foreach": median["adamw8bit"] / median["adamw_foreach"],
        "state_bytes": state,
        "state_bytes_ratio_8bit_over_adamw": state["adamw8bit"] / state["adamw"],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# AdamW8bit vs AdamW: optimizer step ({args.preset}, {numel:,} parameters, {args.threads} thread(s))", "",
        f"`{result['command']}` (torch {torch.__version__}, {result['machine']}, load average {result['load_average']:.1f})",
        "", "| optimizer | median step (ms) | state bytes | step time vs AdamW | state vs AdamW |", "|---|---|---|---|---|",
    ]
    for name in names:
        lines.append(f"| {name} | {median[name] * 1e3:.1f} | {state[name]:,} | {median[name] / median['adamw']:.2f}x | "
                     f"{state[name] / state['adamw']:.3f}x |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

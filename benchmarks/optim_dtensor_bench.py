"""What making RaggedTensor a DTensor cost the optimizer step: ``optim_bench.py`` on this tree and on a baseline tree.

    git worktree add --detach /tmp/vescale_before bee9fae      # the last commit before RaggedTensor was a DTensor
    python benchmarks/optim_dtensor_bench.py --baseline /tmp/vescale_before

Runs ``benchmarks/optim_bench.py`` (AdamW on the sharded 34M-parameter bench model, RaggedTensor parameters vs plain
local pieces, single-tensor and ``foreach``) of each tree in turn, ``--rounds`` times, alternating which goes first.
Each run's own ratio (RaggedTensors / plain pieces, paired step by step) cancels the machine's load; the report
compares those ratios, so the difference is what the parameter type costs, not what the machine did meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def _run(tree: Path, out: Path, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, str(tree / "benchmarks" / "optim_bench.py"), "--steps", str(steps),
                    "--out", str(out)], check=True, env=env, cwd=tree, stdout=subprocess.DEVNULL)
    return json.loads(Path(str(out) + ".json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of the commit to compare with")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=str(HERE / "benchmarks" / "results" / "optim_dtensor"))
    args = parser.parse_args()
    trees = {"before (RaggedTensor(torch.Tensor))": args.baseline.resolve(), "now (RaggedTensor(DTensor))": HERE}
    ratios: dict[str, dict[str, list[float]]] = {name: {"single-tensor": [], "foreach": []} for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(trees.items()) if r % 2 == 0 else list(reversed(trees.items()))
            for name, tree in order:
                result = _run(tree, Path(tmp) / f"{r}", args.steps)
                for mode in ratios[name]:
                    ratios[name][mode] += [rank[mode]["paired_ratio"] for rank in result["per_rank"]]
    lines = [
        "# Optimizer step cost of RaggedTensor parameters, before and after they became DTensors",
        "",
        f"`benchmarks/optim_bench.py` (AdamW, bench_small, 2 gloo ranks, {args.steps} timed steps) on each tree, "
        f"{args.rounds} rounds alternating the order; per run and rank the paired ratio of the step's CPU time on "
        "RaggedTensor parameters over the same step on plain local pieces (1.00: no overhead).",
        "",
        "Command: `python benchmarks/optim_dtensor_bench.py --baseline <checkout of bee9fae>`",
        "",
        "| tree | AdamW path | paired ratios (every run and rank) | median |",
        "|---|---|---|---|",
    ]
    for name, by_mode in ratios.items():
        for mode, values in by_mode.items():
            lines.append(f"| {name} | {mode} | {', '.join(f'{v:.3f}' for v in values)} | {statistics.median(values):.3f} |")
    text = "\n".join(lines) + "\n"
    Path(args.out + ".md").write_text(text)
    Path(args.out + ".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                    "ratios": ratios}, indent=1))
    print(text)


if __name__ == "__main__":
    main()

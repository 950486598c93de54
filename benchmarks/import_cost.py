"""What ``import lightning_vescale`` costs: seconds and resident memory, in fresh processes.

    python benchmarks/import_cost.py            # 5 processes per case, medians; writes benchmarks/results/import_cost.md

Each case runs in a new interpreter, which imports torch first (the floor: the core package needs it), then the
case: its seconds (``time.perf_counter`` around the import) and the growth of the resident set (``VmRSS``) are
what the package adds to torch; the totals include torch. ``lightning_vescale.lightning`` is what
``import lightning_vescale`` cost before the core stopped importing Lightning (it registers the strategies, and is
imported on demand now).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = {"lightning_vescale": "import lightning_vescale",
         "lightning_vescale.lightning (Lightning too)": "import lightning_vescale.lightning"}
PROBE = """
import time
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
r0 = rss(); t0 = time.perf_counter()
import torch
r1 = rss(); t1 = time.perf_counter()
{stmt}
print(t1 - t0, r1 - r0, time.perf_counter() - t1, rss() - r1)
"""


def measure(stmt: str, repeat: int) -> dict[str, float]:
    rows = []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, "-c", PROBE.format(stmt=stmt)], cwd=ROOT, capture_output=True, text=True,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True).stdout.split()
        rows.append([float(x) for x in out[-4:]])
    keys = ("torch_seconds", "torch_rss", "seconds", "rss")
    return {k: statistics.median(r[i] for r in rows) for i, k in enumerate(keys)}


def main() -> None:
    repeat = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    results = {name: measure(stmt, repeat) for name, stmt in CASES.items()}
    lines = ["# Import cost", "", f"Command: `python benchmarks/import_cost.py {repeat}` (median of {repeat} fresh "
             f"processes; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)", "",
             "| import | after torch: seconds | after torch: resident MiB | total with torch: seconds | "
             "total: resident MiB |", "|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| `{name}` | {r['seconds']:.2f} | {r['rss'] / 2**20:.0f} | "
                     f"{r['seconds'] + r['torch_seconds']:.2f} | {(r['rss'] + r['torch_rss']) / 2**20:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "benchmarks" / "results" / "import_cost"
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

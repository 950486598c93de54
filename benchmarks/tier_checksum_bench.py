"""What the disk tier's checksums cost: one 64 MiB tensor written and read back, with and without them.

    python benchmarks/tier_checksum_bench.py                 # page cache and O_DIRECT, 7 repeats each

"without" replaces the checksum (``lightning_vescale.memory.disk.fingerprint``) by a no-op (benchmark only: the
library has no switch to turn it off). Reported: the median wall time of a write plus a read, one thread.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import lightning_vescale.memory.disk as disk


def bench(directory: str, *, checksum: bool, direct: bool, repeats: int) -> float:
    store = disk.DiskStore(directory, direct=True)
    t, out = torch.randn(16 * 2**20), torch.empty(16 * 2**20)
    if direct:  # aligned memory: moves with O_DIRECT; otherwise through the page cache
        disk.realign(t)
        disk.realign(out)
    real = disk.fingerprint
    if not checksum:
        disk.fingerprint = lambda _: 0
    times = []
    try:
        for i in range(repeats):
            start = time.perf_counter()
            store.write(f"k{i}", t)
            store.read_into(f"k{i}", out)
            times.append(time.perf_counter() - start)
            store.delete(f"k{i}")
    finally:
        disk.fingerprint = real
        store.close()
    assert torch.equal(out, t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="the disk to test (default: a temporary directory)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    directory = args.dir or tempfile.mkdtemp()
    for direct in (False, True):
        without = bench(directory, checksum=False, direct=direct, repeats=args.repeats)
        with_ = bench(directory, checksum=True, direct=direct, repeats=args.repeats)
        print(f"{'O_DIRECT  ' if direct else 'page cache'} 64 MiB write+read: without checksum {without * 1e3:.0f} ms, "
              f"with {with_ * 1e3:.0f} ms ({with_ / without:.2f}x)")


if __name__ == "__main__":
    main()

"""What the checkpoint checksums cost: sharded save and load with and without them, side by side.

    python benchmarks/checkpoint_bench.py                         # bench_small (33.6M) + AdamW, 2 ranks
    python benchmarks/checkpoint_bench.py --world-size 4 --repeats 5

One set of rank processes saves and loads the same model and optimizer (fp32 AdamW after one step, so the
states exist) alternately in the two modes, repeat by repeat, so that background load and the page cache
affect both alike. "without" replaces the checksum computation at save and its verification at load by
no-ops (benchmark only: the library has no switch to turn them off). Reported: median wall time of save and
load over the repeats (max over ranks per call), their ratio, the time spent inside the CRC-32 itself, and
the checkpoint's size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning_vescale as lv  # noqa: E402
from lightning_vescale.checkpoint import _storage  # noqa: E402
from lightning_vescale.models import Llama, LlamaConfig  # noqa: E402

MODEL = LlamaConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=1536, max_seq_len=256)
MODES = ("with checksums", "without checksums")

_crc_seconds = [0.0]


def _timed_crc(original):
    def crc_of_items(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            _crc_seconds[0] += time.perf_counter() - start

    return crc_of_items


@contextmanager
def _without_checksums():
    """Skip computing checksums at save and verifying them at load (the file is still written, empty)."""
    saved = _storage.written_items_crc, _storage.verify_checksums
    _storage.written_items_crc = lambda *args, **kwargs: {}
    _storage.verify_checksums = lambda *args, **kwargs: None
    try:
        yield
    finally:
        _storage.written_items_crc, _storage.verify_checksums = saved


def _max_over_ranks(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def worker(rank: int, world: int, init_file: str, directory: str, repeats: int, out_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Llama(MODEL)
    for block in model.layers:
        lv.fully_shard(block)
    lv.fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, MODEL.vocab_size, (2, 129), generator=torch.Generator().manual_seed(rank))
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()

    _storage._crc_of_items = _timed_crc(_storage._crc_of_items)
    times = {mode: {"save": [], "load": [], "crc": []} for mode in MODES}
    for repeat in range(repeats):
        for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
            path = os.path.join(directory, f"ckpt-{repeat}-{mode.split()[0]}")
            _crc_seconds[0] = 0.0
            with _without_checksums() if mode.startswith("without") else _nothing():
                dist.barrier()
                start = time.perf_counter()
                lv.checkpoint.save(path, model, optimizer)
                times[mode]["save"].append(_max_over_ranks(time.perf_counter() - start))
                dist.barrier()
                start = time.perf_counter()
                lv.checkpoint.load(path, model, optimizer)
                times[mode]["load"].append(_max_over_ranks(time.perf_counter() - start))
            times[mode]["crc"].append(_max_over_ranks(_crc_seconds[0]))
    if rank == 0:
        size = sum(f.stat().st_size for f in Path(directory, "ckpt-0-with").rglob("*") if f.is_file())
        Path(out_file).write_text(json.dumps({"times": times, "bytes": size}))
    dist.destroy_process_group()


@contextmanager
def _nothing():
    yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "checkpoint"))
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "out.json")
        procs = [ctx.Process(target=worker, args=(r, args.world_size, init_file, tmp, args.repeats, out_file))
                 for r in range(args.world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit("benchmark processes failed")
        result = json.loads(Path(out_file).read_text())
    med = {m: {k: statistics.median(v) for k, v in result["times"][m].items()} for m in MODES}
    on, off = med["with checksums"], med["without checksums"]
    lines = [
        "# Checkpoint checksums: cost of save and load",
        "",
        f"`python benchmarks/checkpoint_bench.py --world-size {args.world_size} --repeats {args.repeats}`: "
        f"34M-parameter Llama + fp32 AdamW states, {args.world_size} gloo ranks, checkpoint "
        f"{result['bytes'] / 2**20:.0f} MiB; median over {args.repeats} alternating repeats, max over ranks.",
        "",
        "| | with checksums (s) | without (s) | ratio | inside CRC-32 (s) |",
        "|---|---|---|---|---|",
        f"| save | {on['save']:.3f} | {off['save']:.3f} | {on['save'] / off['save']:.2f}x | {on['crc']:.3f} |",
        f"| load | {on['load']:.3f} | {off['load']:.3f} | {on['load'] / off['load']:.2f}x | (in the above) |",
        "",
        "\"inside CRC-32\" is the time per save and load pair in `_storage._crc_of_items` (reading the stored "
        "bytes back and hashing them), max over ranks: "
        f"{on['crc'] / (off['save'] + off['load']):.0%} of a save and load without checksums, "
        f"{result['bytes'] / 2**20 / max(on['crc'], 1e-9):.0f} MiB/s hashed (each byte twice: at save and at load). "
        "The wall-time ratios move by more than that between repeats on this shared 2-core machine; the CRC "
        "column is the direct cost.",
    ]
    out = Path(args.out)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"world_size": args.world_size, **result}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

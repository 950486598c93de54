"""The disk tier's write-back of optimizer states, in one process (no process group: plain parameters).

With prefetch on, a stepped bucket's states are written on a background thread while the next bucket steps. Writes
are slowed down here so that they pile up: the number in flight must reach its bound and never pass it, ``step``
must return only when every write has completed (states released, the files current), and training stays
bitwise the same as without offload. A write that fails must leave its states in memory and say so. Large states
move with ``O_DIRECT`` (out of the page cache) and come back bitwise.
"""

from __future__ import annotations

import copy
import os
import time
from unittest import mock

import pytest
import torch
import torch.nn as nn

from lightning_vescale.memory import DiskTierError, MemoryPolicy, offload_optimizer_states, resident_states
from lightning_vescale.memory.disk import ALIGN, DIRECT_MIN_BYTES, DiskStore, alloc_aligned, realign


def _setup(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    offload = offload_optimizer_states(opt, MemoryPolicy(optimizer_states="disk", disk_dir=str(tmp_path),
                                                         bucket_bytes=4096))
    return model, ref, opt, ref_opt, offload


def _train(model, opt, step: int) -> None:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _states(opt) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if v.dim()]


def test_write_back_is_bounded_and_complete_when_step_returns(tmp_path) -> None:
    model, ref, opt, ref_opt, offload = _setup(tmp_path)
    assert len(offload.buckets()) >= 4 and offload._writer is not None
    write, submit = offload.store.write, offload._writer.submit
    in_flight: list[int] = []

    def slow_write(key, t):
        time.sleep(0.005)  # slower than a bucket's step: without a bound, every bucket would be in flight
        write(key, t)

    def counting_submit(fn, jobs):
        in_flight.append(len(offload._writes) + 1)
        return submit(fn, jobs)

    offload.store.write = slow_write
    offload._writer.submit = counting_submit
    for step in range(2):
        _train(model, opt, step)
        _train(ref, ref_opt, step)
        assert not offload._writes, "step returned with writes in flight"
        assert all(s.untyped_storage().nbytes() == 0 for s in _states(opt)), "every state released once written"
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters())), step
    assert max(in_flight) == offload.writes_in_flight, in_flight
    with resident_states(opt):  # what a checkpoint reads: the files as last written
        assert all(torch.equal(a, b) for a, b in zip(_states(opt), _states(ref_opt)))
    offload.close()


def test_a_failed_write_back_keeps_the_states_in_memory(tmp_path) -> None:
    model, ref, opt, ref_opt, offload = _setup(tmp_path)
    _train(model, opt, 0)
    _train(ref, ref_opt, 0)
    offload.writes_in_flight = 100  # every bucket steps; the failure surfaces when step waits for the writes
    write, failed = offload.store.write, []

    def full_disk(key, t):
        if not failed:
            failed.append(key)
            raise DiskTierError("the disk is full")
        write(key, t)

    offload.store.write = full_disk
    with pytest.raises(DiskTierError, match="the disk is full"):
        _train(model, opt, 1)
    _train(ref, ref_opt, 1)
    offload.store.write = write
    with resident_states(opt):
        assert all(torch.equal(a, b) for a, b in zip(_states(opt), _states(ref_opt))), "nothing was lost"
    offload.close()


def test_large_states_move_with_o_direct_and_come_back_bitwise(tmp_path) -> None:
    store = DiskStore(str(tmp_path), direct=True)
    if not store.direct:
        pytest.skip("this file system has no O_DIRECT")
    t = torch.randn(DIRECT_MIN_BYTES // 4 + 3)  # its size is no multiple of the block size
    want = t.clone()
    realign(t)
    assert t.data_ptr() % ALIGN == 0 and torch.equal(t, want)
    flags, real_open = [], os.open

    def spy(path, f, *args):
        flags.append(f)
        return real_open(path, f, *args)

    with mock.patch("os.open", spy):
        store.write("state", t)
        t.untyped_storage().resize_(0)
        alloc_aligned(t, want.numel() * want.element_size())
        store.read_into("state", t)
    assert len(flags) == 2 and all(f & os.O_DIRECT for f in flags)
    assert torch.equal(t, want)
    store.close()

"""The disk tier's write-back and read-ahead of optimizer states, in one process.

With prefetch on, a stepped bucket's states are written on a background thread while the next bucket steps, and
``step`` returns with the last buckets still being written (they complete during the next forward). Writes are
slowed down here so that they pile up: the buckets in memory (read, stepping or being written) must reach their
bound and never pass it, every read
(the next step's, backward's read-ahead, a checkpoint's) must wait for the write of the same state, and training
stays bitwise the same as without offload. With the sharded model given, the step's first buckets are read during
backward, ``buckets_in_memory`` of them, and a forward before the step releases them. A write that fails
must leave its states in memory and say so before the next step changes anything. Large states move with
``O_DIRECT`` (out of the page cache) and come back bitwise.
"""

from __future__ import annotations

import copy
import os
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_vescale.memory import DiskTierError, MemoryPolicy, offload_optimizer_states, resident_states
from lightning_vescale.memory.disk import ALIGN, DIRECT_MIN_BYTES, DiskStore, alloc_aligned, realign


def _setup(tmp_path, **policy):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    offload = offload_optimizer_states(opt, MemoryPolicy(optimizer_states="disk", disk_dir=str(tmp_path),
                                                         bucket_bytes=4096, **policy))
    return model, ref, opt, ref_opt, offload


def _train(model, opt, step: int) -> None:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _states(opt) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if v.dim()]


def test_write_back_is_bounded_and_finishes_in_the_background(tmp_path) -> None:
    model, ref, opt, ref_opt, offload = _setup(tmp_path, prefetch_buckets=3)  # the policy's bound, not the default
    assert len(offload.buckets()) >= 4 and offload._writer is not None
    assert len(offload.buckets()) > offload.buckets_in_memory + 1
    write, read = offload.store.write, offload.store.read_into
    bucket_of = {id(s): i for i, b in enumerate(offload.buckets()) for p in b for s in opt.state.get(p, {}).values()}
    in_memory: list[int] = []

    def count() -> None:  # buckets with a state in memory (a read fills one, a write empties one)
        in_memory.append(len({bucket_of.get(id(s)) for s in _states(opt) if s.untyped_storage().nbytes()}))

    def slow_write(key, t):
        time.sleep(0.005)  # slower than a bucket's step: without a bound, every bucket would be in flight
        count()
        write(key, t)

    def counted_read(key, t, *args):
        read(key, t, *args)
        count()

    offload.store.write, offload.store.read_into = slow_write, counted_read
    for step in range(2):
        _train(model, opt, step)
        _train(ref, ref_opt, step)
        assert offload._writes, "the last buckets' write-back overlaps what follows the step"
        offload.flush()
        bucket_of = {id(s): i for i, b in enumerate(offload.buckets()) for p in b for s in opt.state[p].values()}
        assert all(s.untyped_storage().nbytes() == 0 for s in _states(opt)), "every state released once written"
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters())), step
    assert max(in_memory) == 3, in_memory
    _train(model, opt, 2)
    _train(ref, ref_opt, 2)
    with resident_states(opt):  # right after the step: a checkpoint sees the stepped states, whole
        assert all(torch.equal(a, b) for a, b in zip(_states(opt), _states(ref_opt)))
    offload.close()


def test_a_failed_write_back_keeps_the_states_in_memory(tmp_path) -> None:
    model, ref, opt, ref_opt, offload = _setup(tmp_path)
    _train(model, opt, 0)
    _train(ref, ref_opt, 0)
    offload.flush()  # step 0's writes done before the disk fills up
    offload.buckets_in_memory = 100  # every bucket steps; the failure surfaces when the writes are waited for
    write, failed = offload.store.write, []

    def full_disk(key, t):
        if not failed:
            failed.append(key)
            raise DiskTierError("the disk is full")
        write(key, t)

    offload.store.write = full_disk
    _train(model, opt, 1)
    _train(ref, ref_opt, 1)
    with pytest.raises(DiskTierError, match="the disk is full"):
        _train(model, opt, 2)  # raised by the next step before it changes anything
    offload.store.write = write
    with resident_states(opt):
        assert all(torch.equal(a, b) for a, b in zip(_states(opt), _states(ref_opt))), "nothing was lost"
    offload.close()


def test_reads_during_backward_wait_for_the_write_back_and_forward_releases_them(tmp_path) -> None:
    """The step's first buckets are read during backward (the sharded model given), after the previous step's
    write of the same states completed; a forward before the step (gradient accumulation) releases them."""
    import lightning_vescale as lv
    from lightning_vescale.memory import apply_memory_policy
    from tests.toy_models import MLP

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ref = MLP(num_blocks=4)
        model = copy.deepcopy(ref)
        for block in model.blocks:
            lv.fully_shard(block)
        lv.fully_shard(model)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        handles = apply_memory_policy(model, [opt], MemoryPolicy(optimizer_states="disk", disk_dir=str(tmp_path),
                                                                 bucket_bytes=2048))
        offload = handles.states[0]
        assert len(offload.buckets()) > offload.buckets_in_memory + 1
        writing: set[str] = set()
        write, read = offload.store.write, offload.store.read_into
        stale: list[str] = []

        def slow_write(key, t):
            writing.add(key)
            time.sleep(0.01)  # still in flight when the next backward wants to read the same states
            write(key, t)
            writing.discard(key)

        def checked_read(key, t, *args):
            if key in writing:
                stale.append(key)
            read(key, t, *args)

        offload.store.write, offload.store.read_into = slow_write, checked_read
        resident = lambda: sum(s.to_local().untyped_storage().nbytes() > 0 for s in _states(opt))  # noqa: E731
        ahead = 2 * sum(map(len, offload.buckets()[: offload.buckets_in_memory]))  # AdamW: two states per param
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(2, 8, 7, generator=g)
            for m, o in ((ref, None), (model, offload)):
                for micro in range(2):  # gradient accumulation: a forward between backward and the step
                    loss = m(x[micro]).square().mean()
                    if o is not None and micro == 1:
                        assert resident() == 0, "a forward before the step releases what was read ahead"
                    loss.backward()
                    if o is not None and step >= 1:
                        o._finish_reads()  # started during backward, on the background thread
                        assert resident() == ahead, ("the step's first buckets are read during backward", step)
                (ref_opt if o is None else opt).step()
                (ref_opt if o is None else opt).zero_grad()
            assert all(torch.equal(p.full_tensor(), q) for p, q in zip(model.parameters(), ref.parameters())), step
        assert not stale, f"read while being written: {stale}"
        assert offload._writes, "the writes were slow enough to be in flight after the step"
        opt.state_dict()  # what a checkpoint reads: every write done first
        assert not offload._writes and resident() == 0
        with resident_states(opt):
            assert all(torch.equal(a.full_tensor(), b) for a, b in zip(_states(opt), _states(ref_opt)))
        handles.close()
    finally:
        dist.destroy_process_group()


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


def _aligned_at_the_end_of_its_storage(nbytes: int) -> torch.Tensor:
    """A float tensor of ``nbytes`` starting on an ALIGN boundary and ending with its storage (no room to the next
    boundary): what the allocator hands out now and then for a new optimizer state."""
    for extra in range(0, 64 * ALIGN, 64):
        storage = torch.UntypedStorage(nbytes + ALIGN + extra)
        end = storage.data_ptr() + storage.nbytes()
        start = (end - nbytes) // ALIGN * ALIGN
        if end - start < -(-nbytes // ALIGN) * ALIGN:
            t = torch.empty(0)
            t.set_(storage, (start - storage.data_ptr()) // 4, (nbytes // 4,), (1,))
            return t
    raise AssertionError("no such placement found")


def test_realign_gives_a_page_aligned_state_without_room_the_room_o_direct_needs(tmp_path) -> None:
    t = _aligned_at_the_end_of_its_storage(DIRECT_MIN_BYTES + 12)
    t.copy_(torch.randn(t.numel()))
    want = t.clone()
    assert t.data_ptr() % ALIGN == 0
    realign(t)
    storage = t.untyped_storage()
    assert storage.data_ptr() + storage.nbytes() - t.data_ptr() >= DIRECT_MIN_BYTES + ALIGN
    assert t.data_ptr() % ALIGN == 0 and torch.equal(t, want)


def test_a_buckets_large_states_are_read_into_one_aligned_storage_with_o_direct(tmp_path) -> None:
    """A bucket's states share one storage (one allocation, huge pages where the kernel gives them), each on a block
    boundary, moved with O_DIRECT; training stays bitwise the same as in memory."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))  # 1 MiB weights: their states move direct
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    offload = offload_optimizer_states(opt, MemoryPolicy(optimizer_states="disk", disk_dir=str(tmp_path),
                                                         bucket_bytes=64 * 2**20))
    if not offload.store.direct:
        pytest.skip("this file system has no O_DIRECT")
    assert len(offload.buckets()) == 1
    opened, real_open = [], os.open

    def spy(path, f, *args):
        opened.append((path, f))
        return real_open(path, f, *args)

    with mock.patch("os.open", spy):
        for step in range(3):
            x = torch.randn(4, 512, generator=torch.Generator().manual_seed(step))
            for m, o in ((model, opt), (ref, ref_opt)):
                m(x).square().mean().backward()
                o.step()
                o.zero_grad()
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters())), step
        offload.flush()
    flags = [f for path, f in opened if os.path.getsize(path) >= DIRECT_MIN_BYTES]
    assert len(flags) == 4 * (1 + 2 + 2) and all(f & os.O_DIRECT for f in flags), flags  # 4 states: w, rw, rw
    large = [s for p in (model[0].weight, model[1].weight) for s in opt.state[p].values() if s.dim()]
    with resident_states(opt):
        assert len({s.untyped_storage().data_ptr() for s in large}) == 1, "one storage for the bucket"
        assert all(s.data_ptr() % ALIGN == 0 for s in large)
        assert all(torch.equal(a, b) for a, b in zip(_states(opt), _states(ref_opt)))
    assert all(s.untyped_storage().nbytes() == 0 for s in large), "released together once written"
    offload.close()


def test_a_failed_read_leaves_the_bucket_on_the_tier_and_the_step_can_be_retried(tmp_path) -> None:
    model, ref, opt, ref_opt, offload = _setup(tmp_path, prefetch=False)
    _train(model, opt, 0)
    _train(ref, ref_opt, 0)
    read, calls = offload.store.read_into, []

    def failing_read(key, t, *args):
        calls.append(key)
        if len(calls) == 2:  # the first bucket's second state: the first is in memory already
            raise DiskTierError("the disk went away")
        read(key, t, *args)

    offload.store.read_into = failing_read
    with pytest.raises(DiskTierError, match="the disk went away"):
        _train(model, opt, 1)  # raises in the step, before the first bucket steps
    assert all(s.untyped_storage().nbytes() == 0 for s in _states(opt)), "the bucket's states back on the tier"
    offload.store.read_into = read
    opt.step()  # the same gradients, again
    opt.zero_grad()
    _train(ref, ref_opt, 1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    with resident_states(opt):
        assert all(torch.equal(a, b) for a, b in zip(_states(opt), _states(ref_opt)))
    offload.close()

"""gather_full / redistribute / redistribute_flat on gloo ranks, compared bitwise with shard_tensor.

One class of tests per world size (2, 3, 4), sharing its ranks (:class:`tests.dist_pool.DistributedTest`), one test
per behaviour; every rank draws the same cases from the same seed, so the collectives line up. Every comparison is
bitwise (float8 as bytes):

* random ragged placements (float32, bfloat16, int64, float8; empty tensors): gather_full and redistribute, and back;
* fixed cases: float8 rows -> elements -> rows with empty ranks, Shard(0) to a ragged layout (identical placements
  copy without traffic), redistribute_flat out of rank order with replication and dropped elements;
* the argument errors, raised alike on every rank before any collective;
* N -> M -> N resharding of BufferPlan layouts;
* negative controls: a cut moved by one element, swapped owners, one flipped float8 byte are all seen;
* on 3 and 4 ranks, a two-rank subgroup indexes placements by group rank.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.distributed as dist

from lightning_vescale.engine.placement import RaggedShard, gather_full, redistribute, redistribute_flat, shard_tensor
from lightning_vescale.engine.planner import TensorSpec, granularity_numel, plan_buffer
from tests.dist_pool import DistributedTest

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float8_e4m3fn]
NUM_RANDOM_CASES = 40


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (float8 compared as bytes: CPU has no float8 ``equal``)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _full(shape, dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.int64:
        return torch.randperm(max(math.prod(shape), 1), generator=gen)[: math.prod(shape)].reshape(shape)
    return torch.randn(shape, generator=gen).to(dtype)


def _random_placement(rng: random.Random, shape, world_size: int) -> RaggedShard:
    k = rng.randint(1, len(shape))
    total = math.prod(shape[:k])
    style = rng.random()
    if style < 0.15:
        return RaggedShard.even(shape, world_size, tuple(range(k)))
    if style < 0.3:  # everything on one rank
        units = [0] * world_size
        units[rng.randrange(world_size)] = total
        return RaggedShard(tuple(range(k)), tuple(units))
    cuts = sorted(rng.randint(0, total) for _ in range(world_size - 1))
    bounds = [0, *cuts, total]
    return RaggedShard(tuple(range(k)), tuple(b - a for a, b in zip(bounds, bounds[1:])))


def _check_placements(rank: int, world_size: int, rng: random.Random, gen: torch.Generator) -> None:
    for case in range(NUM_RANDOM_CASES):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
        if case % 10 == 9:  # a tensor without elements
            shape = (0, *shape[1:]) if case % 20 == 9 else (*shape, 0)
        dtype = DTYPES[case % len(DTYPES)]
        full = _full(shape, dtype, gen)
        src = _random_placement(rng, shape, world_size)
        dst = _random_placement(rng, shape, world_size)
        local = shard_tensor(full, src, rank).clone()
        info = f"case {case}: {shape} {dtype} src={src} dst={dst}"
        assert _same(gather_full(local, shape, src), full), info
        out = redistribute(local, shape, src, dst)
        assert _same(out, shard_tensor(full, dst, rank)), info
        assert _same(redistribute(out, shape, dst, src), shard_tensor(full, src, rank)), info


def _seeded(world_size: int, offset: int = 0) -> tuple[random.Random, torch.Generator]:
    """The same cases on every rank: a seed per world size."""
    seed = 1234 + world_size + offset
    return random.Random(seed), torch.Generator().manual_seed(seed)


def _check_placements_round_trip(rank: int, world_size: int) -> None:
    _check_placements(rank, world_size, *_seeded(world_size))


def _check_float8_rows_to_elements_and_back(rank: int, world_size: int) -> None:
    """float8 round trip: rows -> elements -> rows, ranks with nothing in both."""
    _, gen = _seeded(world_size)
    n = world_size
    shape = (2 * n + 3, 5)
    full = (torch.randn(shape, generator=gen) * 100).to(torch.float8_e4m3fn)
    rows = RaggedShard((0,), (0, *[1] * (n - 2), n + 5))
    elems = RaggedShard((0, 1), (*[0] * (n - 1), math.prod(shape)))
    elems_ragged = RaggedShard((0, 1), (7, *[3] * (n - 2), math.prod(shape) - 7 - 3 * (n - 2)))
    local = shard_tensor(full, rows, rank).clone()
    assert _same(gather_full(local, shape, rows), full)
    there = redistribute(local, shape, rows, elems_ragged)
    assert _same(there, shard_tensor(full, elems_ragged, rank))
    assert there.dtype == torch.float8_e4m3fn
    assert _same(redistribute(there, shape, elems_ragged, elems), shard_tensor(full, elems, rank))
    back = redistribute(there, shape, elems_ragged, rows)
    assert _same(back, local) and back.shape == (rows.local_units[rank], 5)
    assert torch.equal(gather_full(back, shape, rows).float(), full.float())


def _check_shard0_to_ragged(rank: int, world_size: int) -> None:
    """Shard(0) (torch.chunk split) to a ragged layout and back; identical placements need no traffic."""
    _, gen = _seeded(world_size)
    n = world_size
    shape = (3 * n + 1, 4, 2)
    full = _full(shape, torch.float32, gen)
    even = RaggedShard.even(shape, n)
    ragged = RaggedShard((0, 1, 2), (1, *[0] * (n - 2), math.prod(shape) - 1))
    local = shard_tensor(full, even, rank).clone()
    assert _same(redistribute(local, shape, even, ragged), shard_tensor(full, ragged, rank))
    same = redistribute(local, shape, even, even)
    assert _same(same, local) and same.data_ptr() != local.data_ptr()


def _flat_pieces(n: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    numel = 37
    flat = torch.arange(numel, dtype=torch.int64)
    cuts = [0, *sorted({(7 * i) % numel for i in range(1, n)}), numel]
    pieces = [(a, b) for a, b in zip(cuts, cuts[1:])] + [(0, 0)] * (n + 1 - len(cuts))
    return flat, pieces


def _check_flat_out_of_order_replicated_dropped(rank: int, world_size: int) -> None:
    """redistribute_flat: sources and destinations out of rank order, replication, dropped elements."""
    n = world_size
    flat, pieces = _flat_pieces(n)
    numel = flat.numel()
    src = pieces[::-1]
    for dst in (pieces, pieces[1:] + pieces[:1], [(0, numel)] * n, [(3, 11)] * (n - 1) + [(0, 0)]):
        lo, hi = src[rank]
        out = redistribute_flat(flat[lo:hi].clone(), src, dst)
        lo, hi = dst[rank]
        assert torch.equal(out, flat[lo:hi]), (src, dst)


def _check_errors(rank: int, world_size: int) -> None:
    """Errors are raised alike on every rank, before any collective."""
    n = world_size
    flat, _ = _flat_pieces(n)
    with pytest.raises(ValueError, match=f"has {n + 1} ranks but the process group has {n}"):
        gather_full(torch.zeros(0), (n + 1,), RaggedShard.even((n + 1,), n + 1))
    with pytest.raises(ValueError, match="src_ranges overlap"):
        redistribute_flat(flat[:5], [(0, 5)] * n, [(0, 5)] * n)
    with pytest.raises(ValueError, match=r"dst_ranges\[0\] = \(0, 9\) is not covered"):
        redistribute_flat(flat[:0] if rank else flat[:5], [(0, 5)] + [(0, 0)] * (n - 1), [(0, 9)] * n)
    with pytest.raises(ValueError, match=f"local_flat has 4 elements but src_ranges\\[{rank}\\]"):
        redistribute_flat(flat[:4], [(5 * r, 5 * r + 5) for r in range(n)], [(0, 0)] * n)


def _check_buffer_plan_reshard(rank: int, world_size: int) -> None:
    """N -> M -> N resharding of BufferPlan layouts, one redistribute_flat per tensor."""
    _, gen = _seeded(world_size)
    shapes = [(9, 5), (4, 3, 2), (17,), (6, 6), (3, 7)]
    grans = ["row", "element", "element", 2, "tensor"]
    specs = [TensorSpec(f"t{i}", s, granularity_numel(s, g)) for i, (s, g) in enumerate(zip(shapes, grans))]
    fulls = {s.name: _full(s.shape, torch.float32, gen) for s in specs}
    big = plan_buffer(specs, world_size)
    for m in range(1, world_size):
        small = plan_buffer(specs, m)
        for spec in specs:
            flat = fulls[spec.name].view(-1)
            src = big.pieces(big.index_of(spec.name))
            dst = small.pieces(small.index_of(spec.name)) + [(0, 0)] * (world_size - m)
            lo, hi = src[rank]
            out = redistribute_flat(flat[lo:hi].clone(), src, dst)
            assert torch.equal(out, flat[dst[rank][0] : dst[rank][1]]), (spec, m)
            back = redistribute_flat(out, dst, src)
            assert torch.equal(back, flat[lo:hi]), (spec, m)
            if spec.granularity % math.prod(spec.shape[1:]) == 0:  # rows stay whole: a Shard(0)-like piece
                placement = RaggedShard.from_flat_ranges(spec.shape, dst)
                assert placement.dims == (0,)
                assert torch.equal(out.view(placement.local_shape(spec.shape, rank)),
                                   shard_tensor(fulls[spec.name], placement, rank))


def _check_negative_controls(rank: int, world_size: int) -> None:
    """Deliberately wrong splits must fail the comparison the tests above rely on."""
    _, gen = _seeded(world_size)
    n = world_size
    shape = (4 * n, 3)
    full = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)  # distinct values
    src = RaggedShard((0,), tuple([4] * n))
    dst = RaggedShard((0, 1), tuple(range(1, n)) + (math.prod(shape) - n * (n - 1) // 2,))
    local = shard_tensor(full, src, rank).clone()
    expected = shard_tensor(full, dst, rank)
    assert _same(redistribute(local, shape, src, dst), expected)
    # (1) a cut moved by one element: two ranks get wrong sizes
    ranges = dst.flat_ranges(shape)
    (a0, a1), (b0, b1) = ranges[0], ranges[1]
    off_by_one = [(a0, a1 + 1), (b0 + 1, b1), *ranges[2:]]
    wrong = redistribute_flat(local.view(-1), src.flat_ranges(shape), off_by_one)
    assert (not _same(wrong, expected)) == (rank in (0, 1))
    # (2) right sizes, wrong owners: two equal pieces swapped between ranks
    swapped = src.flat_ranges(shape)
    swapped[0], swapped[-1] = swapped[-1], swapped[0]
    wrong = redistribute_flat(local.view(-1), src.flat_ranges(shape), swapped).view(src.local_shape(shape, rank))
    mismatch = not _same(wrong, shard_tensor(full, src, rank))
    assert mismatch == (rank in (0, n - 1))
    # (3) the float8 bytes matter: flipping one byte on one rank is seen
    full8 = torch.randn(shape, generator=gen).to(torch.float8_e4m3fn)
    local8 = shard_tensor(full8, src, rank).clone()
    if rank == n - 1:
        local8.view(torch.uint8)[0, 0] ^= 1
    assert not _same(gather_full(local8, shape, src), full8)


def _check_subgroup(rank: int, world_size: int) -> None:
    """A group of two ranks (the first and the last): placements are indexed by group rank."""
    _, gen = _seeded(world_size, offset=1)
    members = [0, world_size - 1]
    group = dist.new_group(members)
    if rank not in members:
        return
    grank = dist.get_rank(group)
    shape = (5, 4)
    full = _full(shape, torch.bfloat16, gen)
    src = RaggedShard((0,), (1, 4))
    dst = RaggedShard((0, 1), (13, 7))
    local = shard_tensor(full, src, grank).clone()
    assert _same(gather_full(local, shape, src, group=group), full)
    assert _same(redistribute(local, shape, src, dst, group=group), shard_tensor(full, dst, grank))


class _RedistributeTests(DistributedTest):
    def test_random_placements_gather_and_redistribute_bitwise(self) -> None:
        self.run_ranks(_check_placements_round_trip)

    def test_float8_rows_to_elements_and_back(self) -> None:
        self.run_ranks(_check_float8_rows_to_elements_and_back)

    def test_shard0_to_ragged_and_identity_copies(self) -> None:
        self.run_ranks(_check_shard0_to_ragged)

    def test_flat_out_of_rank_order_replicated_and_dropped(self) -> None:
        self.run_ranks(_check_flat_out_of_order_replicated_dropped)

    def test_errors_raised_alike_before_any_collective(self) -> None:
        self.run_ranks(_check_errors)

    def test_buffer_plan_reshards_n_to_m_and_back(self) -> None:
        self.run_ranks(_check_buffer_plan_reshard)

    def test_wrong_splits_are_detected(self) -> None:
        self.run_ranks(_check_negative_controls)


class TestRedistributeOn2Ranks(_RedistributeTests):
    world_size = 2


class TestRedistributeOn3Ranks(_RedistributeTests):
    world_size = 3

    def test_subgroup_indexes_placements_by_group_rank(self) -> None:
        self.run_ranks(_check_subgroup)


class TestRedistributeOn4Ranks(_RedistributeTests):
    world_size = 4

    def test_subgroup_indexes_placements_by_group_rank(self) -> None:
        self.run_ranks(_check_subgroup)

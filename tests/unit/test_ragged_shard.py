"""RaggedShard chunk math: property tests (pure, no process group)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_vescale.engine.placement import RaggedShard, ReorderedRaggedShard, flat_range_to_boxes, shard_tensor
from lightning_vescale.engine.planner import TensorSpec, granularity_numel, plan_buffer

SETTINGS = settings(max_examples=150, deadline=None)

shapes = st.lists(st.integers(0, 5), min_size=1, max_size=4).map(tuple)
nonempty_shapes = st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple)


@st.composite
def placements(draw, shape_strategy=shapes):
    """A shape and a random uneven RaggedShard over it (zero-unit ranks included)."""
    shape = draw(shape_strategy)
    k = draw(st.integers(1, len(shape)))
    world_size = draw(st.integers(1, 5))
    total = math.prod(shape[:k])
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=world_size - 1, max_size=world_size - 1)))
    bounds = [0, *cuts, total]
    units = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    return shape, RaggedShard(tuple(range(k)), units)


def materialize(shape, boxes) -> torch.Tensor:
    """The flat indices covered by ``boxes``, box by box, each in row-major order."""
    index = torch.arange(math.prod(shape)).reshape(shape)
    parts = [index[tuple(slice(o, o + s) for o, s in zip(offs, sizes))].reshape(-1) for offs, sizes in boxes]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


# -- flat_range_to_boxes ----------------------------------------------------------------------------
@SETTINGS
@given(shape=nonempty_shapes, data=st.data())
def test_boxes_tile_the_flat_range_in_order(shape, data):
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    end = data.draw(st.integers(start, numel))
    boxes = flat_range_to_boxes(shape, start, end)
    assert torch.equal(materialize(shape, boxes), torch.arange(start, end))
    assert len(boxes) <= 2 * len(shape) - 1
    for offs, sizes in boxes:
        assert len(offs) == len(sizes) == len(shape)
        assert all(s > 0 for s in sizes)
        assert all(o >= 0 and o + s <= d for o, s, d in zip(offs, sizes, shape))


@SETTINGS
@given(shape=nonempty_shapes, data=st.data())
def test_whole_rows_are_one_box(shape, data):
    row = math.prod(shape[1:])
    r0 = data.draw(st.integers(0, shape[0] - 1))
    r1 = data.draw(st.integers(r0 + 1, shape[0]))
    assert flat_range_to_boxes(shape, r0 * row, r1 * row) == [((r0, *(0,) * (len(shape) - 1)), (r1 - r0, *shape[1:]))]


def test_boxes_examples_and_errors():
    assert flat_range_to_boxes((3, 4, 5), 7, 53) == [
        ((0, 1, 2), (1, 1, 3)),
        ((0, 2, 0), (1, 2, 5)),
        ((1, 0, 0), (1, 4, 5)),
        ((2, 0, 0), (1, 2, 5)),
        ((2, 2, 0), (1, 1, 3)),
    ]
    assert flat_range_to_boxes((4, 6), 3, 3) == []
    assert flat_range_to_boxes((), 0, 1) == [((), ())]
    with pytest.raises(ValueError, match=r"flat range \[5, 25\) is not inside \[0, 24\)"):
        flat_range_to_boxes((4, 6), 5, 25)
    with pytest.raises(ValueError, match="0 <= start <= end"):
        flat_range_to_boxes((4, 6), 5, 4)


# -- RaggedShard ------------------------------------------------------------------------------------
@SETTINGS
@given(case=placements())
def test_flat_ranges_tile_in_rank_order(case):
    shape, p = case
    ranges = p.flat_ranges(shape)
    assert len(ranges) == p.world_size
    pos = 0
    for r, (start, end) in enumerate(ranges):
        assert start == pos and end >= start
        assert (start, end) == p.flat_range(shape, r)
        assert end - start == p.local_units[r] * p.unit_numel(shape) == p.local_numel(shape, r)
        pos = end
    assert pos == math.prod(shape)


@SETTINGS
@given(case=placements())
def test_local_shape_offset_and_boxes(case):
    shape, p = case
    for r in range(p.world_size):
        local = p.local_shape(shape, r)
        assert math.prod(local) == p.local_numel(shape, r)
        if p.dims == (0,):
            assert local == (p.local_units[r], *shape[1:])
        else:
            assert local == (p.local_numel(shape, r),)
        start, end = p.flat_range(shape, r)
        offset = p.global_offset(shape, r)
        assert len(offset) == len(shape)
        boxes = p.boxes(shape, r)
        assert torch.equal(materialize(shape, boxes), torch.arange(start, end))
        if boxes:
            assert boxes[0][0] == offset
            # the offset is the unravelled start
            assert sum(o * math.prod(shape[i + 1 :]) for i, o in enumerate(offset)) == start
        if p.dims == (0,) and boxes:
            assert len(boxes) == 1  # whole rows: one chunk, as Shard(0) has


@SETTINGS
@given(case=placements())
def test_from_flat_ranges_round_trips_with_the_coarsest_unit(case):
    shape, p = case
    ranges = [(s, e) if e > s else (0, 0) for s, e in p.flat_ranges(shape)]  # empties as BufferPlan gives them
    q = RaggedShard.from_flat_ranges(shape, ranges)
    assert q.flat_ranges(shape) == p.flat_ranges(shape)
    if math.prod(shape) == 0:
        return
    assert len(q.dims) <= len(p.dims)
    lengths = [e - s for s, e in ranges]
    for k in range(1, len(q.dims)):  # every coarser unit would split some piece
        assert any(n % math.prod(shape[k:]) for n in lengths)


@SETTINGS
@given(
    shapes_=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple), min_size=1, max_size=5),
    grans=st.lists(st.sampled_from(["element", "row", "tensor"]), min_size=5, max_size=5),
    world_size=st.integers(1, 5),
)
def test_from_flat_ranges_of_a_buffer_plan(shapes_, grans, world_size):
    specs = [
        TensorSpec(f"t{i}", s, granularity_numel(s, g)) for i, (s, g) in enumerate(zip(shapes_, grans))
    ]
    plan = plan_buffer(specs, world_size)
    for i, spec in enumerate(plan.specs):
        pieces = plan.pieces(i)
        q = RaggedShard.from_flat_ranges(spec.shape, pieces)
        assert [(s, e) if e > s else (0, 0) for s, e in q.flat_ranges(spec.shape)] == pieces
        if spec.granularity % math.prod(spec.shape[1:]) == 0:  # row or coarser granularity
            assert q.dims == (0,)


@SETTINGS
@given(case=placements(nonempty_shapes), dtype=st.sampled_from([torch.float32, torch.int64, torch.float8_e4m3fn]))
def test_shard_tensor_pieces_concatenate_to_full(case, dtype):
    shape, p = case
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape).to(dtype)
    pieces = [shard_tensor(full, p, r) for r in range(p.world_size)]
    for r, piece in enumerate(pieces):
        assert tuple(piece.shape) == p.local_shape(shape, r)
        assert piece.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()  # a view
    flat = torch.cat([x.reshape(-1).view(torch.uint8) if dtype.itemsize == 1 else x.reshape(-1) for x in pieces])
    expected = full.reshape(-1).view(torch.uint8) if dtype.itemsize == 1 else full.reshape(-1)
    assert torch.equal(flat, expected)


@pytest.mark.parametrize(
    ("rows", "world_size"), [(10, 4), (5, 4), (8, 4), (3, 5), (0, 3), (7, 1)]
)
def test_even_matches_torch_chunk(rows, world_size):
    full = torch.zeros(rows, 3)
    p = RaggedShard.even(full.shape, world_size)
    sizes = [c.shape[0] for c in torch.chunk(full, world_size)] if rows else []
    assert p.dims == (0,)
    assert list(p.local_units) == sizes + [0] * (world_size - len(sizes))
    if rows % world_size == 0:
        assert len(set(p.local_units)) == 1
    assert RaggedShard.even((4, 6), 3, dims=(0, 1)).local_units == (8, 8, 8)


def test_validation_errors():
    for dims in [(), (1,), (0, 2), (1, 0), (-1,)]:
        with pytest.raises(ValueError, match=r"dims must be the leading dims \(0, 1, \.\.\., k-1\) with k >= 1"):
            RaggedShard(dims, (1, 1))
    with pytest.raises(ValueError, match=r"must be non-negative, got negative units \{1: -2\}"):
        RaggedShard((0,), (3, -2, 1))
    with pytest.raises(ValueError, match="one entry per rank"):
        RaggedShard((0,), ())
    with pytest.raises(TypeError):
        RaggedShard((0,), (1.5,))
    p = RaggedShard((0,), (2, 1))
    with pytest.raises(ValueError, match=r"sum to 3, but shape \(4, 5\) with dims \(0,\) has 4 units"):
        p.validate((4, 5))
    with pytest.raises(ValueError, match="sum to 3"):
        p.flat_range((4, 5), 0)
    with pytest.raises(ValueError, match="has 6 units"):
        RaggedShard((0, 1), (2, 3)).validate((2, 3, 7))
    with pytest.raises(ValueError, match=r"at least 2 dim\(s\), got shape \(6,\)"):
        RaggedShard((0, 1), (2, 4)).validate((6,))
    with pytest.raises(ValueError, match="outside the placement's 2 ranks"):
        p.local_shape((3, 5), 2)
    with pytest.raises(ValueError, match="outside the placement's 2 ranks"):
        p.local_shape((3, 5), -1)
    with pytest.raises(ValueError, match="needs a contiguous tensor"):
        shard_tensor(torch.zeros(5, 3).t(), p, 0)


def test_from_flat_ranges_errors_and_empty_tensors():
    with pytest.raises(ValueError, match=r"rank 1 starts at 7 but the ranks before it end at 6"):
        RaggedShard.from_flat_ranges((4, 6), [(0, 6), (7, 24)])
    with pytest.raises(ValueError, match=r"end at 20 but shape \(4, 6\) has 24 elements"):
        RaggedShard.from_flat_ranges((4, 6), [(0, 6), (6, 20)])
    with pytest.raises(ValueError, match="not inside"):
        RaggedShard.from_flat_ranges((4, 6), [(0, 30)])
    with pytest.raises(ValueError, match="Reshape 0-d tensors"):
        RaggedShard.from_flat_ranges((), [(0, 1)])
    assert RaggedShard.from_flat_ranges((3, 0), [(0, 0)] * 3) == RaggedShard((0,), (1, 1, 1))
    assert RaggedShard.from_flat_ranges((4, 6), [(0, 0), (0, 24), (0, 0)]) == RaggedShard((0,), (0, 4, 0))
    assert RaggedShard.from_flat_ranges((4, 6), [(0, 10), (10, 24)]) == RaggedShard((0, 1), (10, 14))
    assert RaggedShard.from_flat_ranges((4, 3, 2), [(0, 6), (6, 24)]) == RaggedShard((0,), (1, 3))
    assert RaggedShard.from_flat_ranges((4, 3, 2), [(0, 8), (8, 24)]) == RaggedShard((0, 1), (4, 8))
    # an empty piece at the end sits one row past the last
    assert RaggedShard((0,), (4, 0)).global_offset((4, 6), 1) == (4, 0)


def test_a_reordered_placement_never_equals_the_row_major_one_with_the_same_pieces() -> None:
    plain, reordered = RaggedShard((0,), (2, 2)), ReorderedRaggedShard((0,), (2, 2))
    assert plain != reordered and reordered != plain  # both ways: a redistribute between them is no no-op
    assert reordered == ReorderedRaggedShard((0,), (2, 2)) and hash(reordered) != hash(plain)


def test_pickling_a_placement_keeps_its_type() -> None:
    import pickle

    for placement in (RaggedShard((0,), (3, 1)), ReorderedRaggedShard((0,), (3, 1))):
        copy = pickle.loads(pickle.dumps(placement))  # noqa: S301 - our own bytes, made just above
        assert type(copy) is type(placement) and copy == placement

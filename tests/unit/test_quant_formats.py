"""Block quantization formats and layouts: error bounds, idempotence, shard-local = whole, negative controls."""

import itertools
import math

import pytest
import torch

from lightning_vescale.quant import (
    BlockCutError,
    BlockFormat,
    dequantize_block_major,
    dequantize_rowmajor,
    quantize_block_major,
    quantize_rowmajor,
    rowmajor_to_block_major,
)
from lightning_vescale.quant.blocks import (
    band_scale_count,
    dequantize_band_piece,
    dequantize_tile_piece_into,
    from_tile_order,
    quantize_band_piece,
    quantize_tile_piece,
    quantize_tile_range,
    tile_boxes,
    tile_grid,
    tile_order_granule,
    tile_range_of,
    tile_scale_count,
    to_tile_order,
    to_tiles,
)
from lightning_vescale.quant.formats import dequantize_tiles, quantize_tiles

FORMATS = [BlockFormat("fp8_e4m3", 128), BlockFormat("fp8_e4m3", 64), BlockFormat("int8", 128), BlockFormat("int8", 64)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _inputs(kind: str, shape: tuple) -> torch.Tensor:
    with torch.random.fork_rng():
        torch.manual_seed(len(kind) * 1000 + sum(shape))
        if kind == "normal":
            return torch.randn(shape)
        # Heavy tails: Student-t with 1.5 degrees of freedom (infinite variance) plus a few huge outliers, so one
        # element dominates its block's amax and most of the block lands on small and subnormal codes.
        x = torch.distributions.StudentT(torch.tensor(1.5)).sample(shape)
        idx = torch.randint(0, x.numel(), (8,))
        x.view(-1)[idx] *= 1e4
        return x


def _bound(w: torch.Tensor, scales_full: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """DESIGN.md's bound per element (with a hair of fp32 rounding in x / scale and code * scale)."""
    if fmt.kind == "fp8_e4m3":
        bound = torch.maximum(w.abs() * 2.0**-4, scales_full * 2.0**-10)
    else:
        bound = scales_full / 2
    return bound * (1 + 1e-4) + 1e-30


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("kind", ["normal", "heavy_tailed"])
@pytest.mark.parametrize("shape", [(512, 384), (300, 200), (3, 130, 250)])
def test_error_bound(fmt, kind, shape):
    w = _inputs(kind, shape)
    codes, scales = quantize_rowmajor(w, fmt)
    back = dequantize_rowmajor(codes, scales, fmt)
    b = fmt.block_size
    scales_full = scales.repeat_interleave(b, -2).repeat_interleave(b, -1)[..., : shape[-2], : shape[-1]]
    err = (back - w).abs()
    assert torch.all(err <= _bound(w, scales_full, fmt)), float((err / _bound(w, scales_full, fmt)).max())
    # The bound is tight enough to mean something: the error is not zero, and a bound 8x smaller fails.
    assert err.max() > 0
    assert not torch.all(err <= _bound(w, scales_full, fmt) / 8)
    # Block-major storage holds the same values.
    assert torch.equal(dequantize_block_major(*quantize_block_major(w, fmt), shape, fmt), back)


def test_scale_is_amax_over_qmax():
    w = torch.zeros(128, 256)
    w[5, 7], w[100, 200] = -3.5, 0.25
    for fmt, qmax in ((BlockFormat("fp8_e4m3"), 448.0), (BlockFormat("int8"), 127.0)):
        _, scales = quantize_rowmajor(w, fmt)
        assert scales.dtype == torch.float32
        assert scales.tolist() == [[torch.tensor(3.5 / qmax).item(), torch.tensor(0.25 / qmax).item()]]
    _, scales = quantize_rowmajor(torch.zeros(128, 128), BlockFormat())
    assert scales.tolist() == [[1.0]]  # an all-zero block: no division by zero


@pytest.mark.parametrize("fmt", [BlockFormat("fp8_e4m3", 64), BlockFormat("int8", 64)], ids=lambda f: f.name)
def test_tiny_blocks_keep_finite_codes_and_the_error_bound(fmt):
    # amax / qmax of these blocks is a subnormal or rounds to 0 in fp32 (0 / 0 gave NaN codes): the scale floors
    # at the smallest normal fp32, and the blocks of ordinary size keep amax / qmax.
    w = torch.zeros(64, 256)
    w[3, 0:3] = torch.tensor([1e-44, -3e-45, 0.0])  # block 0: amax / qmax rounds to 0
    w[5, 64:67] = torch.tensor([1e-39, -2.5e-40, 7e-41])  # block 1: amax / qmax is subnormal
    w[9, 130], w[10, 200] = 0.5, -1e-3  # blocks 2, 3: ordinary
    codes, scales = quantize_rowmajor(w, fmt)
    tiny = torch.finfo(torch.float32).tiny
    assert scales.tolist() == [[tiny, tiny, (w[9, 130] / fmt.qmax).item(), (-w[10, 200] / fmt.qmax).item()]]
    back = dequantize_rowmajor(codes, scales, fmt)
    assert torch.isfinite(back).all()
    full = scales.repeat_interleave(64, -1).expand_as(w)
    assert torch.all((back - w).abs() <= _bound(w, full, fmt))
    assert torch.equal(dequantize_rowmajor(*quantize_rowmajor(back, fmt), fmt), back)  # re-quantizing keeps values


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_requantization_is_idempotent(fmt):
    w = _inputs("heavy_tailed", (2, 256, 320))
    codes, scales = quantize_block_major(w, fmt)
    again = quantize_block_major(dequantize_block_major(codes, scales, w.shape, fmt), fmt)
    assert torch.equal(_bits(again[0]), _bits(codes)) and torch.equal(again[1], scales)
    # and through bf16 (what a bf16 model would hand back) for fp8 codes: e4m3 values are exact in bf16
    if fmt.kind == "fp8_e4m3":
        bf16 = dequantize_block_major(codes, scales, w.shape, fmt, torch.float32)
        assert torch.equal(quantize_block_major(bf16, fmt)[1], scales)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_tile_ranges_equal_whole_tensor(fmt):
    w = _inputs("normal", (2, 300, 200))
    codes, scales = quantize_block_major(w, fmt)
    flat_codes, flat_scales = codes.reshape(-1, fmt.block_size, fmt.block_size), scales.reshape(-1)
    n = flat_scales.numel()
    for start, end in ((0, 1), (1, n - 2), (n - 3, n), (0, n), (4, 4)):
        c, s = quantize_tile_range(w, fmt, start, end)
        assert torch.equal(_bits(c), _bits(flat_codes[start:end])) and torch.equal(s, flat_scales[start:end])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_block_aligned_row_shards_equal_whole_tensor(fmt):
    b = fmt.block_size
    w = _inputs("heavy_tailed", (4 * b, 3 * b + 17))
    codes, scales = quantize_rowmajor(w, fmt)
    for lo, hi in ((0, b), (b, 3 * b), (3 * b, 4 * b)):
        c, s = quantize_rowmajor(w[lo:hi], fmt)
        assert torch.equal(_bits(c), _bits(codes[lo:hi])) and torch.equal(s, scales[lo // b: hi // b])
    # The check can fail: a shard cut inside a block (half a block of rows) gets other scales.
    c, s = quantize_rowmajor(w[b // 2: b // 2 + b], fmt)
    assert not torch.equal(s, scales[0:1])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_band_pieces_equal_whole_tensor(fmt):
    shape = (3, 2 * fmt.block_size, 150)  # an expert stack, columns not a multiple of the block
    w = _inputs("normal", shape)
    flat = w.reshape(-1)
    band = fmt.block_size * 150
    whole_c, whole_s = quantize_band_piece(flat, shape, 0, flat.numel(), fmt)
    assert torch.equal(_bits(whole_c.view(shape)), _bits(quantize_rowmajor(w, fmt)[0]))
    assert torch.equal(whole_s, quantize_rowmajor(w, fmt)[1].reshape(-1))
    cuts = [0, band, 4 * band, 6 * band]
    per_band_scales = -(-150 // fmt.block_size)
    for lo, hi in itertools.pairwise(cuts):
        c, s = quantize_band_piece(flat[lo:hi], shape, lo, hi, fmt)
        assert torch.equal(_bits(c), _bits(whole_c[lo:hi]))
        assert torch.equal(s, whole_s[lo // band * per_band_scales: hi // band * per_band_scales])
        back = dequantize_band_piece(c, s, shape, lo, hi, fmt, torch.float32)
        assert torch.equal(back, dequantize_rowmajor(*quantize_rowmajor(w, fmt), fmt).reshape(-1)[lo:hi])


def test_bands_are_the_whole_matrix_tiles_the_last_holding_what_remains():
    # 96 rows with 64-blocks: a band of 64 rows and one of 32 per expert, never straddling two experts of the stack;
    # the scales are the (E, Tr, Tc) grid of the whole weight, computed over each tile's real elements.
    fmt = BlockFormat("int8", 64)
    shape = (2, 96, 100)
    w = _inputs("normal", shape)
    c, s = quantize_band_piece(w.reshape(-1), shape, 0, w.numel(), fmt)
    assert s.numel() == 2 * 2 * 2
    assert torch.equal(s, quantize_block_major(w, fmt)[1].reshape(-1))
    assert torch.equal(s.view(2, 2, 2)[:, 1, 0], w[:, 64:, :64].abs().amax(dim=(-2, -1)) / 127)
    whole = dequantize_block_major(*quantize_block_major(w, fmt), shape, fmt)
    assert torch.equal(dequantize_band_piece(c, s, shape, 0, w.numel(), fmt, torch.float32).view(shape), whole)
    # A piece from the second band of expert 0 to the end of expert 1: 3 bands, 6 scales.
    lo = 64 * 100
    c2, s2 = quantize_band_piece(w.reshape(-1)[lo:], shape, lo, w.numel(), fmt)
    assert band_scale_count(shape, lo, w.numel(), fmt) == s2.numel() == 6
    assert torch.equal(dequantize_band_piece(c2, s2, shape, lo, w.numel(), fmt, torch.float32), whole.reshape(-1)[lo:])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_old_gcd_band_tiles_differ_from_the_whole_matrix_tiles(fmt):
    """Negative control: tiles of gcd(rows, b) x b rows (what the quantized AllGather used before) are another format."""
    b = fmt.block_size
    w = _inputs("normal", (300, 256))
    h = math.gcd(300, b)
    old_codes, old_scales = quantize_tiles(w.reshape(300 // h, h, 256 // b, b).transpose(1, 2), fmt)
    old = dequantize_tiles(old_codes, old_scales, fmt).transpose(1, 2).reshape(300, 256)
    new = dequantize_block_major(*quantize_block_major(w, fmt), w.shape, fmt)
    c, s = quantize_band_piece(w.reshape(-1), w.shape, 0, w.numel(), fmt)
    assert torch.equal(dequantize_band_piece(c, s, w.shape, 0, w.numel(), fmt, torch.float32).view(w.shape), new)
    assert (old != new).sum() > 1000 and old_scales.numel() > 10 * s.numel()


def test_rowmajor_to_block_major_moves_codes_without_requantizing():
    fmt = BlockFormat("fp8_e4m3", 128)
    w = _inputs("normal", (300, 260))
    codes, scales = quantize_rowmajor(w, fmt)
    # Scales that are not what quantization would give: a conversion that re-quantized would change codes.
    odd_scales = scales * 2
    block_codes, block_scales = rowmajor_to_block_major(codes, odd_scales, fmt)
    assert torch.equal(block_scales, odd_scales)
    assert torch.equal(_bits(block_codes), _bits(to_tiles(codes.view(torch.uint8), 128)))
    assert torch.equal(
        dequantize_block_major(block_codes, block_scales, w.shape, fmt), dequantize_rowmajor(codes, odd_scales, fmt)
    )


# -- negative controls and bad input ------------------------------------------------------------------------


def test_a_piece_cutting_a_tile_is_refused():
    fmt = BlockFormat("fp8_e4m3", 64)
    with pytest.raises(BlockCutError, match="inside tile 1"):
        tile_range_of(0, 64 * 64 + 64, fmt, "rank 1")
    assert tile_range_of(64 * 64, 3 * 64 * 64, fmt, "ok") == (1, 3)


def test_a_piece_cutting_a_band_is_refused():
    fmt = BlockFormat("int8", 128)
    shape = (256, 100)
    w = torch.randn(shape)
    with pytest.raises(BlockCutError, match="inside a band of 128 rows"):
        quantize_band_piece(w.reshape(-1)[: 64 * 100], shape, 0, 64 * 100, fmt)
    with pytest.raises(BlockCutError, match="between bands"):
        dequantize_band_piece(torch.zeros(100, dtype=torch.int8), torch.ones(1), shape, 100, 200, fmt, torch.float32)


@pytest.mark.parametrize("bad", ["transposed", "block_64", "float16"])
def test_wrong_scale_layout_is_refused(bad):
    fmt = BlockFormat("fp8_e4m3", 128)
    codes, scales = quantize_rowmajor(torch.randn(384, 256), fmt)  # scales (3, 2)
    wrong = {"transposed": scales.t().contiguous(), "block_64": torch.ones(6, 4),
             "float16": scales.to(torch.float16)}[bad]
    with pytest.raises(ValueError, match="scales"):
        dequantize_rowmajor(codes, wrong, fmt)
    with pytest.raises(ValueError, match="scales"):
        rowmajor_to_block_major(codes, wrong, fmt)
    block_codes, _ = rowmajor_to_block_major(codes, scales, fmt)
    with pytest.raises(ValueError, match="scales"):
        dequantize_block_major(block_codes, wrong, (384, 256), fmt)


def test_unsupported_dtypes_and_shapes_are_refused():
    fmt = BlockFormat("int8", 128)
    with pytest.raises(TypeError, match="integer tensors are not weights"):
        quantize_block_major(torch.ones(128, 128, dtype=torch.int32), fmt)
    with pytest.raises(TypeError, match="float8 tensors are codes already"):
        quantize_rowmajor(torch.ones(128, 128).to(torch.float8_e4m3fn), fmt)
    with pytest.raises(ValueError, match="Leave 1-D tensors"):
        quantize_block_major(torch.ones(128), fmt)
    with pytest.raises(TypeError, match="must be torch.int8"):
        dequantize_rowmajor(torch.zeros(128, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1), fmt)


@pytest.mark.parametrize("block_size", [0, -128, 12.5, True])
def test_bad_block_sizes_are_refused(block_size):
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        BlockFormat("fp8_e4m3", block_size)


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="supported: 'fp8_e4m3'"):
        BlockFormat("nf4")
    assert BlockFormat("fp8_block").kind == "fp8_e4m3" and BlockFormat("int8_block").kind == "int8"


# -- tile-major masters (quantize_all_gather layout="block_major") ---------------------------------------------------
TILE_MAJOR_SHAPES = [(300, 256), (257, 130), (576, 512), (2, 192, 320), (2, 64, 256), (64, 384)]


@pytest.mark.parametrize("shape", TILE_MAJOR_SHAPES)
def test_tile_major_round_trips_and_its_boxes_are_the_tiles(shape):
    b = 128
    assert tile_order_granule(shape, b) == (b * b, math.prod(shape))
    w = torch.randn(shape)
    flat = to_tile_order(w, b)
    assert torch.equal(from_tile_order(flat, shape, b), w)
    pos = 0
    for offsets, sizes in tile_boxes(shape, b, 0, w.numel()):  # each box is contiguous in the tile-major storage
        n = math.prod(sizes)
        box = w[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        assert torch.equal(box.reshape(-1), flat[pos: pos + n]), (offsets, sizes)
        assert sizes[-1] <= b and (sizes[-2] <= b or sizes[-1] == w.shape[-1] % b)  # a tile, or right-edge tiles
        pos += n
    assert pos == w.numel()


@pytest.mark.parametrize("fmt", [BlockFormat("fp8_e4m3", 128), BlockFormat("int8", 128)], ids=lambda f: f.name)
@pytest.mark.parametrize("shape", TILE_MAJOR_SHAPES)
def test_tile_major_pieces_at_any_granule_edge_equal_the_whole_matrix_tiles(fmt, shape):
    """Cut at every multiple of b*b (every granule edge the planner may use): each piece quantized alone and
    dequantized straight into the row-major weight gives DeepSeek's whole-matrix quantize-dequantize bitwise."""
    w = _inputs("heavy_tailed", shape)
    flat = to_tile_order(w, 128)
    edges = list(range(0, w.numel(), 128 * 128)) + [w.numel()]
    out = torch.empty(shape, dtype=torch.bfloat16)
    scales = 0
    for lo, hi in zip(edges, edges[1:]):
        codes, s = quantize_tile_piece(flat[lo:hi], shape, lo, hi, fmt)
        assert s.numel() == tile_scale_count(shape, lo, hi, 128)
        scales += s.numel()
        dequantize_tile_piece_into(out, codes, s, lo, hi, fmt)
    assert scales == math.prod(tile_grid(shape, 128))
    want = dequantize_block_major(*quantize_block_major(w, fmt), shape, fmt, torch.bfloat16)
    assert torch.equal(out, want)


def test_tile_order_refuses_shapes_whose_edge_tiles_split_a_granule():
    # 200 rows: 72-row edge tiles (9216 elements) do not pair up into 16384; C = 128: a band is a tile column already.
    assert tile_order_granule((200, 384), 128) is None and tile_order_granule((3, 200, 130), 128) is None
    assert tile_order_granule((512, 128), 128) is None
    with pytest.raises(BlockCutError, match="cuts a 128x128 tile"):
        quantize_tile_piece(torch.zeros(100), (300, 256), 0, 100, BlockFormat("fp8_e4m3", 128))

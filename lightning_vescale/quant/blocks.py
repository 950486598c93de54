"""Tile layouts of block-quantized weights: block-major storage, the Hugging Face row-major form, row bands.

Shape letters: ``E`` experts, ``R`` rows, ``C`` columns of one matrix; ``Tr = ceil(R / b)``, ``Tc = ceil(C / b)``
tiles per column and row of it, ``b`` the block size.

[Note: three layouts of the same blocks]
* **Block-major** (how a frozen quantized base is stored and sharded): codes of shape ``(E?, Tr, Tc, b, b)``,
  every tile contiguous, tiles in row-major order of the tile grid; scales ``(E?, Tr, Tc)``. A weight whose
  rows or columns are not multiples of ``b`` is **padded to whole tiles** with zeros (as DeepSeek-V3's
  ``weight_scale_inv`` grid is ``ceil(R/128) x ceil(C/128)``): the padded codes are zeros and are cropped on
  dequantization. Every 2-D tensor then has the same granule, one tile of ``b * b`` codes, so a planner cut
  at a tile boundary never splits a block, whatever the tensor's width.
* **Row-major** (Hugging Face FP8 checkpoints): codes ``(E?, R, C)`` as the weight, scales ``(E?, Tr, Tc)``
  (``weight_scale_inv``). :func:`rowmajor_to_block_major` converts codes and scales without touching a value.
* **Row bands** (the wire format of a quantized AllGather of trained weights): the fp32 master stays
  row-major and a rank's piece is whole bands of ``b`` rows of each matrix (the last band of a matrix holding
  the ``R - (Tr - 1) * b`` rows that remain; the planner cuts at ``granularity=b``). Each band is quantized in
  its ``b x b`` tiles (the last one narrower when ``C % b != 0``), so the tiles and scales are exactly those of
  the row-major form of the whole weight, DeepSeek's ``ceil(R/b) x ceil(C/b)`` grid. Codes keep the piece's
  row-major order, so the codes of a group are a byte-for-byte mirror of its fp32 buffer.

Pieces of any of these must be whole tiles (bands); a piece that cuts one raises :class:`BlockCutError`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from lightning_vescale.quant.formats import (
    BlockFormat,
    check_quantizable,
    dequantize_tiles,
    quantize_tiles,
)

__all__ = [
    "BlockCutError",
    "TileOrder",
    "band_granule",
    "band_scale_count",
    "band_scale_counts",
    "block_major_to_rowmajor",
    "check_scales",
    "codes_shape",
    "dequantize_band_piece",
    "dequantize_block_major",
    "dequantize_rowmajor",
    "from_tiles",
    "quantize_band_piece",
    "quantize_block_major",
    "quantize_rowmajor",
    "quantize_tile_range",
    "rowmajor_to_block_major",
    "copy_tile_range",
    "dequantize_tile_piece_into",
    "from_tile_order",
    "quantize_tile_piece",
    "tile_boxes",
    "tile_grid",
    "tile_order_granule",
    "tile_scale_count",
    "to_tile_order",
    "to_tiles",
]

Shape = tuple[int, ...]


class BlockCutError(ValueError):
    """A piece of a block-quantized tensor does not consist of whole blocks (a rank boundary inside a block)."""


def _matrix_shape(shape: Sequence[int]) -> Shape:
    shape = tuple(int(s) for s in shape)
    if len(shape) not in (2, 3):
        raise ValueError(
            f"block quantization takes 2-D weights (rows, cols) and 3-D expert stacks (experts, rows, cols); got a "
            f"tensor of shape {shape}. Leave 1-D tensors (norms, biases) unquantized."
        )
    return shape


def tile_grid(shape: Sequence[int], block_size: int) -> Shape:
    """``(E?, Tr, Tc)``: the tiles of a ``(E?, R, C)`` weight, partial tiles at the edges counted whole."""
    shape = _matrix_shape(shape)
    *lead, rows, cols = shape
    return (*lead, -(-rows // block_size), -(-cols // block_size))


def codes_shape(shape: Sequence[int], block_size: int) -> Shape:
    """Shape of the block-major codes of a weight of ``shape``: ``(E?, Tr, Tc, b, b)``."""
    return (*tile_grid(shape, block_size), block_size, block_size)


def to_tiles(w: torch.Tensor, block_size: int) -> torch.Tensor:
    """``(E?, R, C)`` -> block-major ``(E?, Tr, Tc, b, b)``, zero-padded to whole tiles (a new tensor)."""
    *lead, tr, tc = tile_grid(w.shape, block_size)
    b = block_size
    rows, cols = w.shape[-2:]
    padded = F.pad(w, (0, tc * b - cols, 0, tr * b - rows)) if (tr * b, tc * b) != (rows, cols) else w
    return padded.reshape(*lead, tr, b, tc, b).transpose(-3, -2).contiguous()


def from_tiles(tiles: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Block-major ``(E?, Tr, Tc, b, b)`` -> the row-major ``shape`` ``(E?, R, C)`` (padding cropped)."""
    shape = _matrix_shape(shape)
    *lead, tr, tc, b, b2 = tiles.shape
    full = tiles.transpose(-3, -2).reshape(*lead, tr * b, tc * b2)
    return full[..., : shape[-2], : shape[-1]].contiguous()


def check_scales(shape: Sequence[int], scales: torch.Tensor, fmt: BlockFormat, what: str) -> None:
    """Raise ``ValueError`` unless ``scales`` is the fp32 ``(E?, Tr, Tc)`` grid of a ``shape`` weight."""
    want = tile_grid(shape, fmt.block_size)
    if tuple(scales.shape) != want:
        raise ValueError(
            f"{what}: the scales have shape {tuple(scales.shape)} but a weight of shape {tuple(shape)} in "
            f"{fmt.block_size}x{fmt.block_size} blocks has {want} (one scale per block, ceil(rows / "
            f"{fmt.block_size}) x ceil(cols / {fmt.block_size})). The scales belong to another weight or another "
            f"block size: check weight_block_size in quantization_config."
        )
    if scales.dtype != torch.float32:
        raise ValueError(f"{what}: the scales are {scales.dtype}; block scales are float32")


# -- block-major (frozen storage) ---------------------------------------------------------------------------


def quantize_block_major(w: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a ``(E?, R, C)`` weight to block-major codes ``(E?, Tr, Tc, b, b)`` and scales ``(E?, Tr, Tc)``."""
    _matrix_shape(w.shape)
    check_quantizable(w, "the weight to quantize")
    return quantize_tiles(to_tiles(w, fmt.block_size), fmt)


def quantize_tile_range(
    w: torch.Tensor, fmt: BlockFormat, start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``(end - start, b, b)`` and scales ``(end - start,)`` of tiles ``[start, end)`` (block-major order).

    What a rank holding those tiles computes from the full weight: bitwise the same as those tiles of
    :func:`quantize_block_major`.
    """
    check_quantizable(w, "the weight to quantize")
    tiles = to_tiles(w, fmt.block_size).reshape(-1, fmt.block_size, fmt.block_size)
    if not 0 <= start <= end <= tiles.shape[0]:
        raise ValueError(f"tile range [{start}, {end}) is outside the {tiles.shape[0]} tiles of a {tuple(w.shape)} weight")
    return quantize_tiles(tiles[start:end], fmt)


def dequantize_block_major(
    codes: torch.Tensor, scales: torch.Tensor, shape: Sequence[int], fmt: BlockFormat, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The ``shape`` weight from block-major ``codes`` and ``scales`` (checked against each other and ``shape``)."""
    want = codes_shape(shape, fmt.block_size)
    if tuple(codes.shape) != want:
        raise ValueError(f"block-major codes of a {tuple(shape)} weight must have shape {want}, got {tuple(codes.shape)}")
    check_scales(shape, scales, fmt, "dequantize")
    return from_tiles(dequantize_tiles(codes, scales, fmt, dtype), shape)


def tile_range_of(start: int, end: int, fmt: BlockFormat, what: str) -> tuple[int, int]:
    """Tiles ``[start // b^2, end // b^2)`` of a flat code range, which must hold whole tiles."""
    n = fmt.tile_numel
    if start % n or end % n:
        bad = start if start % n else end
        raise BlockCutError(
            f"{what}: the piece [{start}, {end}) of the block-major codes is cut at {bad}, inside tile {bad // n} "
            f"({fmt.block_size}x{fmt.block_size} = {n} codes per tile): a rank boundary must fall between tiles. "
            f"Shard block-quantized weights with a granularity of one tile."
        )
    return start // n, end // n


# -- row-major (Hugging Face checkpoints) ---------------------------------------------------------------------


def quantize_rowmajor(w: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``(E?, R, C)`` to row-major codes of the same shape and scales ``(E?, Tr, Tc)``: the
    ``weight`` / ``weight_scale_inv`` pair of a DeepSeek-V3 style FP8 checkpoint."""
    codes, scales = quantize_block_major(w, fmt)
    return block_major_to_rowmajor(codes, w.shape), scales


def block_major_to_rowmajor(codes: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Block-major codes -> row-major codes of ``shape`` (padding dropped; values untouched)."""
    return from_tiles(codes.view(torch.uint8), shape).view(codes.dtype)


def rowmajor_to_block_major(
    codes: torch.Tensor, scales: torch.Tensor, fmt: BlockFormat, what: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major codes and their scales (a checkpoint's ``weight`` / ``weight_scale_inv``) -> block-major codes
    and the same scales. Values are moved, never re-quantized; padding codes are zero."""
    if codes.dtype != fmt.code_dtype:
        raise TypeError(f"{what}: codes of format {fmt.name} must be {fmt.code_dtype}, got {codes.dtype}")
    check_scales(codes.shape, scales, fmt, what)
    return to_tiles(codes.view(torch.uint8), fmt.block_size).view(fmt.code_dtype), scales.contiguous()


def dequantize_rowmajor(
    codes: torch.Tensor, scales: torch.Tensor, fmt: BlockFormat, dtype: torch.dtype = torch.float32, what: str = "weight"
) -> torch.Tensor:
    """The weight from row-major codes and their ``(E?, Tr, Tc)`` scales (a checkpoint's FP8 pair)."""
    if codes.dtype != fmt.code_dtype:
        raise TypeError(f"{what}: codes of format {fmt.name} must be {fmt.code_dtype}, got {codes.dtype}")
    check_scales(codes.shape, scales, fmt, what)
    b = fmt.block_size
    rows, cols = codes.shape[-2:]
    full = scales.repeat_interleave(b, dim=-2).repeat_interleave(b, dim=-1)[..., :rows, :cols]
    return (codes.to(torch.float32) * full).to(dtype)


# -- row bands (quantized AllGather of trained weights) --------------------------------------------------------


def band_granule(shape: Sequence[int], block_size: int) -> tuple[int, int]:
    """``(granule, period)`` of the bands of a ``(E?, R, C)`` weight (as :func:`lightning_vescale.engine.planner.granule`
    gives for ``block_size`` rows): ``b * C`` elements, restarting at every matrix (``R * C``), the last band of
    each matrix holding the ``R - (Tr - 1) * b`` rows that remain."""
    *_, rows, cols = _matrix_shape(shape)
    return min(block_size, rows) * cols, rows * cols


def _bands_before(x, rows: int, cols: int, b: int):
    """Bands of ``(E?, rows, cols)`` matrices that start before the flat offset ``x`` (an int or an int64 tensor)."""
    per_matrix = rows * cols
    return (x // per_matrix) * -(-rows // b) + -(-(x % per_matrix) // (b * cols))


def _bands(shape: Sequence[int], start: int, end: int, fmt: BlockFormat, what: str) -> tuple[int, int, int]:
    """``(bands, rows, cols)`` of the piece ``[start, end)``, which must start and end at band edges."""
    shape = _matrix_shape(shape)
    rows, cols, b = shape[-2], shape[-1], fmt.block_size
    per_matrix, g = rows * cols, b * cols
    for off in (start, end):
        if off % per_matrix % g:
            row = off % per_matrix // cols
            raise BlockCutError(
                f"{what}: the piece [{start}, {end}) of a {shape} weight is cut at element {off} (row {row} of its "
                f"matrix, column {off % cols}), inside a band of {b} rows that is quantized as a row of {b}x{b} "
                f"tiles: a rank boundary must fall between bands. Shard quantized-gather weights with a granularity "
                f"of {b} rows (granularity={b})."
            )
    return _bands_before(end, rows, cols, b) - _bands_before(start, rows, cols, b), rows, cols


def band_scale_count(shape: Sequence[int], start: int, end: int, fmt: BlockFormat) -> int:
    """Number of scales of the piece ``[start, end)`` (whole bands) of a ``shape`` weight: ``Tc`` per band."""
    if end <= start:
        return 0
    bands, _, cols = _bands(shape, start, end, fmt, "band_scale_count")
    return bands * -(-cols // fmt.block_size)


def band_scale_counts(shape: Sequence[int], starts: torch.Tensor, ends: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """:func:`band_scale_count` of many pieces at once (int64 tensors of band-edge offsets; not checked)."""
    *_, rows, cols = _matrix_shape(shape)
    b = fmt.block_size
    count = _bands_before(ends, rows, cols, b) - _bands_before(starts, rows, cols, b)
    return torch.where(ends > starts, count, 0) * -(-cols // b)


def _band_rows(start: int, end: int, rows: int, cols: int, b: int) -> tuple[int, int, Optional[torch.Tensor]]:
    """The piece's rows in a layout where every matrix is padded to whole bands (``Tr * b`` rows): its first padded
    row, its padded row count, and where each real row goes (None when no matrix is padded: rows ``0, 1, ...``)."""
    tr = -(-rows // b)
    r0, r1 = start // cols, end // cols

    def padded(r):
        return (r // rows) * tr * b + r % rows

    p0 = padded(r0)
    n = (r1 // rows) * tr * b + r1 % rows - p0
    if rows % b == 0:
        return p0, n, None
    return p0, n, padded(torch.arange(r0, r1)) - p0


def quantize_band_piece(
    piece: torch.Tensor, shape: Sequence[int], start: int, end: int, fmt: BlockFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the flat piece ``[start, end)`` of a ``shape`` weight (whole bands) in its ``b x b`` tiles.

    The tiles are DeepSeek's ``ceil(R / b) x ceil(C / b)`` grid of each matrix: the last tile row and column hold
    what remains, and each scale is computed over the tile's real elements only. Returns flat row-major codes
    (``end - start``) and flat scales (:func:`band_scale_count`, in the grid's row-major order), bitwise the codes
    and scales of that piece in :func:`quantize_rowmajor` of the whole weight.
    """
    if end <= start:
        return piece.new_empty(0, dtype=fmt.code_dtype), piece.new_empty(0, dtype=torch.float32)
    bands, rows, cols = _bands(shape, start, end, fmt, "quantize")
    b = fmt.block_size
    tc = -(-cols // b)
    _, n, dest = _band_rows(start, end, rows, cols, b)
    x = piece.reshape(-1, cols)
    if dest is not None or tc * b != cols:  # zeros change no amax: the scales are those of the real elements
        padded = x.new_zeros(n, tc * b)
        if dest is None:
            padded[:, :cols] = x
        else:
            padded[dest, :cols] = x
        x = padded
    codes, scales = quantize_tiles(x.reshape(bands, b, tc, b).transpose(1, 2), fmt)  # (bands, Tc, b, b), (bands, Tc)
    codes = codes.view(torch.uint8).transpose(1, 2).reshape(n, tc * b)
    codes = codes[:, :cols] if dest is None else codes[dest, :cols]
    return codes.reshape(-1).view(fmt.code_dtype), scales.reshape(-1)


def dequantize_band_piece(
    codes: torch.Tensor, scales: torch.Tensor, shape: Sequence[int], start: int, end: int, fmt: BlockFormat,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The flat values of the piece ``[start, end)`` from its codes and scales (see :func:`quantize_band_piece`)."""
    if end <= start:
        return codes.new_empty(0, dtype=dtype)
    bands, rows, cols = _bands(shape, start, end, fmt, "dequantize")
    b = fmt.block_size
    tc = -(-cols // b)
    if scales.numel() != bands * tc or codes.numel() != end - start:
        raise ValueError(
            f"dequantize: a piece of {bands} bands of {cols} columns needs {end - start} codes and {bands * tc} "
            f"scales, got {codes.numel()} and {scales.numel()}"
        )
    per_column = scales.reshape(bands, tc).repeat_interleave(b, dim=-1)[:, :cols]  # (bands, C)
    _, _, dest = _band_rows(start, end, rows, cols, b)
    if dest is None:
        values = codes.reshape(bands, -1, cols).to(torch.float32) * per_column[:, None, :]
    else:
        values = codes.reshape(-1, cols).to(torch.float32) * per_column[dest // b]
    return values.to(dtype).reshape(-1)


# -- tile-major (the master layout of a quantized AllGather of trained weights) --------------------------------
#
# [Note: tile-major master pieces]
# A trained weight under a block-quantized AllGather may keep its fp32 master *tile-major*: each matrix flattened
# tile by tile, every tile contiguous and row-major inside, so that a rank boundary can fall between any two tiles
# (one tile of ``b * b`` elements as the cut granule, whatever the matrix's width) instead of only between bands of
# ``b`` rows (``b * C`` elements). Tiles at the matrix edge hold the remainder (DeepSeek's ``ceil(R/b) x
# ceil(C/b)`` grid, no padding stored), and the tiles of a matrix are ordered by region so that every multiple of
# ``b * b`` elements into the matrix is a tile edge:
#
#   A  the ``Rf x Cf`` full tiles (``Rf = R // b``, ``Cf = C // b``) in row-major order of the grid;
#   B  the right edge: the ``Rf`` tiles of ``b x (C % b)``, top to bottom (the submatrix ``W[:Rf*b, Cf*b:]``
#      row-major);
#   C  the bottom edge: the ``Cf`` tiles of ``(R % b) x b``, left to right;
#   D  the corner ``(R % b) x (C % b)``.
#
# A 3-D expert stack keeps each region of all its experts together (region A of expert 0, 1, ..., then B of expert
# 0, 1, ...), so the edge tiles of consecutive experts pair up into whole granules too. The planner then sees
# granules of ``b * b`` elements over the whole tensor (the last one shorter), as :func:`tile_order_granule`
# returns. Shapes whose edge tiles would put a multiple of ``b * b`` inside
# a tile (e.g. ``R % b`` not dividing ``b``) keep the row-band layout.

_Region = tuple[int, int, int, int, int]  # (start in the flat tensor, tiles, tile rows, tile cols, region id)


def _regions(experts: int, rows: int, cols: int, b: int) -> list[_Region]:
    rf, cf, rr, cr = rows // b, cols // b, rows % b, cols % b
    out, start = [], 0
    for rid, (n, th, tw) in enumerate(((rf * cf, b, b), (rf if cr else 0, b, cr), (cf if rr else 0, rr, b),
                                        (1 if rr and cr else 0, rr, cr))):
        if n:
            out.append((start, experts * n, th, tw, rid))
            start += experts * n * th * tw
    return out


def _stack(shape: Sequence[int]) -> tuple[int, int, int]:
    *lead, rows, cols = _matrix_shape(shape)
    return (lead[0] if lead else 1), rows, cols


@functools.lru_cache(maxsize=4096)
def tile_order_granule(shape: tuple[int, ...], block_size: int) -> Optional[tuple[int, int]]:
    """``(b * b, numel)``: the cut granule and period of a ``(E?, R, C)`` weight stored tile-major (see [Note:
    tile-major master pieces]), or None where tile-major gains nothing over row bands (``C <= b``: a band is a tile
    column already) or some multiple of ``b * b`` would fall inside an edge tile."""
    experts, rows, cols = _stack(shape)
    b, g = block_size, block_size * block_size
    if cols <= b or rows * cols == 0:
        return None
    for start, n, th, tw, _ in _regions(experts, rows, cols, b):
        t, end = th * tw, start + n * th * tw
        first = -(-start // g) * g
        if first < end and ((first - start) % t or (first + g < end and g % t)):
            return None
    return g, experts * rows * cols


def _region_views(mats: torch.Tensor, region: _Region, b: int, t0: int, t1: int) -> list[torch.Tensor]:
    """Views ``(n, th, tw)`` of the row-major matrices ``mats`` ``(E, R, C)`` holding tiles ``[t0, t1)`` of
    ``region`` (expert by expert), in order."""
    _, n, th, tw, rid = region
    experts, rows, cols = mats.shape
    rf, cf = rows // b, cols // b
    per = n // experts
    views: list[torch.Tensor] = []
    t = t0
    while t < t1:
        e, u = divmod(t, per)
        v = min(per, u + t1 - t)
        m = mats[e]
        if rid == 0:
            grid = m[: rf * b, : cf * b].unflatten(0, (rf, b)).unflatten(2, (cf, b)).permute(0, 2, 1, 3)
            w = u
            while w < v:
                i, j = divmod(w, cf)
                k = min(cf, j + v - w)
                views.append(grid[i, j:k])
                w += k - j
        elif rid == 1:
            views.append(m[: rf * b, cf * b:].unflatten(0, (rf, b))[u:v])
        elif rid == 2:
            views.append(m[rf * b:, : cf * b].unflatten(1, (cf, b)).permute(1, 0, 2)[u:v])
        else:
            views.append(m[rf * b:, cf * b:].unsqueeze(0))
        t += v - u
    return views


def _tile_segments(shape: Sequence[int], b: int, start: int, end: int, what: str):
    """``(region, t0, t1, lo, hi)`` for the tiles of the flat tile-major range ``[start, end)``, which must start
    and end at tile edges; ``[lo, hi)`` is the segment's flat range."""
    experts, rows, cols = _stack(shape)
    for region in _regions(experts, rows, cols, b):
        rs, n, th, tw, _ = region
        t = th * tw
        lo, hi = max(start, rs), min(end, rs + n * t)
        if lo >= hi:
            continue
        if (lo - rs) % t or (hi - rs) % t:
            raise BlockCutError(
                f"{what}: the piece [{start}, {end}) of a tile-major {tuple(shape)} weight cuts a {th}x{tw} tile: "
                f"a rank boundary must fall between tiles")
        yield region, (lo - rs) // t, (hi - rs) // t, lo, hi


def tile_scale_count(shape: Sequence[int], start: int, end: int, block_size: int) -> int:
    """Tiles (so scales) in the flat tile-major range ``[start, end)`` (whole tiles) of a ``shape`` weight."""
    if end <= start:
        return 0
    return sum(t1 - t0 for _, t0, t1, _, _ in _tile_segments(shape, block_size, start, end, "tile_scale_count"))


def to_tile_order(w: torch.Tensor, block_size: int) -> torch.Tensor:
    """A row-major ``(E?, R, C)`` weight as its flat tile-major storage (a new tensor)."""
    out = w.new_empty(w.numel())
    copy_tile_range(out, w, block_size, 0, w.numel(), to_tiles=True)
    return out


def from_tile_order(flat: torch.Tensor, shape: Sequence[int], block_size: int) -> torch.Tensor:
    """The row-major ``shape`` weight from its flat tile-major storage (a new tensor)."""
    out = flat.new_empty(tuple(shape))
    copy_tile_range(flat.reshape(-1), out, block_size, 0, out.numel(), to_tiles=False)
    return out


def copy_tile_range(flat: torch.Tensor, w: torch.Tensor, block_size: int, start: int, end: int, *,
                    to_tiles: bool) -> None:
    """Copy between ``flat`` (the tile-major elements ``[start, end)``, whole tiles) and the row-major weight ``w``:
    ``to_tiles`` reads ``w``, else writes it."""
    mats = _matrices(w)
    for region, t0, t1, lo, _ in _tile_segments(w.shape, block_size, start, end, "copy"):
        pos = lo - start
        for view in _region_views(mats, region, block_size, t0, t1):
            n = view.numel()
            part = flat[pos: pos + n].view(view.shape)
            if to_tiles:
                part.copy_(view)
            else:
                view.copy_(part)
            pos += n


def tile_boxes(shape: Sequence[int], block_size: int, start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """N-D ``(offsets, sizes)`` boxes of the flat tile-major range ``[start, end)``, each contiguous there, in order:
    one per tile (an expert's right-edge tiles merged, as they lie row-major)."""
    shape = _matrix_shape(shape)
    experts, rows, cols = _stack(shape)
    lead = len(shape) == 3
    b = block_size
    rf, cf = rows // b, cols // b
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for (_, n, th, tw, rid), t0, t1, _, _ in _tile_segments(shape, b, start, end, "boxes"):
        per = n // experts
        t = t0
        while t < t1:
            e, u = divmod(t, per)
            v = min(per, u + t1 - t)
            pre, one = ((e,), (1,)) if lead else ((), ())
            if rid == 0:
                out += [((*pre, w // cf * b, w % cf * b), (*one, b, b)) for w in range(u, v)]
            elif rid == 1:
                out.append(((*pre, u * b, cf * b), (*one, (v - u) * b, tw)))
            elif rid == 2:
                out += [((*pre, rf * b, w * b), (*one, th, b)) for w in range(u, v)]
            else:
                out.append(((*pre, rf * b, cf * b), (*one, th, tw)))
            t += v - u
    return out


def quantize_tile_piece(piece: torch.Tensor, shape: Sequence[int], start: int, end: int, fmt: BlockFormat
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the flat tile-major piece ``[start, end)`` (whole tiles) of a ``shape`` weight: codes in the piece's
    order and one scale per tile (in tile order), bitwise those tiles of :func:`quantize_rowmajor` of the whole
    weight (each scale over the tile's real elements)."""
    codes = torch.empty(end - start, dtype=fmt.code_dtype, device=piece.device)
    scales = []
    for (_, _, th, tw, _), t0, t1, lo, hi in _tile_segments(shape, fmt.block_size, start, end, "quantize"):
        c, sc = quantize_tiles(piece[lo - start: hi - start].view(t1 - t0, th, tw), fmt)
        codes[lo - start: hi - start] = c.reshape(-1)
        scales.append(sc)
    return codes, (torch.cat(scales) if scales else piece.new_empty(0, dtype=torch.float32))


def dequantize_tile_piece_into(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, start: int, end: int,
                               fmt: BlockFormat) -> None:
    """Dequantize the codes and scales of the tile-major piece ``[start, end)`` straight into the row-major weight
    ``out`` (tile-major -> row-major in the same pass)."""
    mats, b, k = _matrices(out), fmt.block_size, 0
    for region, t0, t1, lo, hi in _tile_segments(out.shape, b, start, end, "dequantize"):
        _, _, th, tw, _ = region
        values = dequantize_tiles(codes[lo - start: hi - start].view(t1 - t0, th, tw), scales[k: k + t1 - t0], fmt,
                                  out.dtype)
        k += t1 - t0
        pos = 0
        for view in _region_views(mats, region, b, t0, t1):
            view.copy_(values[pos: pos + view.shape[0]])
            pos += view.shape[0]


@dataclass(frozen=True)
class TileOrder:
    """The :class:`~lightning_vescale.engine.tensor.ElementOrder` of a weight kept tile-major in ``block_size`` tiles."""

    block_size: int

    def take(self, full: torch.Tensor, start: int, end: int) -> torch.Tensor:
        out = full.new_empty(end - start)
        copy_tile_range(out, full, self.block_size, start, end, to_tiles=True)
        return out

    def to_rowmajor(self, flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return from_tile_order(flat, shape, self.block_size)

    def boxes(self, shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return tile_boxes(shape, self.block_size, start, end)


def _matrices(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(-1, *w.shape[-2:])

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
  row-major, a rank's piece is whole bands of ``h = gcd(R, b)`` rows, and each band is quantized in ``h x b``
  tiles (the last one narrower when ``C % b != 0``). Codes keep the piece's row-major order, so the codes of
  a group are a byte-for-byte mirror of its fp32 buffer.

Pieces of any of these must be whole tiles (bands); a piece that cuts one raises :class:`BlockCutError`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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
    "band_rows",
    "band_scale_count",
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
    "tile_grid",
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


def band_rows(shape: Sequence[int], block_size: int) -> int:
    """Rows ``h`` of one band: ``gcd(R, b)`` for a ``(E?, R, C)`` weight, so bands never straddle two experts."""
    return math.gcd(int(_matrix_shape(shape)[-2]), block_size)


def band_granularity(shape: Sequence[int], block_size: int) -> int:
    """Elements of one band (``h * C``): the cut granularity that keeps every band on one rank."""
    return band_rows(shape, block_size) * int(shape[-1])


def _bands(shape: Sequence[int], start: int, end: int, fmt: BlockFormat, what: str) -> tuple[int, int, int]:
    shape = _matrix_shape(shape)
    h, cols = band_rows(shape, fmt.block_size), shape[-1]
    g = h * cols
    if start % g or end % g:
        bad = start if start % g else end
        raise BlockCutError(
            f"{what}: the piece [{start}, {end}) of a {shape} weight is cut at element {bad}, inside a band of {h} "
            f"rows ({g} elements) that is quantized as one row of {fmt.block_size}-column blocks: a rank boundary "
            f"must fall between bands. Shard quantized-gather weights with a granularity of {h} rows."
        )
    return (end - start) // g, h, cols


def band_scale_count(shape: Sequence[int], start: int, end: int, fmt: BlockFormat) -> int:
    """Number of scales of the piece ``[start, end)`` (whole bands) of a ``shape`` weight."""
    if end <= start:
        return 0
    bands, _, cols = _bands(shape, start, end, fmt, "band_scale_count")
    return bands * -(-cols // fmt.block_size)


def _band_tiles(x: torch.Tensor, bands: int, h: int, cols: int, b: int) -> torch.Tensor:
    tc = -(-cols // b)
    x = x.reshape(bands, h, cols)
    if tc * b != cols:
        x = F.pad(x, (0, tc * b - cols))
    return x.reshape(bands, h, tc, b).transpose(1, 2)  # (bands, Tc, h, b)


def quantize_band_piece(
    piece: torch.Tensor, shape: Sequence[int], start: int, end: int, fmt: BlockFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the flat piece ``[start, end)`` of a ``shape`` weight (whole bands) in ``h x b`` tiles.

    Returns flat row-major codes (``end - start``) and flat scales (:func:`band_scale_count`), bitwise the
    codes and scales of that piece when the whole weight is quantized band by band.
    """
    if end <= start:
        return piece.new_empty(0, dtype=fmt.code_dtype), piece.new_empty(0, dtype=torch.float32)
    bands, h, cols = _bands(shape, start, end, fmt, "quantize")
    b = fmt.block_size
    codes, scales = quantize_tiles(_band_tiles(piece, bands, h, cols, b), fmt)  # (bands, Tc, h, b), (bands, Tc)
    codes = codes.transpose(1, 2).reshape(bands, h, -1)[..., :cols]
    return codes.reshape(-1), scales.reshape(-1)


def dequantize_band_piece(
    codes: torch.Tensor, scales: torch.Tensor, shape: Sequence[int], start: int, end: int, fmt: BlockFormat,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The flat values of the piece ``[start, end)`` from its band codes and scales (see :func:`quantize_band_piece`)."""
    if end <= start:
        return codes.new_empty(0, dtype=dtype)
    bands, h, cols = _bands(shape, start, end, fmt, "dequantize")
    b = fmt.block_size
    tc = -(-cols // b)
    if scales.numel() != bands * tc or codes.numel() != end - start:
        raise ValueError(
            f"dequantize: a piece of {bands} bands of {cols} columns needs {end - start} codes and {bands * tc} "
            f"scales, got {codes.numel()} and {scales.numel()}"
        )
    full = scales.reshape(bands, 1, tc).repeat_interleave(b, dim=-1)[..., :cols]  # (bands, 1, C)
    return (codes.reshape(bands, h, cols).to(torch.float32) * full).to(dtype).reshape(-1)

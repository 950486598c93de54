"""Block-quantization formats and the per-block math (pure torch; runs on any device).

[Note: the formats]
A weight is cut into ``block_size x block_size`` tiles; each tile keeps one fp32 scale and one code per
element:

* ``fp8_e4m3``: ``scale = amax / 448`` (448 is the largest ``torch.float8_e4m3fn``), ``code =
  e4m3(x / scale)``; the scale is what DeepSeek-V3 / Qwen3-FP8 checkpoints store as ``weight_scale_inv``
  (``x ~= code * scale``). Error per element (DESIGN.md): ``|x - deq| <= max(2**-4 |x|, 2**-10 * scale)``
  (3 mantissa bits; subnormal spacing ``2**-9`` code units).
* ``int8``: symmetric absmax, ``scale = amax / 127``, ``code = round(x / scale)`` in ``[-127, 127]``; error
  ``|x - deq| <= scale / 2``.

A tile whose elements are all zero gets ``scale = 1`` (and zero codes), so nothing divides by zero and
re-quantizing a dequantized tensor returns the same codes and scales (``(s * q) / q == s`` in fp32). A tile
so small that ``amax / qmax`` would fall below the smallest normal fp32 (``amax < qmax * 2**-126``, about
``5e-36``) gets ``scale = 2**-126`` instead: ``amax / qmax`` would be a subnormal, or round to 0 (below
``~3e-43``), and ``0 / 0`` makes NaN codes. A power of two keeps ``x / scale`` and ``code * scale`` exact,
so the error bounds and idempotence hold for such tiles too; every other tile's scale is ``amax / qmax``.
Everything here is elementwise per tile, so quantizing any set of whole tiles gives bitwise the codes and
scales of quantizing the whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FORMATS", "BlockFormat", "dequantize_tiles", "parse_format", "quantize_tiles"]

FORMATS = ("fp8_e4m3", "int8")
_ALIASES = {"fp8_block": "fp8_e4m3", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "int8_block": "int8", "int8": "int8"}
_CODE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
_QMAX = {"fp8_e4m3": 448.0, "int8": 127.0}
# What can be quantized: real floating dtypes (float8 inputs are codes already, not weights).
_QUANTIZABLE = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MIN_SCALE = torch.finfo(torch.float32).tiny  # 2**-126


@dataclass(frozen=True)
class BlockFormat:
    """A block-quantization format: the code type and the tile size."""

    kind: str = "fp8_e4m3"
    """``"fp8_e4m3"`` (``torch.float8_e4m3fn`` codes, scale = amax / 448) or ``"int8"`` (symmetric absmax)."""
    block_size: int = 128
    """Rows and columns of one tile (one fp32 scale per ``block_size x block_size`` elements)."""

    def __post_init__(self) -> None:
        kind = _ALIASES.get(self.kind)
        if kind is None:
            raise ValueError(
                f"unknown block-quantization format {self.kind!r}; supported: 'fp8_e4m3' (alias 'fp8_block') and "
                f"'int8' (alias 'int8_block')"
            )
        object.__setattr__(self, "kind", kind)
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(
                f"block_size must be a positive int (e.g. 64 or 128: one scale per block_size x block_size tile), "
                f"got {b!r}"
            )

    @property
    def code_dtype(self) -> torch.dtype:
        """The dtype of the codes: ``torch.float8_e4m3fn`` or ``torch.int8``."""
        return _CODE_DTYPES[self.kind]

    @property
    def qmax(self) -> float:
        """The largest code magnitude (448 or 127)."""
        return _QMAX[self.kind]

    @property
    def tile_numel(self) -> int:
        return self.block_size * self.block_size

    @property
    def name(self) -> str:
        """``fp8_e4m3/128``-style label for logs and tables."""
        return f"{self.kind}/{self.block_size}"


def parse_format(name: str, block_size: int = 128) -> BlockFormat:
    """``BlockFormat`` from a recipe name: ``fp8_block`` / ``fp8_e4m3`` or ``int8_block`` / ``int8``."""
    return BlockFormat(name, block_size)


def check_quantizable(x: torch.Tensor, what: str) -> None:
    """Raise ``TypeError`` unless ``x`` holds real floating values that can be quantized."""
    if x.dtype not in _QUANTIZABLE:
        raise TypeError(
            f"{what} has dtype {x.dtype}; block quantization takes float32, bfloat16, float16 or float64 weights "
            f"(integer tensors are not weights, and float8 tensors are codes already: pass them with their scales)"
        )


def quantize_tiles(tiles: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize tiles ``(..., h, w)`` (each trailing ``h x w`` slice is one block) to ``(codes, scales)``.

    ``codes`` has the shape of ``tiles`` and dtype ``fmt.code_dtype``; ``scales`` has shape ``tiles.shape[:-2]``
    and dtype float32 (``x ~= code * scale``).
    """
    check_quantizable(tiles, "the tensor to quantize")
    x = tiles.to(torch.float32)
    amax = x.abs().amax(dim=(-2, -1)) if x.numel() else x.new_zeros(x.shape[:-2])
    # Smallest normal fp32 as the floor: a subnormal or zero amax / qmax would break x / scale (see the note).
    scales = torch.where(amax > 0, amax / fmt.qmax, torch.ones_like(amax)).clamp_min_(_MIN_SCALE)
    y = (x / scales[..., None, None]).clamp_(-fmt.qmax, fmt.qmax)
    if fmt.kind == "int8":
        y = y.round_()
    return y.to(fmt.code_dtype), scales


def dequantize_tiles(
    codes: torch.Tensor, scales: torch.Tensor, fmt: BlockFormat, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``codes * scales`` for tiles ``(..., h, w)`` and their ``scales`` ``(...)``, in ``dtype``."""
    if codes.dtype != fmt.code_dtype:
        raise TypeError(f"codes of format {fmt.name} must be {fmt.code_dtype}, got {codes.dtype}")
    if scales.dtype != torch.float32:
        raise TypeError(f"block scales must be float32, got {scales.dtype}")
    if tuple(scales.shape) != tuple(codes.shape[:-2]):
        raise ValueError(
            f"scales of shape {tuple(scales.shape)} do not match tiles of shape {tuple(codes.shape)}: one scale per "
            f"tile, i.e. shape {tuple(codes.shape[:-2])}"
        )
    return (codes.to(torch.float32) * scales[..., None, None]).to(dtype)

"""Block-quantized weights: FP8 (e4m3) and INT8 formats with one fp32 scale per block x block tile.

Public face:

* :class:`BlockFormat` (``fp8_e4m3`` / ``int8``, block size) and the tile math in :mod:`.formats`;
* the layouts in :mod:`.blocks`: block-major storage (each tile contiguous), the row-major form of Hugging
  Face FP8 checkpoints (``weight`` + ``weight_scale_inv``), row bands for a quantized AllGather.
"""

from lightning_vescale.quant.blocks import (
    BlockCutError,
    dequantize_block_major,
    dequantize_rowmajor,
    quantize_block_major,
    quantize_rowmajor,
    rowmajor_to_block_major,
)
from lightning_vescale.quant.formats import BlockFormat, parse_format

__all__ = [
    "BlockCutError",
    "BlockFormat",
    "dequantize_block_major",
    "dequantize_rowmajor",
    "parse_format",
    "quantize_block_major",
    "quantize_rowmajor",
    "rowmajor_to_block_major",
]

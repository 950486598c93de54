"""Block-quantized weights: FP8 (e4m3) and INT8 formats with one fp32 scale per block x block tile.

Public face:

* :class:`BlockFormat` (``fp8_e4m3`` / ``int8``, block size) and the tile math in :mod:`.formats`;
* the layouts in :mod:`.blocks`: block-major storage (each tile contiguous), the row-major form of Hugging
  Face FP8 checkpoints (``weight`` + ``weight_scale_inv``), row bands for a quantized AllGather;
* :class:`QuantizedTensor`: one frozen quantized weight (codes + scales), unsharded or sharded;
* :func:`quantize_frozen_weights` (a frozen base stored as codes + scales, QLoRA-style) and
  :func:`quantize_all_gather` (trained weights gathered as codes + scales), both honoured by ``fully_shard``;
* LoRA adapters over any base (:func:`apply_lora`) and their PEFT export (:mod:`.peft`).

Where each path runs: quantization and dequantization are plain torch, on any device (CPU and GPU alike).
Block-scaled ``torch._scaled_mm`` (FP8 matmuls on Hopper) does not run on CPU, so compute always dequantizes
into the compute dtype first (weight-only quantization); codes never enter a matmul.
"""

from lightning_vescale.quant._kinds import GATHER, STORAGE, BlockQuantization, is_tile_major
from lightning_vescale.quant._sharding import quantize_all_gather, quantize_frozen_weights
from lightning_vescale.quant.blocks import (
    BlockCutError,
    dequantize_block_major,
    dequantize_rowmajor,
    quantize_block_major,
    quantize_rowmajor,
    rowmajor_to_block_major,
)
from lightning_vescale.quant.formats import BlockFormat, parse_format
from lightning_vescale.quant.tensor import QuantizedTensor, is_quantized

# fully_shard stores a QuantizedTensor parameter as codes + scales (see quant._kinds).
QuantizedTensor._vescale_buffer_kind = BlockQuantization()  # type: ignore[attr-defined]  # read with getattr

__all__ = [
    "BlockCutError",
    "BlockFormat",
    "BlockQuantization",
    "GATHER",
    "QuantizedTensor",
    "STORAGE",
    "dequantize_block_major",
    "dequantize_rowmajor",
    "is_quantized",
    "is_tile_major",
    "parse_format",
    "quantize_all_gather",
    "quantize_block_major",
    "quantize_frozen_weights",
    "quantize_rowmajor",
    "rowmajor_to_block_major",
]

"""Hugging Face FP8 block checkpoints (DeepSeek-V3 / Qwen3-FP8 style) on load.

Such a checkpoint's ``config.json`` has ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128], ...}``; each quantized Linear stores ``<module>.weight`` as
``float8_e4m3fn`` codes of the weight's shape and ``<module>.weight_scale_inv`` as the fp32 scales of its
``ceil(R/128) x ceil(C/128)`` blocks (``weight ~= code * scale``, as transformers' ``finegrained_fp8`` reads
them). Other tensors (norms, embeddings, ``modules_to_not_convert``) are stored as they are.

:func:`fold_fp8_state` turns the pairs into one tensor per weight before the model's names are mapped:
dequantized (``"dequantize"``) or a :class:`~lightning_vescale.quant.tensor.QuantizedTensor` holding the same
codes and scales in block-major order (``"keep"``; nothing is re-quantized).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from lightning_vescale.quant.blocks import check_scales, dequantize_rowmajor, rowmajor_to_block_major
from lightning_vescale.quant.formats import BlockFormat
from lightning_vescale.quant.tensor import SCALE_SUFFIX, QuantizedTensor

__all__ = ["QUANTIZED_WEIGHTS_MODES", "fold_fp8_state", "fp8_format"]

QUANTIZED_WEIGHTS_MODES = ("dequantize", "keep")


def fp8_format(hf_config: dict[str, Any], mode: Optional[str], config_file: Path) -> Optional[BlockFormat]:
    """The block format a ``config.json`` declares, or None for an unquantized checkpoint.

    Raises:
        ValueError: the checkpoint is quantized and ``mode`` is None (the message says how to load it), ``mode``
            is unknown, or the quantization is not FP8 e4m3 in square blocks.
    """
    if mode is not None and mode not in QUANTIZED_WEIGHTS_MODES:
        raise ValueError(f"quantized_weights={mode!r}; choose 'dequantize' (plain weights in the model's dtype) or "
                         f"'keep' (frozen FP8 codes + scales)")
    quant = hf_config.get("quantization_config")
    if not quant:
        return None
    method, fmt = quant.get("quant_method", "?"), quant.get("fmt", "e4m3")
    if mode is None:
        raise ValueError(
            f"{config_file} has a quantization_config ({method}, {fmt}): pass quantized_weights='dequantize' to load "
            f"the weights dequantized into the model's dtype, or quantized_weights='keep' to keep the FP8 codes and "
            f"scales (a frozen base for adapters); or load a bf16 copy"
        )
    if method != "fp8" or fmt not in ("e4m3", "float8_e4m3fn"):
        raise ValueError(f"{config_file}: quantization_config ({method}, {fmt}) is not supported; only FP8 e4m3 block "
                         f"checkpoints (quant_method='fp8', fmt='e4m3', as DeepSeek-V3 and Qwen3-FP8 ship them)")
    block = quant.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and block[0] == block[1] and int(block[0]) > 0):
        raise ValueError(f"{config_file}: quantization_config.weight_block_size={block!r}; only square blocks such as "
                         f"[128, 128] are supported (per-tensor or per-channel FP8 is not)")
    return BlockFormat("fp8_e4m3", int(block[0]))


def fold_fp8_state(
    hf_state: dict[str, torch.Tensor], fmt: BlockFormat, mode: str, dtype: torch.dtype, source: Path
) -> dict[str, torch.Tensor]:
    """Replace each ``weight`` / ``weight_scale_inv`` pair by one tensor (see the module note).

    Meta tensors (the header-only pass) become meta tensors of the weight's shape in ``dtype``, after the same
    checks. Raises ``ValueError`` naming every weight whose scales are missing or do not fit its block grid,
    and every scale without its weight.
    """
    out: dict[str, torch.Tensor] = {}
    problems = []
    for key, t in hf_state.items():
        if key.endswith(SCALE_SUFFIX):
            if key[: -len(SCALE_SUFFIX)] not in hf_state:
                problems.append(f"{key}: scales of a weight the checkpoint does not have")
            continue
        scales = hf_state.get(key + SCALE_SUFFIX)
        if t.dtype == torch.float8_e4m3fn and scales is None:
            problems.append(f"{key}: float8_e4m3fn codes without {key}{SCALE_SUFFIX}")
            continue
        if scales is None:
            out[key] = t
            continue
        if t.dtype != fmt.code_dtype:
            problems.append(f"{key}: has {key}{SCALE_SUFFIX} but is {t.dtype}, not {fmt.code_dtype} codes")
            continue
        try:
            check_scales(t.shape, scales, fmt, key)
        except ValueError as err:
            problems.append(str(err))
            continue
        if t.is_meta:
            out[key] = torch.empty(t.shape, dtype=dtype, device="meta")
        elif mode == "dequantize":
            out[key] = dequantize_rowmajor(t, scales, fmt, dtype, what=key)
        else:
            codes, block_scales = rowmajor_to_block_major(t, scales, fmt, what=key)
            out[key] = QuantizedTensor(codes, block_scales, fmt, tuple(t.shape), dtype)
    if problems:
        raise ValueError(
            f"FP8 checkpoint {str(source)!r} ({fmt.block_size}x{fmt.block_size} blocks) has weights and scales that "
            f"do not fit together ({len(problems)}):\n  " + "\n  ".join(problems)
        )
    return out

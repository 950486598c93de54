"""Refuse tensors of another kind (bool, integer, floating, complex) than the model entries they would fill.

``Tensor.copy_`` casts across kinds without a word: integer tensors become float weights with values in
the millions, bool tensors become 0.0/1.0, floats become truncated integers. A checkpoint that holds such
tensors where weights belong is damaged (or its safetensors header names another dtype than the bytes
were written with), so every loader of full state dicts checks kinds before it copies anything. Casts
within a kind (bf16 -> fp32, int32 -> int64) are the loaders' business and stay allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain
from typing import Any, Optional

import torch
from torch import nn

from lightning_vescale.quant.tensor import SCALE_SUFFIX, is_quantized

__all__ = ["check_dtype_kinds", "dtype_kind", "dtype_kind_mismatches"]


def dtype_kind(dtype: torch.dtype) -> str:
    """``"bool"``, ``"integer"``, ``"floating"`` (float8 included) or ``"complex"``."""
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "floating"
    return "integer"


def dtype_kind_mismatches(
    expected: Mapping[str, torch.dtype], given: Mapping[str, Any], origin: Optional[Mapping[str, str]] = None
) -> list[str]:
    """One line per tensor of ``given`` whose dtype kind differs from ``expected``'s (names in neither are skipped).

    ``origin`` maps a name to where it came from (e.g. the checkpoint's own name), to be shown first.
    """
    origin = origin or {}
    lines = []
    for name, value in given.items():
        if name not in expected or not isinstance(value, torch.Tensor):
            continue
        theirs, ours = value.dtype, expected[name]
        if dtype_kind(theirs) != dtype_kind(ours):
            where = f"{origin[name]} -> {name}" if name in origin else name
            lines.append(f"{where}: {str(theirs).removeprefix('torch.')} ({dtype_kind(theirs)}), "
                         f"model {str(ours).removeprefix('torch.')} ({dtype_kind(ours)})")
    return lines


def check_dtype_kinds(model: nn.Module, state_dict: Mapping[str, Any], *, what: str) -> None:
    """Raise ``ValueError`` listing every entry of ``state_dict`` whose dtype kind differs from the model's.

    Args:
        model: the model to be filled; its parameters and buffers (under every name, tied ones included)
            give the expected dtypes.
        state_dict: name -> tensor, keyed like ``model.state_dict()``.
        what: what ``state_dict`` is, for the message (e.g. ``"full state dict"``).
    """
    entries = chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
    expected = {}
    for name, t in entries:
        if is_quantized(t):  # stored as codes + scales (see lightning_vescale.quant.tensor)
            expected[name], expected[name + SCALE_SUFFIX] = t.codes.dtype, torch.float32
        else:
            expected[name] = t.dtype
    lines = dtype_kind_mismatches(expected, state_dict)
    if lines:
        raise ValueError(
            f"the {what} holds tensors of another kind than the model's (a cast would load garbage: integers "
            f"as weights, bool as 0/1):\n  " + "\n  ".join(lines) + "\nThe file is damaged, its header names the "
            "wrong dtype, or it belongs to another model. If the values are meant, cast them explicitly first."
        )

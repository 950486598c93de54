"""Declaring parameters block-quantized: frozen bases stored as codes + scales, trained weights gathered as them.

The declaration is :class:`~lightning_vescale.quant._kinds.BlockQuantization` on the parameter
(``_vescale_buffer_kind``); ``fully_shard`` asks it how to store the parameter (:mod:`lightning_vescale.quant._kinds`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn

from lightning_vescale.quant._kinds import BlockQuantization
from lightning_vescale.quant.formats import BlockFormat
from lightning_vescale.quant.tensor import QuantizedTensor, is_quantized, set_quantized_parameter

__all__ = ["declare_quantized", "quantize_all_gather", "quantize_frozen_weights"]


def declare_quantized(param: nn.Parameter, fmt: BlockFormat, layout: str = "auto") -> None:
    """Mark ``param`` block-quantized in ``fmt`` for ``fully_shard`` (stored quantized when frozen, gathered
    quantized when trained; ``layout``: the trained master's, see :func:`quantize_all_gather`)."""
    param._vescale_buffer_kind = BlockQuantization(fmt, layout)  # type: ignore[attr-defined]


def _matching(model: nn.Module, targets: Sequence[str], exclude: Sequence[str], trainable: bool) -> list[str]:
    names = []
    for name, p in model.named_parameters():
        if p.dim() not in (2, 3) or not p.dtype.is_floating_point or p.requires_grad != trainable:
            continue
        if any(fnmatch.fnmatchcase(name, pat) for pat in targets) and not any(
                fnmatch.fnmatchcase(name, pat) for pat in exclude):
            names.append(name)
    return names


def quantize_frozen_weights(
    model: nn.Module, fmt: BlockFormat, *, targets: Sequence[str] = ("*",), exclude: Sequence[str] = (),
) -> list[str]:
    """Store the frozen 2-D / 3-D weights matching ``targets`` (parameter-name globs) block-quantized.

    A real weight is replaced by a :class:`QuantizedTensor` now (the model keeps working, dequantizing in
    forward; ``fully_shard`` then shards its codes and scales as they are). A meta-device weight gets a
    declaration: ``fully_shard`` stores it quantized and ``init_sharded_weights`` or a state-dict load quantizes
    the values it receives. Weights that are already quantized are left alone. Returns the names made quantized.

    Raises:
        ValueError: a pattern of ``targets`` matches no frozen weight (every rule must match something).
    """
    names = _matching(model, targets, exclude, trainable=False)
    _check_every_pattern_matches(model, targets, names, "frozen 2-D/3-D weight", "quantize_frozen_weights")
    done = []
    for name in names:
        p = model.get_parameter(name)
        if is_quantized(p):
            continue
        if p.is_meta:
            declare_quantized(p, fmt)
        else:
            set_quantized_parameter(model, name, QuantizedTensor.quantize(p.detach(), fmt))
        done.append(name)
    return done


def quantize_all_gather(
    model: nn.Module, fmt: BlockFormat, *, targets: Sequence[str] = ("*",), exclude: Sequence[str] = (),
    layout: str = "auto",
) -> list[str]:
    """Declare a block-quantized AllGather for the trained 2-D / 3-D weights matching ``targets``.

    Call before ``fully_shard``. Their fp32 master pieces, gradients and ReduceScatter stay; each unshard
    quantizes this rank's pieces in DeepSeek's ``ceil(R/b) x ceil(C/b)`` tiles (the last tile row and column
    holding the remainder) and gathers codes + scales instead of ``param_dtype`` values: the gathered weights are
    bitwise a quantize-dequantize of the whole master on any world size, in every layout.

    Args:
        layout: how the fp32 master of a weight sharded at element or row granularity is laid out.
            ``"block_major"``: tile-major (each ``b x b`` tile contiguous, edge tiles holding the remainder), so a
            cut may fall between any two tiles: little padding on many ranks, whatever the widths. Its gradient is
            reordered into tile order before the ReduceScatter (one transient copy per weight); state dicts,
            checkpoints and ``full_tensor()`` stay row-major; Muon refuses it. ``"bands"``: row-major, cut only
            between bands of ``b`` rows of each matrix. ``"auto"`` (default): per group and world size, the one of
            the two the planner lays out with less padding (bands on a tie: no reorder). Weights whose edge tiles
            the tile order cannot serve (``R % b`` or ``C % b`` not pairing up into ``b * b`` granules), with at
            most ``b`` columns, or at whole-matrix granularity (Muon) always keep bands.

    Returns the names declared.
    """
    names = _matching(model, targets, exclude, trainable=True)
    _check_every_pattern_matches(model, targets, names, "trained 2-D/3-D weight", "quantize_all_gather")
    for name in names:
        declare_quantized(model.get_parameter(name), fmt, layout)
    return names


def _check_every_pattern_matches(model: nn.Module, targets: Sequence[str], names: list[str], what: str,
                                 where: str) -> None:
    unused = [pat for pat in targets if not any(fnmatch.fnmatchcase(n, pat) for n in names)]
    if unused:
        sample = [n for n, p in model.named_parameters() if p.dim() in (2, 3)][:6]
        raise ValueError(f"{where}: target pattern(s) {unused} match no {what} (parameter names look like {sample})")

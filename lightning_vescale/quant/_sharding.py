"""How ``fully_shard`` treats block-quantized parameters (the engine's only entry points into ``quant``).

A parameter is block-quantized when it is a :class:`~lightning_vescale.quant.tensor.QuantizedTensor` (frozen
codes + scales, e.g. from ``from_pretrained(..., quantized_weights="keep")`` or :func:`quantize_frozen_weights`)
or carries the declaration ``_vescale_quant = BlockFormat(...)`` (set by :func:`quantize_frozen_weights` on a
meta-device model, or :func:`quantize_all_gather` on trained weights). ``fully_shard`` then puts it in

* a :class:`~lightning_vescale.quant._storage.QuantizedStorage` when it is frozen: stored sharded as codes +
  scales, gathered as codes + scales, dequantized into the compute dtype for forward;
* a :class:`~lightning_vescale.quant._gather.QuantizedGatherBuffer` when it trains: fp32 master pieces as
  usual, cut between row bands, quantized per rank before the AllGather.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from typing import Optional

import torch
from torch import nn

from lightning_vescale.quant.blocks import band_granularity
from lightning_vescale.quant.formats import BlockFormat
from lightning_vescale.quant.tensor import QuantizedTensor, is_quantized, set_quantized_parameter

__all__ = ["QUANT_ATTR", "group_key_suffix", "gather_granularity", "quantize_all_gather", "quantize_frozen_weights"]

QUANT_ATTR = "_vescale_quant"
STORAGE, GATHER = "quantized_storage", "quantized_gather"


def quantization_of(param: torch.Tensor) -> Optional[BlockFormat]:
    if is_quantized(param):
        return param.fmt
    return getattr(param, QUANT_ATTR, None)


def group_key_suffix(fqn: str, param: torch.Tensor) -> tuple:
    """``()`` for an ordinary parameter; ``(STORAGE, fmt)`` for a frozen quantized one, ``(GATHER, fmt)`` for a
    trained one with a quantized AllGather. Raises for declarations the engine cannot honour."""
    fmt = quantization_of(param)
    if fmt is None:
        return ()
    if param.dim() not in (2, 3):
        raise ValueError(f"parameter {fqn} of shape {tuple(param.shape)} is declared block-quantized; only 2-D weights "
                         f"and 3-D expert stacks can be")
    if getattr(param, "_vescale_global_extent", None) is not None:
        raise ValueError(f"parameter {fqn} is a block of an expert-parallel stack and declared block-quantized: "
                         f"quantization under expert parallelism is not supported yet")
    if is_quantized(param) or not param.requires_grad:
        return (STORAGE, fmt)
    return (GATHER, fmt)


def gather_granularity(fqn: str, param: torch.Tensor, fmt: BlockFormat, granularity: int) -> int:
    """The cut granularity of a trained weight with a quantized AllGather: whole row bands, and ``granularity``."""
    return math.lcm(granularity, band_granularity(tuple(param.shape), fmt.block_size))


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
            setattr(p, QUANT_ATTR, fmt)
        else:
            set_quantized_parameter(model, name, QuantizedTensor.quantize(p.detach(), fmt))
        done.append(name)
    return done


def quantize_all_gather(
    model: nn.Module, fmt: BlockFormat, *, targets: Sequence[str] = ("*",), exclude: Sequence[str] = (),
) -> list[str]:
    """Declare a block-quantized AllGather for the trained 2-D / 3-D weights matching ``targets``.

    Call before ``fully_shard``. Their fp32 master pieces, gradients and ReduceScatter are unchanged; each
    unshard quantizes this rank's pieces and gathers codes + scales instead of ``param_dtype`` values.
    Returns the names declared.
    """
    names = _matching(model, targets, exclude, trainable=True)
    _check_every_pattern_matches(model, targets, names, "trained 2-D/3-D weight", "quantize_all_gather")
    for name in names:
        setattr(model.get_parameter(name), QUANT_ATTR, fmt)
    return names


def _check_every_pattern_matches(model: nn.Module, targets: Sequence[str], names: list[str], what: str,
                                 where: str) -> None:
    unused = [pat for pat in targets if not any(fnmatch.fnmatchcase(n, pat) for n in names)]
    if unused:
        sample = [n for n, p in model.named_parameters() if p.dim() in (2, 3)][:6]
        raise ValueError(f"{where}: target pattern(s) {unused} match no {what} (parameter names look like {sample})")

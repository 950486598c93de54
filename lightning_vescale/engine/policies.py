"""Policies that ``fully_shard`` takes, named as in FSDP2 where users already know the concept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["MixedPrecisionPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """How parameters, gradient reductions and outputs are cast.

    The local pieces (what the optimizer steps) always stay in the parameter's original dtype (fp32
    master weights). Each group casts its local piece to ``param_dtype`` in one op straight into its
    slot of the AllGather buffer, so forward and backward run in ``param_dtype``.
    """

    param_dtype: Optional[torch.dtype] = None
    """dtype of the gathered (unsharded) parameters and of their gradients; None keeps the original."""
    reduce_dtype: Optional[torch.dtype] = None
    """dtype of the gradient ReduceScatter; None means ``param_dtype``."""
    output_dtype: Optional[torch.dtype] = None
    """If set, floating-point outputs of the root sharded module (the model's outputs) are cast to this dtype."""
    cast_forward_inputs: bool = True
    """Cast floating-point forward inputs of each sharded module to ``param_dtype``."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(f"MixedPrecisionPolicy.{name} must be a floating torch.dtype or None, got {value!r}")

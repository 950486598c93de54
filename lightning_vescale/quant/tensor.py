"""QuantizedTensor: a frozen block-quantized weight that looks like the weight.

[Note: what a QuantizedTensor is]
One parameter-like object per weight: it reports the weight's ``shape`` and its compute ``dtype`` and holds
the weight as block-major ``codes`` ``(E?, Tr, Tc, b, b)`` and fp32 ``scale_inv`` ``(E?, Tr, Tc)``
(:mod:`~lightning_vescale.quant.blocks`). The two are either

* plain tensors (*unsharded*: a model loaded with ``from_pretrained(..., quantization="keep")``, or the
  single-process reference of a QLoRA run). Every op dequantizes it into its dtype first (weight-only
  quantization, as QLoRA computes), except transposes and ``torch.stack``, which move whole tiles and stay
  quantized (how Hugging Face per-expert weights become our expert stacks without re-quantizing), and
  in-place ops, which are refused (the weight is frozen);
* :class:`~lightning_vescale.engine.tensor.RaggedTensor` s of one tile range per rank (*sharded*: made by
  ``fully_shard`` for a frozen parameter declared quantized). It runs no compute (the engine gathers codes
  and scales and dequantizes into the unsharded buffer for forward); ``copy_`` from a full weight quantizes
  this rank's tiles, ``copy_`` from an unsharded QuantizedTensor copies its codes and scales (no
  re-quantization), and in-place random fills (``nn.init``) draw the full weight and quantize this rank's tiles.

A state dict holds it as two entries, ``<name>`` (the codes) and ``<name>_scale_inv`` (the scales), through a
state-dict hook on its module (:func:`install_state_dict_hooks`); for a sharded weight both are RaggedTensors,
so ``torch.distributed.checkpoint`` writes and reshards them through RaggedTensor's own DCP hooks, bitwise
(codes are values, not computations).
"""

from __future__ import annotations

import copy
from typing import Any, Optional, SupportsIndex, TypeGuard

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from lightning_vescale.engine.tensor import RaggedTensor, UnsupportedRaggedOp
from lightning_vescale.quant.blocks import (
    codes_shape,
    dequantize_block_major,
    from_tiles,
    quantize_tile_range,
    tile_grid,
)
from lightning_vescale.quant.formats import BlockFormat

__all__ = [
    "SCALE_SUFFIX", "QuantizedTensor", "install_state_dict_hooks", "is_quantized", "set_quantized_parameter",
    "weights_state_dict",
]

aten = torch.ops.aten
SCALE_SUFFIX = "_scale_inv"
"""A quantized ``<name>``'s scales are stored as ``<name>_scale_inv`` (``weight`` -> ``weight_scale_inv``)."""


def is_quantized(t: Any) -> TypeGuard[QuantizedTensor]:
    return isinstance(t, QuantizedTensor)


class QuantizedTensor(torch.Tensor):
    """A frozen weight of ``shape`` stored as block-quantized ``codes`` and ``scale_inv`` (see the module note).

    Args:
        codes: block-major codes ``(E?, Tr, Tc, b, b)`` of ``fmt.code_dtype`` (a RaggedTensor when sharded).
        scale_inv: fp32 scales ``(E?, Tr, Tc)`` (a RaggedTensor of the same tile ranges when sharded).
        fmt: the format.
        shape: the weight's shape ``(E?, R, C)``.
        dtype: the dtype it dequantizes into (the compute dtype).
    """

    # RaggedTensors when sharded (is_sharded), else plain tensors; Any as is_sharded cannot narrow them.
    _codes: Any
    _scales: Any
    _fmt: BlockFormat
    __slots__ = ("_codes", "_fmt", "_scales")

    @staticmethod
    def __new__(
        cls, codes: torch.Tensor, scale_inv: torch.Tensor, fmt: BlockFormat, shape: tuple[int, ...],
        dtype: torch.dtype = torch.float32,
    ) -> QuantizedTensor:
        shape = tuple(int(s) for s in shape)
        if tuple(codes.shape) != codes_shape(shape, fmt.block_size):
            raise ValueError(f"codes of shape {tuple(codes.shape)} do not hold a {shape} weight in {fmt.name} "
                             f"blocks (expected {codes_shape(shape, fmt.block_size)})")
        if tuple(scale_inv.shape) != tile_grid(shape, fmt.block_size):
            raise ValueError(f"scales of shape {tuple(scale_inv.shape)} do not match a {shape} weight in "
                             f"{fmt.name} blocks (expected {tile_grid(shape, fmt.block_size)})")
        if codes.dtype != fmt.code_dtype or scale_inv.dtype != torch.float32:
            raise TypeError(f"{fmt.name} needs {fmt.code_dtype} codes and float32 scales, got {codes.dtype} and "
                            f"{scale_inv.dtype}")
        if isinstance(codes, RaggedTensor) != isinstance(scale_inv, RaggedTensor):
            raise TypeError("codes and scales must both be sharded (RaggedTensors) or both be plain tensors")
        r = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=codes.device, requires_grad=False)
        r._codes, r._scales, r._fmt = codes, scale_inv, fmt
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # torch's own idiom; the stubs type it as a classmethod

    @property
    def is_sharded_tensor(self) -> bool:
        """Whether the codes and scales are this rank's pieces (``fully_shard`` sharded the weight)."""
        return isinstance(self._codes, RaggedTensor)

    # -- construction ---------------------------------------------------------------------------------------
    @classmethod
    def quantize(cls, weight: torch.Tensor, fmt: BlockFormat, dtype: Optional[torch.dtype] = None) -> QuantizedTensor:
        """Quantize a full ``(E?, R, C)`` weight (unsharded)."""
        from lightning_vescale.quant.blocks import quantize_block_major

        codes, scales = quantize_block_major(weight.detach(), fmt)
        return cls(codes, scales, fmt, tuple(weight.shape), dtype or weight.dtype)

    # -- the public face ------------------------------------------------------------------------------------
    @property
    def codes(self) -> torch.Tensor:
        """Block-major codes ``(E?, Tr, Tc, b, b)`` (a RaggedTensor when sharded)."""
        return self._codes

    @property
    def scale_inv(self) -> torch.Tensor:
        """fp32 scales ``(E?, Tr, Tc)``: ``weight ~= code * scale`` per tile (a RaggedTensor when sharded)."""
        return self._scales

    @property
    def fmt(self) -> BlockFormat:
        return self._fmt

    @property
    def is_sharded(self) -> bool:
        return isinstance(self._codes, RaggedTensor)

    @property
    def tile_range(self) -> tuple[int, int]:
        """The tiles ``[start, end)`` (block-major order) held here: all of them when unsharded."""
        if self.is_sharded:
            return self._scales.local_range
        return 0, self._scales.numel()

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The full weight in ``dtype`` (default: this tensor's dtype); a collective when sharded."""
        codes, scales = self._codes, self._scales
        if self.is_sharded:
            codes, scales = codes.full_tensor(), scales.full_tensor()
        return dequantize_block_major(codes, scales, tuple(self.shape), self._fmt, dtype or self.dtype)

    def full_tensor(self) -> torch.Tensor:
        """The dequantized full weight (as ``RaggedTensor.full_tensor``; every rank must call it when sharded)."""
        return self.dequantize()

    def with_dtype(self, dtype: torch.dtype) -> QuantizedTensor:
        """The same codes and scales, dequantizing into ``dtype``."""
        return QuantizedTensor(self._codes, self._scales, self._fmt, tuple(self.shape), dtype)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        where = f", tiles={self.tile_range} of {self._scales.numel()}" if self.is_sharded else ""
        return (f"QuantizedTensor(shape={tuple(self.shape)}, format={self._fmt.name}, dtype={self.dtype}"
                f"{where}, device={self.device})")

    def __deepcopy__(self, memo: dict) -> QuantizedTensor:
        if id(self) in memo:
            return memo[id(self)]
        out = QuantizedTensor(copy.deepcopy(self._codes, memo), copy.deepcopy(self._scales, memo), self._fmt,
                              tuple(self.shape), self.dtype)
        memo[id(self)] = out
        for key, value in self.__dict__.items():
            setattr(out, key, copy.deepcopy(value, memo))
        return out

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        raise TypeError(
            "a QuantizedTensor is not pickled: save it through a state dict (it writes <name> codes and "
            "<name>_scale_inv scales), lightning_vescale.checkpoint, or dequantize() it"
        )

    # -- dispatch -------------------------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        if func._schema.name.startswith("aten::_foreach_") or _mutates_quantized(func, args, kwargs):
            raise UnsupportedRaggedOp(
                f"{func._schema.name} would change a frozen block-quantized weight in place; a QuantizedTensor only "
                f"changes by copy_ (re-quantize from a full weight) or a checkpoint load. Train adapters on top of it "
                f"(lightning_vescale.quant.apply_lora), or dequantize() it into an ordinary parameter."
            )
        if any(is_quantized(a) and a.is_sharded for a in _flat(args, kwargs)):
            raise UnsupportedRaggedOp(
                f"{func._schema.name} on a sharded QuantizedTensor: it holds only this rank's tiles. The engine "
                f"gathers and dequantizes it for forward; call full_tensor() for the whole weight."
            )
        return func(*tree_map(_dequantized, args), **tree_map(_dequantized, kwargs))


def _flat(args: tuple, kwargs: dict) -> list:
    out: list = []
    tree_map(out.append, (args, kwargs))
    return out


def _dequantized(x: Any) -> Any:
    return x.dequantize() if is_quantized(x) else x


def _mutates_quantized(func: Any, args: tuple, kwargs: dict) -> bool:
    schema = func._schema
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if is_quantized(value):
                return True
    return False


# -- handlers -----------------------------------------------------------------------------------------------


def _detach(func: Any, args: tuple, kwargs: dict) -> QuantizedTensor:
    self = args[0]
    return QuantizedTensor(self._codes, self._scales, self._fmt, tuple(self.shape), self.dtype)


def _to_copy(func: Any, args: tuple, kwargs: dict) -> Any:
    """``.to(dtype)`` changes the compute dtype and keeps the codes; ``.to(device)`` moves codes and scales."""
    self = args[0]
    dtype = kwargs.get("dtype") or self.dtype
    device = kwargs.get("device")
    if device is None or torch.device(device) == self.device:
        return self.with_dtype(dtype)
    if self.is_sharded:
        raise UnsupportedRaggedOp("moving a sharded QuantizedTensor to another device is the engine's job")
    return QuantizedTensor(self._codes.to(device), self._scales.to(device), self._fmt, tuple(self.shape), dtype)


def _transpose_tiles(self: QuantizedTensor) -> QuantizedTensor:
    """The transpose of the last two dims, still quantized: the tile grid and every tile are transposed."""
    if self.is_sharded:
        raise UnsupportedRaggedOp("transpose of a sharded QuantizedTensor; transpose before sharding")
    *lead, rows, cols = self.shape
    codes = self._codes.view(torch.uint8).transpose(-4, -3).transpose(-2, -1).contiguous().view(self._codes.dtype)
    scales = self._scales.transpose(-2, -1).contiguous()
    # Edge padding sits at the high end of both dims, so it stays there after the transpose.
    return QuantizedTensor(codes, scales, self._fmt, (*lead, cols, rows), self.dtype)


def _t(func: Any, args: tuple, kwargs: dict) -> QuantizedTensor:
    if args[0].dim() != 2:
        raise UnsupportedRaggedOp(f"t() needs a 2-D tensor, got a QuantizedTensor of shape {tuple(args[0].shape)}")
    return _transpose_tiles(args[0])


def _transpose(func: Any, args: tuple, kwargs: dict) -> Any:
    self, d0, d1 = args[0], args[1] % args[0].dim(), args[2] % args[0].dim()
    if sorted((d0, d1)) == [self.dim() - 2, self.dim() - 1]:
        return _transpose_tiles(self)
    return func(self.dequantize(), args[1], args[2])


def _stack(func: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.stack`` of quantized matrices of one format: a quantized stack (how experts are stacked)."""
    tensors = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if dim != 0 or not all(is_quantized(t) and not t.is_sharded for t in tensors):
        return func([_dequantized(t) for t in tensors], *args[1:], **kwargs)
    first = tensors[0]
    if any(t._fmt != first._fmt or t.shape != first.shape or t.dtype != first.dtype for t in tensors):
        raise ValueError("torch.stack of QuantizedTensors needs one format, shape and dtype")
    codes = torch.stack([t._codes.view(torch.uint8) for t in tensors]).view(first._codes.dtype)
    scales = torch.stack([t._scales for t in tensors])
    return QuantizedTensor(codes, scales, first._fmt, (len(tensors), *first.shape), first.dtype)


def _contiguous_like(func: Any, args: tuple, kwargs: dict) -> Any:
    """``clone`` / ``contiguous``: the codes are contiguous already; an unsharded clone copies them."""
    self = args[0]
    if self.is_sharded:
        return _detach(func, args, kwargs)
    return QuantizedTensor(self._codes.clone(), self._scales.clone(), self._fmt, tuple(self.shape), self.dtype)


@torch.no_grad()
def _copy_(func: Any, args: tuple, kwargs: dict) -> Any:
    """Fill this weight from ``src``: a QuantizedTensor of the same format (codes and scales copied, no
    re-quantization) or a full weight of the same shape (this rank's tiles quantized)."""
    self, src = args[0], args[1]
    if not is_quantized(self):
        return func(self, _dequantized(src), *args[2:], **kwargs)  # a plain tensor takes the dequantized values
    if tuple(src.shape) != tuple(self.shape):
        raise ValueError(f"copy_ into a QuantizedTensor of shape {tuple(self.shape)} from shape {tuple(src.shape)}")
    start, end = self.tile_range
    codes_local = self._codes.to_local() if self.is_sharded else self._codes
    scales_local = self._scales.to_local() if self.is_sharded else self._scales
    b = self._fmt.block_size
    if is_quantized(src):
        if src._fmt != self._fmt:
            raise ValueError(f"copy_ of {src._fmt.name} codes into a {self._fmt.name} weight: dequantize() the source "
                             f"to re-quantize it, or load it into a weight of its own format")
        if src.is_sharded:
            if src._scales.layout_info != self._scales.layout_info:
                raise ValueError("copy_ between sharded QuantizedTensors of different layouts: load a checkpoint")
            src_codes, src_scales = src._codes.to_local(), src._scales.to_local()
        else:
            src_codes = src._codes.reshape(-1, b, b)[start:end]
            src_scales = src._scales.reshape(-1)[start:end]
        codes_local.view(torch.uint8).view(-1).copy_(src_codes.reshape(-1).view(torch.uint8))
        scales_local.view(-1).copy_(src_scales.reshape(-1))
        return self
    codes, scales = quantize_tile_range(src.detach().to(codes_local.device), self._fmt, start, end)
    codes_local.view(torch.uint8).view(-1).copy_(codes.reshape(-1).view(torch.uint8))
    scales_local.view(-1).copy_(scales)
    return self


def _random_fill(func: Any, args: tuple, kwargs: dict) -> Any:
    """``nn.init`` on a quantized weight: draw the full weight (the unsharded model's values) and quantize it."""
    self = args[0]
    full = torch.empty(tuple(self.shape), dtype=self.dtype, device=self.device)
    func(full, *args[1:], **kwargs)
    return _copy_(aten.copy_.default, (self, full), {})


_HANDLERS = {
    aten.detach.default: _detach,
    aten.alias.default: _detach,
    aten._to_copy.default: _to_copy,
    aten.t.default: _t,
    aten.transpose.int: _transpose,
    aten.stack.default: _stack,
    aten.clone.default: _contiguous_like,
    aten.copy_.default: _copy_,
    aten.uniform_.default: _random_fill,
    aten.normal_.default: _random_fill,
}


# -- state dicts --------------------------------------------------------------------------------------------


def _expand_quantized(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post-hook: a quantized ``<name>`` becomes ``<name>`` (codes) + ``<name>_scale_inv`` (scales)."""
    for name, p in module._parameters.items():
        key = prefix + name
        if is_quantized(p) and key in state_dict:
            items = list(state_dict.items())
            state_dict.clear()
            for k, v in items:
                if k == key:
                    state_dict[key] = p.codes
                    state_dict[key + SCALE_SUFFIX] = p.scale_inv
                else:
                    state_dict[k] = v


def install_state_dict_hooks(module: nn.Module) -> None:
    """Make ``module``'s quantized parameters appear in state dicts as codes + scales (once per module)."""
    if not module.__dict__.get("_vescale_quant_hooked", False):
        module.register_state_dict_post_hook(_expand_quantized)
        module.__dict__["_vescale_quant_hooked"] = True


def weights_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with each quantized weight as its QuantizedTensor (not as codes + scales)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if name.endswith(SCALE_SUFFIX) and is_quantized(params.get(name[: -len(SCALE_SUFFIX)])):
            continue
        p = params.get(name)
        out[name] = p.detach() if is_quantized(p) else value.detach() if isinstance(value, torch.Tensor) else value
    return out


def dequantized_full(t: torch.Tensor) -> torch.Tensor:
    """A full plain tensor for ``t``: dequantized when quantized (a collective when sharded)."""
    return t.dequantize() if is_quantized(t) else t


def rowmajor_codes(t: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An unsharded QuantizedTensor as a Hugging Face FP8 pair: row-major codes and ``(E?, Tr, Tc)`` scales."""
    return from_tiles(t.codes.view(torch.uint8), tuple(t.shape)).view(t.codes.dtype), t.scale_inv


def set_quantized_parameter(model: nn.Module, name: str, value: QuantizedTensor) -> None:
    """Make ``model``'s parameter ``name`` (and every tie of it) the frozen quantized weight ``value``."""
    module_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(module_name)
    old = owner._parameters.get(attr)
    if old is None:
        raise ValueError(f"{name} is not a parameter of {type(model).__name__}")
    if tuple(old.shape) != tuple(value.shape):
        raise ValueError(f"{name}: the quantized weight has shape {tuple(value.shape)}, the parameter "
                         f"{tuple(old.shape)}")
    param = nn.Parameter(value, requires_grad=False)
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is old:
                module._parameters[key] = param
                install_state_dict_hooks(module)

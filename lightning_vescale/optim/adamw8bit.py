"""AdamW with block-wise 8-bit optimizer states, on the local pieces of sharded parameters.

[Note: block-wise 8-bit states]
Both moments are stored as one byte per element (a code) plus one fp32 scale per block of ``block_size``
consecutive elements of the flattened tensor (Dettmers et al., "8-bit Optimizers via Block-wise Quantization",
arXiv 2110.02861; bitsandbytes' ``Adam8bit`` and torchao's ``AdamW8bit`` store the same): a block's scale is
its absolute maximum, and each element is the code of the nearest value of a 256-entry map times the scale.
The maps are bitsandbytes' *dynamic* data type (``create_dynamic_map``): a sign, a run of zero bits giving a
decimal exponent down to ``1e-6`` and a linear fraction, so small values keep relative precision.
``exp_avg`` takes the signed map, ``exp_avg_sq`` (never negative) the unsigned one, whose 256 codes all go
to magnitudes. We pick these, not a linear int8, because they are what both libraries ship and what the
paper validated on language models up to 1.5B parameters (a linear map rounds most of ``exp_avg_sq``'s small
entries to zero, and ``m / (sqrt(0) + eps)`` then blows up); ``block_size=256`` is torchao's and
bitsandbytes' optimizer block. Each step dequantizes a parameter's states to fp32, runs exactly
``torch.optim.AdamW``'s single-tensor update with them (the parameter update uses the fp32 moments, as both
libraries do), and quantizes the new moments back. State bytes per element: ``2 x (1 + 4 / block_size)``
against AdamW's 8 (0.254x at 256); tensors under ``min_8bit_size`` elements (norms, biases) keep fp32 states.

[Note: blocks never straddle a cut]
Blocks are counted from the first element of the *global* flattened tensor, so a block is the same set of
elements on any world size. A rank quantizes its own piece with no communication only if no block crosses a
cut between ranks: every piece must start on a multiple of ``block_size`` (and end on one, or at the end of
the tensor). Shard with ``granularity=adamw8bit_granularity(block_size)`` (``"elements:256"``), which the
planner honours for every tensor; the recipes do this for ``optimizer=adamw8bit``. A layout that cuts inside
a block is refused at construction, naming the parameter (splitting a block would change the format:
shard-local results would then differ from the unsharded optimizer's, and from the same checkpoint loaded
on another world size). Sharded and single-process AdamW8bit are then bitwise equal, step after step.

[Note: checkpoints]
The state of a quantized parameter is ``step``, ``exp_avg_codes`` / ``exp_avg_sq_codes`` (uint8, one per
element: RaggedTensors of the parameter's layout) and ``exp_avg_scales`` / ``exp_avg_sq_scales`` (fp32, one per
global block: RaggedTensors of shape ``(num_blocks,)`` sharded like the blocks, see :meth:`AdamW8bit.state_layout`).
Both are defined on global block boundaries, so a sharded checkpoint (``lightning_vescale.checkpoint``) saves
codes and scales as they are (0.25x of AdamW's bytes) and reloads them on any world size bitwise; training then
continues exactly as without the reload. ``load_state_dict`` also takes ``torch.optim.AdamW``'s fp32
``exp_avg`` / ``exp_avg_sq`` (quantizing them), and codes for a parameter it keeps in fp32 (dequantizing them),
so a run may switch between AdamW and AdamW8bit through a checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import Optimizer, ParamsT, _get_scalar_dtype, _get_value, _to_scalar

from lightning_vescale.engine.planner import element_blocks
from lightning_vescale.engine.tensor import RaggedLayout, RaggedTensor, is_ragged, local_tensor

__all__ = [
    "AdamW8bit",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_MIN_8BIT_SIZE",
    "adamw8bit_granularity",
    "check_block_args",
    "create_dynamic_map",
    "dequantize_blockwise",
    "optimizer_state_bytes",
    "quantize_blockwise",
]

DEFAULT_BLOCK_SIZE = 256
"""Elements per scale: torchao's and bitsandbytes' optimizer block."""
DEFAULT_MIN_8BIT_SIZE = 1024
"""Tensors with fewer elements keep fp32 states (bitsandbytes and torchao use 4096; 1024 quantizes every matrix
of ``llama_tiny``, whose k/v projections have 2048 elements, and leaves norms and biases in fp32)."""

_MOMENTS = ("exp_avg", "exp_avg_sq")
_CODES = {m: f"{m}_codes" for m in _MOMENTS}
_SCALES = {m: f"{m}_scales" for m in _MOMENTS}


def create_dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> list[float]:
    """bitsandbytes' dynamic quantization map (``bitsandbytes.functional.create_dynamic_map``, also torchao's):
    the 2**total_bits sorted values a code stands for, in ``[-1, 1]`` (signed) or ``[0, 1]``.

    Each run of leading zero bits lowers the decimal exponent by one (down to ``10**-(max_exponent_bits-1)``), the
    bits after the first one are a linear fraction in ``[0.1, 1]``; ``0`` and ``1`` are exact. The signed map has
    no ``-1`` (its most negative value is about ``-0.993``), as in bitsandbytes.
    """
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = (2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                          else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional_items > 0:
        boundaries = torch.linspace(0.1, 1, additional_items + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1)) * means).tolist()
    data.append(0.0)
    data.append(1.0)
    data += [0.0] * (2**total_bits - len(data))
    data.sort()
    return data


class _Map:
    """A quantization map on one device: its values and the midpoints between neighbours (nearest rounding)."""

    def __init__(self, values: list[float], device: torch.device) -> None:
        self.values = torch.tensor(values, dtype=torch.float32, device=device)
        self.midpoints = (self.values[1:] + self.values[:-1]) / 2
        self.zero_code = values.index(0.0)
        # Nearest code by table: the top 16 bits of an fp32 (sign, exponent, 7 mantissa bits) name a range of
        # values 2**-7 wide relatively; the table holds the code of the range's smallest value, and one comparison
        # with the next midpoint finishes (no range holds two midpoints: the maps' neighbours are >= 1.4% apart).
        # bucketize gives the same codes (tests check it) at several times the cost.
        top = torch.arange(1 << 16, dtype=torch.int64)
        low = torch.where(top >= 1 << 15, 0xFFFF, 0)  # negative floats grow in magnitude with their low bits
        smallest = ((top << 16) | low).to(torch.int32).view(torch.float32).nan_to_num(0.0, 1.0, -1.0).clamp(-1, 1)
        self.table = torch.bucketize(smallest, self.midpoints, right=True).to(device)
        self.midpoints_padded = torch.cat([self.midpoints, self.midpoints.new_tensor([float("inf")])])

    def codes(self, normalized: Tensor) -> Tensor:
        """The nearest code of every value of ``normalized`` (in ``[-1, 1]``), a tie going to the larger value."""
        index = (normalized.view(torch.int32) >> 16) & 0xFFFF
        codes = self.table[index.long()]
        return codes + (normalized >= self.midpoints_padded[codes])


_MAPS: dict[tuple[bool, torch.device], _Map] = {}


def _qmap(signed: bool, device: torch.device) -> _Map:
    key = (signed, torch.device(device))
    if key not in _MAPS:
        _MAPS[key] = _Map(create_dynamic_map(signed=signed), key[1])
    return _MAPS[key]


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def quantize_blockwise(x: Tensor, block_size: int = DEFAULT_BLOCK_SIZE, *, signed: bool = True,
                       out: Optional[tuple[Tensor, Tensor]] = None) -> tuple[Tensor, Tensor]:
    """``(codes, scales)`` of ``x`` flattened: uint8 codes (``x``'s shape) and one fp32 absmax per block of
    ``block_size`` elements (the last block holding what remains). ``out``: tensors to write them into."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    nb = num_blocks(n, block_size)
    pad = nb * block_size - n
    blocks = (F.pad(flat, (0, pad)) if pad else flat).view(nb, block_size)  # zeros change no absmax
    scales = blocks.abs().amax(dim=1)
    normalized = blocks / torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)
    # The nearest map value; a tie goes to the larger one, as torchao's rounding.
    codes = _qmap(signed, x.device).codes(normalized.view(-1)[:n])
    codes = codes.to(torch.uint8).view(x.shape)
    if out is None:
        return codes, scales
    out[0].copy_(codes)
    out[1].copy_(scales)
    return out


def dequantize_blockwise(codes: Tensor, scales: Tensor, block_size: int = DEFAULT_BLOCK_SIZE, *,
                         signed: bool = True) -> Tensor:
    """The fp32 values of :func:`quantize_blockwise`'s ``codes`` and ``scales`` (``codes``' shape)."""
    n = codes.numel()
    nb = scales.numel()
    values = _qmap(signed, codes.device).values[codes.reshape(-1).long()]
    pad = nb * block_size - n
    values = (F.pad(values, (0, pad)) if pad else values).view(nb, block_size).mul_(scales.float().unsqueeze(1))
    return values.view(-1)[:n].view(codes.shape)


def adamw8bit_granularity(block_size: int = DEFAULT_BLOCK_SIZE) -> str:
    """The ``granularity`` that keeps every block of :class:`AdamW8bit` whole on one rank: ``"elements:<block_size>"``
    (pass it to ``fully_shard``, ``VeScaleStrategy``, ``VeScaleFabricStrategy`` or ``VeScaleConfig``)."""
    return element_blocks(block_size)


def optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` this rank holds (local pieces; scalars such as ``step`` too)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, Tensor):
                local = local_tensor(value)
                total += local.numel() * local.element_size()
    return total


def _block_layout(layout: RaggedLayout, block_size: int) -> RaggedLayout:
    """The layout of one-per-block states of a tensor laid out as ``layout`` (cuts on block boundaries)."""
    numel = math.prod(layout.shape)
    ranges = tuple((lo // block_size, num_blocks(hi, block_size)) if hi > lo else
                   (num_blocks(lo, block_size),) * 2 for lo, hi in layout.ranges)
    return dataclasses.replace(layout, shape=(num_blocks(numel, block_size),), ranges=ranges)


def _straddled_cut(layout: RaggedLayout, block_size: int) -> Optional[int]:
    """A cut of ``layout`` that falls inside a block (tensor-relative element offset), or None."""
    numel = math.prod(layout.shape)
    for lo, hi in layout.ranges:
        for cut in (lo, hi):
            if 0 < cut < numel and cut % block_size and hi > lo:
                return cut
    return None


def check_block_args(block_size: Any, min_8bit_size: Any, prefix: str = "") -> None:
    """Raise ``ValueError`` (naming ``<prefix>block_size`` / ``<prefix>min_8bit_size``) for values
    :class:`AdamW8bit` cannot take: its own check, shared with the recipes' ``optimizer=adamw8bit`` config."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{prefix}block_size must be a positive int, got {block_size!r}")
    if isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int) or min_8bit_size < 0:
        raise ValueError(f"{prefix}min_8bit_size must be an int >= 0, got {min_8bit_size!r}")


class AdamW8bit(Optimizer):
    """``torch.optim.AdamW`` with both moments stored as 8-bit codes plus one fp32 scale per block.

    Works on parameters sharded by :func:`lightning_vescale.fully_shard` (each rank quantizes the blocks of its
    own piece, no communication) and on plain tensors. See [Note: block-wise 8-bit states] for the format,
    [Note: blocks never straddle a cut] for the granularity the parameters need, and [Note: checkpoints].

    Args:
        params: parameters or param groups, as ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay, maximize: as ``torch.optim.AdamW`` (decoupled weight decay).
        block_size: elements per scale (default 256). Sharded parameters must be cut on multiples of it
            (``granularity=adamw8bit_granularity(block_size)``).
        min_8bit_size: tensors with fewer elements keep fp32 ``exp_avg`` / ``exp_avg_sq`` (default 1024); a
            very large value keeps everything in fp32, which is then bitwise ``torch.optim.AdamW(foreach=False)``.

    .. note::
        A sharded parameter cut inside a block raises ``ValueError`` naming it and the granularity to shard
        with; tensor-parallel weights (sharded over another mesh too) are refused the same way. ``amsgrad``,
        ``foreach``, ``fused``, ``capturable`` and complex parameters are not supported.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: Union[float, Tensor] = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        maximize: bool = False,
        block_size: int = DEFAULT_BLOCK_SIZE,
        min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE,
    ) -> None:
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (len(betas) == 2 and 0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid betas: {betas}; expected two numbers in [0, 1)")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        check_block_args(block_size, min_8bit_size)
        self.block_size = block_size
        self.min_8bit_size = min_8bit_size
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "maximize": maximize}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """``Optimizer.add_param_group``, then refuse parameters whose layout splits a block, naming them."""
        super().add_param_group(param_group)
        for i, p in enumerate(self.param_groups[-1]["params"]):
            if torch.is_complex(p):
                raise ValueError("AdamW8bit does not support complex parameters")
            self._check_layout(p, f"parameter {i} of param group {len(self.param_groups) - 1} (shape {tuple(p.shape)})")

    def _check_layout(self, p: Tensor, where: str) -> None:
        """Refuse a sharded ``p`` whose cuts split a block (at construction, and again at its first step: an
        integration may point the optimizer at sharded parameters after building it)."""
        if self.quantizes(p) and is_ragged(p):
            layout = p.layout_info
            if layout.outer is not None and layout.outer.is_sharded:
                raise ValueError(
                    f"AdamW8bit cannot step {where}: tensor parallelism splits it over {layout.outer.mesh}, and its "
                    f"blocks would be counted on the tensor-parallel piece. Give tensor-parallel weights to "
                    f"torch.optim.AdamW, or train without tensor parallelism."
                )
            cut = _straddled_cut(layout, self.block_size)
            if cut is not None:
                raise ValueError(
                    f"AdamW8bit cannot step {where}: its shard cut at element {cut} falls inside an 8-bit block of "
                    f"{self.block_size} elements (pieces {list(layout.ranges)}), so a block would be split between "
                    f"ranks. Shard with granularity={adamw8bit_granularity(self.block_size)!r} "
                    f"(lightning_vescale.optim.adamw8bit_granularity({self.block_size})), or pass a min_8bit_size "
                    f"above {p.numel()} to keep this tensor's states in fp32."
                )

    def quantizes(self, p: Tensor) -> bool:
        """Whether ``p``'s moments are stored in 8 bits (by global size: the same on every world size)."""
        return p.numel() >= max(self.min_8bit_size, 1)

    def state_layout(self, p: Tensor, key: str) -> Optional[Union[RaggedLayout, tuple[int, ...]]]:
        """For checkpoints: the layout of state ``key`` of ``p`` when it is not shaped like ``p`` (one scale per
        block): a RaggedLayout for a sharded ``p`` (blocks cut where the parameter is), a shape for a plain one;
        None for per-element and scalar states."""
        if key not in _SCALES.values() or not self.quantizes(p):
            return None
        return self._blocks_layout(p)

    def _blocks_layout(self, p: Tensor) -> Union[RaggedLayout, tuple[int, ...]]:
        if is_ragged(p):
            return _block_layout(p.layout_info, self.block_size)
        return (num_blocks(p.numel(), self.block_size),)

    # -- states ---------------------------------------------------------------------------------------------
    def _wrap(self, p: Tensor, local: Tensor, key: str) -> Tensor:
        if is_ragged(p):
            layout = self._blocks_layout(p) if key in _SCALES.values() else p.layout_info
            assert isinstance(layout, RaggedLayout)
            return RaggedTensor(local, layout)
        return local

    def _init_state(self, p: Tensor, state: dict) -> None:
        self._check_layout(p, f"a parameter of shape {tuple(p.shape)}")
        state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
        piece = local_tensor(p)
        if not self.quantizes(p):
            for m in _MOMENTS:
                state[m] = self._wrap(p, torch.zeros_like(piece, memory_format=torch.preserve_format), m)
            return
        nb = num_blocks(piece.numel(), self.block_size)
        for m in _MOMENTS:
            # Code of 0.0 in the map, scale 0: the moments start at zero exactly.
            zero_code = _qmap(m == "exp_avg", torch.device("cpu")).zero_code
            state[_CODES[m]] = self._wrap(p, torch.full(piece.shape, zero_code, dtype=torch.uint8, device=piece.device),
                                          _CODES[m])
            state[_SCALES[m]] = self._wrap(p, torch.zeros(nb, dtype=torch.float32, device=piece.device), _SCALES[m])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Optional[Any]:  # type: ignore[override]  # one body for torch's overloads
        """One AdamW step on every parameter with a gradient (see [Note: block-wise 8-bit states])."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = _to_scalar(group["lr"]), group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW8bit does not support sparse gradients")
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1
                self._update(p, state, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                             maximize=group["maximize"])
        return loss

    def _update(self, p: Tensor, state: dict, *, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, maximize: bool) -> None:
        assert p.grad is not None  # stepped parameters have a gradient
        param, grad = local_tensor(p), local_tensor(p.grad)
        if maximize:
            grad = -grad
        quantized = self.quantizes(p)
        if quantized:
            exp_avg, exp_avg_sq = (
                dequantize_blockwise(local_tensor(state[_CODES[m]]), local_tensor(state[_SCALES[m]]), self.block_size,
                                     signed=m == "exp_avg").to(param.dtype) for m in _MOMENTS)
        else:
            exp_avg, exp_avg_sq = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
        # torch.optim.adam._single_tensor_adam with decoupled weight decay, op for op.
        param.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = _get_value(state["step"])
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)
        if quantized:  # in place: the state tensors keep their objects (memory tiers swap their storage)
            for m, value in zip(_MOMENTS, (exp_avg, exp_avg_sq)):
                quantize_blockwise(value, self.block_size, signed=m == "exp_avg",
                                   out=(local_tensor(state[_CODES[m]]), local_tensor(state[_SCALES[m]])))

    # -- state dict -------------------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, then every state laid out as this optimizer keeps it.

        Accepted per parameter: this optimizer's codes and scales (RaggedTensors of the parameter's layout and
        of its blocks, or full tensors of the global shapes: each rank takes its piece), or AdamW's fp32
        ``exp_avg`` / ``exp_avg_sq`` (quantized here); codes for a parameter kept in fp32 are dequantized.
        """
        super().load_state_dict(state_dict)  # casts the codes to the parameter's dtype; they return to uint8 below
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state:
                    self._restore(p, state)

    def _piece(self, p: Tensor, value: Tensor, key: str) -> Tensor:
        """This rank's piece of ``value``, a state ``key`` of ``p`` (a plain tensor)."""
        layout = self._blocks_layout(p) if key in _SCALES.values() else None
        expected = p.layout_info if is_ragged(p) and layout is None else layout
        if not is_ragged(p):
            assert not isinstance(layout, RaggedLayout)  # a plain parameter's blocks: a shape
            full = value.full_tensor() if isinstance(value, DTensor) else value
            shape = tuple(p.shape) if layout is None else layout
            if tuple(full.shape) != tuple(shape):
                raise ValueError(f"optimizer state {key!r} has shape {tuple(full.shape)}, expected {tuple(shape)}")
            return full.to(p.device)
        assert isinstance(expected, RaggedLayout)
        if is_ragged(value) and value.layout_info == expected:
            return local_tensor(value)
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if tuple(full.shape) != tuple(expected.global_shape):
            raise ValueError(
                f"optimizer state {key!r} has shape {tuple(full.shape)}, expected {tuple(expected.global_shape)} (a "
                f"state of another optimizer, block size or model?)"
            )
        return expected.take_piece(full.to(p.device)).clone()

    def _restore(self, p: Tensor, state: dict) -> None:
        self._check_layout(p, f"a parameter of shape {tuple(p.shape)}")
        piece = local_tensor(p)
        out: dict[str, Any] = {k: v for k, v in state.items() if k == "step" or not isinstance(v, Tensor)}
        quantized = self.quantizes(p)
        for m in _MOMENTS:
            signed = m == "exp_avg"
            if _CODES[m] in state and _SCALES[m] in state:
                codes = self._piece(p, state[_CODES[m]], _CODES[m]).round().to(torch.uint8).view(piece.shape)
                scales = self._piece(p, state[_SCALES[m]], _SCALES[m]).float().reshape(-1)
                if quantized and scales.numel() != num_blocks(piece.numel(), self.block_size):
                    raise ValueError(f"optimizer state {_SCALES[m]!r}: {scales.numel()} scales for "
                                     f"{piece.numel()} elements in blocks of {self.block_size}")
                if not quantized:
                    out[m] = self._wrap(p, dequantize_blockwise(codes, scales, self.block_size, signed=signed)
                                        .to(piece.dtype), m)
                    continue
            elif m in state:
                values = self._piece(p, state[m], m).to(piece.dtype).view(piece.shape)
                if not quantized:
                    out[m] = self._wrap(p, values.contiguous(), m)
                    continue
                codes, scales = quantize_blockwise(values, self.block_size, signed=signed)
            else:
                raise ValueError(f"the optimizer state of a parameter of shape {tuple(p.shape)} has no {m!r} (nor "
                                 f"{_CODES[m]!r} and {_SCALES[m]!r}): keys {sorted(map(str, state))}")
            out[_CODES[m]] = self._wrap(p, codes.contiguous(), _CODES[m])
            out[_SCALES[m]] = self._wrap(p, scales.contiguous(), _SCALES[m])
        state.clear()
        state.update(out)

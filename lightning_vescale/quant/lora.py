"""LoRA adapters over a (possibly block-quantized) frozen base, laid out as PEFT lays them out.

``apply_lora(model, targets=..., rank=r, alpha=a)`` replaces every ``nn.Linear`` whose module name matches a
glob of ``targets`` by a :class:`LoRALinear`: ``base_layer`` (the original Linear, frozen) plus
``lora_A`` (``in -> r``, Kaiming-uniform as ``nn.Linear`` and PEFT initialize it) and ``lora_B`` (``r -> out``,
zeros), output ``base_layer(x) + lora_B(lora_A(x)) * alpha / r``. Every other parameter of the model is frozen.
The module names are PEFT's, so the adapters export as ``adapter_model.safetensors`` under
``base_model.model.<Hugging Face module>.lora_A.weight`` (:mod:`~lightning_vescale.quant.peft`).

The adapters are ordinary parameters: ``fully_shard`` shards them like any trained weight (fp32 master pieces,
optimizer states for the local pieces only) while the frozen base goes to quantized storage.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["LoRAConfig", "LoRALinear", "apply_lora", "load_base_state_dict", "lora_modules", "merged_weight"]


@dataclass(frozen=True)
class LoRAConfig:
    """Which Linear layers get adapters, and their size."""

    rank: int = 8
    """Rank ``r`` of each adapter (``lora_A``: ``in -> r``, ``lora_B``: ``r -> out``)."""
    alpha: float = 16.0
    """The adapter's output is scaled by ``alpha / rank`` (PEFT's ``lora_alpha``)."""
    targets: tuple[str, ...] = field(default=("*attention.w*", "*feed_forward.w*"))
    """Globs over module names (``layers.0.attention.wq``); every one must match at least one ``nn.Linear``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if not (isinstance(self.rank, int) and self.rank > 0):
            raise ValueError(f"LoRA rank must be a positive int, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha!r}")
        if not self.targets:
            raise ValueError("LoRA targets is empty: give module-name globs such as '*attention.w*'")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class _ZeroInitLinear(nn.Linear):
    """``lora_B``: starts at zero, so the adapted model starts as the base model."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


class LoRALinear(nn.Module):
    """``base_layer(x) + lora_B(lora_A(x)) * scaling`` with a frozen ``base_layer`` (see the module note)."""

    def __init__(self, base_layer: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        device = base_layer.weight.device
        self.base_layer = base_layer
        self.lora_A = nn.Linear(base_layer.in_features, rank, bias=False, device=device)
        self.lora_B = _ZeroInitLinear(rank, base_layer.out_features, bias=False, device=device)
        self.rank = rank
        self.scaling = alpha / rank
        if device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        # As PEFT: A Kaiming-uniform (nn.Linear's own init), B zeros.
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling

    def extra_repr(self) -> str:
        return f"rank={self.rank}, scaling={self.scaling}"


def apply_lora(model: nn.Module, config: LoRAConfig) -> list[str]:
    """Wrap the ``nn.Linear`` modules matching ``config.targets`` in :class:`LoRALinear` and freeze everything else.

    Works on real and meta-device models (apply it before ``fully_shard``). Returns the wrapped module names.

    Raises:
        ValueError: a target glob matches no ``nn.Linear`` (the message shows what module names look like).
    """
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(
        m, _ZeroInitLinear) and not name.endswith(".lora_A")]
    chosen = [n for n in linears if any(fnmatch.fnmatchcase(n, pat) for pat in config.targets)]
    unused = [pat for pat in config.targets if not any(fnmatch.fnmatchcase(n, pat) for n in linears)]
    if unused:
        raise ValueError(f"LoRA target pattern(s) {unused} match no nn.Linear module; Linear modules are named like "
                         f"{linears[:6]}")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in chosen:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, LoRALinear(getattr(parent, attr), config.rank, config.alpha))
    return chosen


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def merged_weight(module: LoRALinear, base_weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``W + scaling * B @ A`` in fp32 (full tensors: ``base_weight`` dequantized, ``a``/``b`` the adapters)."""
    return base_weight.float() + module.scaling * (b.float() @ a.float())


@torch.no_grad()
def load_base_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full state dict of the model *without* adapters (e.g. ``from_pretrained(...).state_dict()``) into
    the adapted, possibly quantized and sharded, model; the adapters keep their values.

    ``X.weight`` of a wrapped Linear goes to ``X.base_layer.weight``. A quantized parameter takes a
    :class:`~lightning_vescale.quant.tensor.QuantizedTensor` of its format as it is (codes and scales copied,
    e.g. from an FP8 checkpoint loaded with ``quantized_weights="keep"``) and quantizes anything else (each rank
    its own tiles). Every other entry loads as a full state dict (each rank its own pieces).

    Raises:
        ValueError: names missing from or unexpected in ``state`` (all listed), or a shape mismatch; nothing is
            changed then.
    """
    from lightning_vescale.checkpoint import load_full_state_dict
    from lightning_vescale.quant.tensor import SCALE_SUFFIX, is_quantized
    from lightning_vescale.state_dict.report import mismatch_report

    wrapped = lora_modules(model)
    renamed = {}
    for name, value in state.items():
        module, _, leaf = name.rpartition(".")
        renamed[f"{module}.base_layer.{leaf}" if module in wrapped else name] = value
    adapters = {f"{m}.{part}.weight" for m in wrapped for part in ("lora_A", "lora_B")}
    params = dict(model.named_parameters(remove_duplicate=False))
    quantized = {n: p for n, p in params.items() if is_quantized(p)}
    expected = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if name in adapters or (name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in quantized):
            continue
        if isinstance(value, torch.Tensor):
            expected[name] = tuple(params[name].shape if name in params else value.shape)
    report = mismatch_report(expected, {n: tuple(v.shape) for n, v in renamed.items()}, ours="model",
                             theirs="state dict")
    if report:
        raise ValueError(f"the base weights do not match the adapted model:\n{report}")
    for name, p in quantized.items():
        value = renamed[name]
        if is_quantized(value) and value.fmt != p.fmt:
            value = value.dequantize(torch.float32)  # another format: re-quantize (the user chose the format)
        p.detach().copy_(value)
    rest = {n: (v.dequantize() if is_quantized(v) else v) for n, v in renamed.items() if n not in quantized}
    load_full_state_dict(model, rest, strict=False)

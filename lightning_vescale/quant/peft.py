"""LoRA adapters and merged weights out of a (sharded, quantized) model, in Hugging Face / PEFT files.

* :func:`save_peft_adapter`: ``adapter_model.safetensors`` (``base_model.model.<Hugging Face module>.lora_A.weight``
  / ``lora_B.weight``) and ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``, ``target_modules``),
  which ``peft.PeftModel.from_pretrained(base, path)`` loads onto the Hugging Face base model.
* :func:`merged_state_dict`: the full model in our names with every adapter merged (``W + alpha/r * B @ A``,
  the base dequantized), ready for :func:`~lightning_vescale.models.save_pretrained`; :func:`base_state_dict`
  is the same without the adapters (the dequantized base the adapters were trained on).

All of them are collectives on a sharded model (every rank calls them; ``write`` on rank 0 only is the caller's
choice) and read nothing but full tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors.torch import save_file
from torch import nn

from lightning_vescale.engine.tensor import is_ragged
from lightning_vescale.quant.lora import LoRALinear, lora_modules
from lightning_vescale.quant.tensor import is_quantized, weights_state_dict

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "base_state_dict", "merged_state_dict", "save_peft_adapter"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a parameter: dequantized and/or gathered (a collective when sharded)."""
    if is_quantized(t):
        return t.dequantize(torch.float32)
    if is_ragged(t):
        return t.full_tensor()
    return t.detach()


def _collect(model: nn.Module, merge: bool, dtype: Optional[torch.dtype]) -> dict[str, torch.Tensor]:
    lora = lora_modules(model)
    adapters = {f"{name}.{part}.weight": name for name in lora for part in ("lora_A", "lora_B")}
    state: dict[str, torch.Tensor] = {}
    full: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, value in weights_state_dict(model).items():
        if isinstance(value, torch.Tensor):
            full[name] = _full(params.get(name, value))
    for name, value in full.items():
        if name in adapters:
            continue
        module_name, _, leaf = name.rpartition(".")
        if module_name.endswith(".base_layer") and module_name[: -len(".base_layer")] in lora:
            owner = module_name[: -len(".base_layer")]
            out_name = f"{owner}.{leaf}"
            if merge and leaf == "weight":
                m: LoRALinear = lora[owner]
                a, b = full[f"{owner}.lora_A.weight"], full[f"{owner}.lora_B.weight"]
                value = value.float() + m.scaling * (b.float() @ a.float())
            state[out_name] = value
        else:
            state[name] = value
    return {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in state.items()}


def merged_state_dict(model: nn.Module, *, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """The full model in its original names (no ``base_layer`` / ``lora_*``) with the adapters merged."""
    return _collect(model, merge=True, dtype=dtype)


def base_state_dict(model: nn.Module, *, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """The full (dequantized) base model in its original names, without the adapters."""
    return _collect(model, merge=False, dtype=dtype)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter's full ``lora_A`` / ``lora_B`` weight, in our names."""
    return {f"{name}.{part}.weight": _full(getattr(m, part).weight)
            for name, m in lora_modules(model).items() for part in ("lora_A", "lora_B")}


def save_peft_adapter(
    model: nn.Module, config: Any, path: Union[str, Path], *, model_type: Optional[str] = None,
    base_model_name_or_path: Optional[str] = None, write: bool = True,
) -> Optional[Path]:
    """Write the model's LoRA adapters as a PEFT adapter directory (see the module note).

    Args:
        model: a model with :class:`~lightning_vescale.quant.lora.LoRALinear` modules (sharded or not).
        config: its model config (for the Hugging Face names).
        path: the output directory (created).
        model_type: the Hugging Face ``model_type`` of the base (as :func:`save_pretrained` takes it).
        base_model_name_or_path: recorded in ``adapter_config.json`` (PEFT's field).
        write: whether this rank writes (every rank must call: the adapters are gathered).

    Raises:
        ValueError: the model has no LoRA adapters, or their scaling differs between modules.
    """
    from lightning_vescale.models.hf import hf_parameter_names

    lora = lora_modules(model)
    if not lora:
        raise ValueError("the model has no LoRA adapters (lightning_vescale.quant.lora.apply_lora adds them)")
    ranks = {m.rank for m in lora.values()}
    scalings = {m.scaling for m in lora.values()}
    if len(ranks) != 1 or len(scalings) != 1:
        raise ValueError(f"one adapter config per directory: ranks {sorted(ranks)}, scalings {sorted(scalings)}")
    weights = adapter_state_dict(model)
    if not write:
        return None
    hf_names = hf_parameter_names(config, [f"{name}.weight" for name in lora], model_type=model_type)
    tensors = {}
    for name in lora:
        hf_module = hf_names[f"{name}.weight"].removesuffix(".weight")
        for part in ("lora_A", "lora_B"):
            tensors[f"base_model.model.{hf_module}.{part}.weight"] = weights[f"{name}.{part}.weight"].contiguous()
    rank = ranks.pop()
    targets = sorted({hf_names[f"{name}.weight"].removesuffix(".weight").rsplit(".", 1)[-1] for name in lora})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": scalings.pop() * rank,
        "lora_dropout": 0.0,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": base_model_name_or_path,
    }
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    (path / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    return path


def save_merged_pretrained(
    model: nn.Module, config: Any, path: Union[str, Path], *, model_type: Optional[str] = None,
    dtype: Optional[torch.dtype] = None, write: bool = True,
) -> Optional[Path]:
    """Write the model with its adapters merged as a Hugging Face directory (``config.json`` + safetensors).

    Every rank must call it (the weights are gathered); ``write`` says whether this rank writes.
    """
    from lightning_vescale.models.families import FAMILIES, family_of
    from lightning_vescale.models.hf import save_pretrained

    state = merged_state_dict(model, dtype=torch.float32)
    if not write:
        return None
    with torch.device("meta"):
        plain = FAMILIES[family_of(config)].model_cls(config)
    plain.load_state_dict(state, strict=True, assign=True)
    save_pretrained(plain, config, path, model_type=model_type, dtype=dtype)
    return Path(path)

"""The model families by name: config class, presets, preset lookup and model class (one table for all users)."""

from __future__ import annotations

from typing import Any, NamedTuple

from lightning_vescale.models.deepseek_v3 import DEEPSEEK_V3_CONFIGS, DeepSeekV3, DeepSeekV3Config, deepseek_v3_config
from lightning_vescale.models.llama import LLAMA_CONFIGS, Llama, LlamaConfig, llama_config
from lightning_vescale.models.moe import MOE_CONFIGS, MoE, MoEConfig, moe_config
from lightning_vescale.models.qwen3_moe import QWEN3_MOE_CONFIGS, Qwen3MoE, Qwen3MoEConfig, qwen3_moe_config

__all__ = ["FAMILIES", "Family", "family_of"]


class Family(NamedTuple):
    config_cls: type
    presets: dict
    preset: Any
    """``preset(name) -> config``."""
    model_cls: type


FAMILIES: dict[str, Family] = {
    "llama": Family(LlamaConfig, LLAMA_CONFIGS, llama_config, Llama),
    "moe": Family(MoEConfig, MOE_CONFIGS, moe_config, MoE),
    "qwen3_moe": Family(Qwen3MoEConfig, QWEN3_MOE_CONFIGS, qwen3_moe_config, Qwen3MoE),
    "deepseek_v3": Family(DeepSeekV3Config, DEEPSEEK_V3_CONFIGS, deepseek_v3_config, DeepSeekV3),
}


def family_of(config: Any) -> str:
    """The family name of a model config."""
    for name, family in FAMILIES.items():
        if type(config) is family.config_cls:
            return name
    raise ValueError(f"{type(config).__name__} is not a model config of any family ({', '.join(FAMILIES)})")

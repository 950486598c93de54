"""Models as plain PyTorch modules (no parallel code inside), plus Hugging Face interop."""

from lightning_vescale.models.deepseek_v3 import DEEPSEEK_V3_CONFIGS, DeepSeekV3, DeepSeekV3Config, deepseek_v3_config
from lightning_vescale.models.hf import from_pretrained, save_pretrained
from lightning_vescale.models.llama import (
    LLAMA_CONFIGS,
    Llama,
    LlamaConfig,
    RopeScaling,
    TransformerBlock,
    llama_config,
    num_params,
)
from lightning_vescale.models.moe import (
    MOE_CONFIGS,
    GroupedExperts,
    MoE,
    MoEConfig,
    MoEFeedForward,
    TopKRouter,
    moe_config,
    num_active_params,
)
from lightning_vescale.models.qwen3_moe import QWEN3_MOE_CONFIGS, Qwen3MoE, Qwen3MoEConfig, qwen3_moe_config
from lightning_vescale.models.yarn import YarnScaling

__all__ = [
    "DEEPSEEK_V3_CONFIGS",
    "LLAMA_CONFIGS",
    "MOE_CONFIGS",
    "QWEN3_MOE_CONFIGS",
    "DeepSeekV3",
    "DeepSeekV3Config",
    "GroupedExperts",
    "Llama",
    "LlamaConfig",
    "MoE",
    "MoEConfig",
    "MoEFeedForward",
    "Qwen3MoE",
    "Qwen3MoEConfig",
    "RopeScaling",
    "TopKRouter",
    "TransformerBlock",
    "YarnScaling",
    "deepseek_v3_config",
    "from_pretrained",
    "llama_config",
    "moe_config",
    "num_active_params",
    "num_params",
    "qwen3_moe_config",
    "save_pretrained",
]

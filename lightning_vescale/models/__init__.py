"""Models as plain PyTorch modules (no parallel code inside), plus Hugging Face interop."""

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

__all__ = [
    "LLAMA_CONFIGS",
    "MOE_CONFIGS",
    "GroupedExperts",
    "Llama",
    "LlamaConfig",
    "MoE",
    "MoEConfig",
    "MoEFeedForward",
    "RopeScaling",
    "TopKRouter",
    "TransformerBlock",
    "from_pretrained",
    "llama_config",
    "moe_config",
    "num_active_params",
    "num_params",
    "save_pretrained",
]

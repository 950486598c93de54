"""Hugging Face ``DeepseekV3ForCausalLM`` (``model_type: deepseek_v3``) to and from :class:`~.deepseek_v3.DeepSeekV3`.

The router's ``e_score_correction_bias`` is our ``expert_bias`` (the auxiliary-loss-free balancing bias), so
it is loaded and saved (in float32, as transformers keeps it). The multi-token-prediction layers of the
released checkpoint (``model.layers.61.*``, ``num_nextn_predict_layers``) are skipped on load, as
transformers does. FP8 block checkpoints (a ``quantization_config``) load through
``from_pretrained(..., quantized_weights="dequantize" | "keep")``.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_vescale.models.deepseek_v3 import DeepSeekV3, DeepSeekV3Config
from lightning_vescale.models.hf_adapter import (
    COMMON_LAYER_NAMES,
    HFAdapter,
    check_silu,
    hf_get,
    rope_from_hf,
    rope_to_hf,
)

__all__ = ["DEEPSEEK_V3_ADAPTER"]

_LAYER_NAMES = (
    ("attention.wq.weight", "self_attn.q_proj.weight"),
    ("attention.wq_a.weight", "self_attn.q_a_proj.weight"),
    ("attention.q_norm.weight", "self_attn.q_a_layernorm.weight"),
    ("attention.wq_b.weight", "self_attn.q_b_proj.weight"),
    ("attention.wkv_a.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    ("attention.kv_norm.weight", "self_attn.kv_a_layernorm.weight"),
    ("attention.wkv_b.weight", "self_attn.kv_b_proj.weight"),
    ("attention.wo.weight", "self_attn.o_proj.weight"),
    ("feed_forward.router.expert_bias", "mlp.gate.e_score_correction_bias"),
    ("feed_forward.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
    ("feed_forward.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"),
    ("feed_forward.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
    *COMMON_LAYER_NAMES,
)


def _config_from_hf(hf: dict[str, Any]) -> DeepSeekV3Config:
    check_silu(hf)
    if hf.get("attention_bias", False):
        raise ValueError("config.json: attention_bias=true is not supported for deepseek_v3")
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"config.json: scoring_func={hf['scoring_func']!r} is not supported (DeepSeek-V3: 'sigmoid')")
    if hf.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"config.json: moe_layer_freq={hf['moe_layer_freq']} is not supported (only 1)")
    n_heads = hf_get(hf, "num_attention_heads")
    n_kv_heads = hf.get("num_key_value_heads") or n_heads
    if n_kv_heads != n_heads:
        raise ValueError(
            f"config.json: num_key_value_heads={n_kv_heads} differs from num_attention_heads={n_heads}; multi-head "
            "latent attention expands keys and values to every head"
        )
    rope_theta, rope_scaling = rope_from_hf(hf)
    return DeepSeekV3Config(
        vocab_size=hf_get(hf, "vocab_size"),
        dim=hf_get(hf, "hidden_size"),
        n_layers=hf_get(hf, "num_hidden_layers"),
        n_heads=n_heads,
        q_lora_rank=hf.get("q_lora_rank") or 0,  # null: no bottleneck
        kv_lora_rank=hf_get(hf, "kv_lora_rank"),
        qk_nope_head_dim=hf_get(hf, "qk_nope_head_dim"),
        qk_rope_head_dim=hf_get(hf, "qk_rope_head_dim"),
        v_head_dim=hf_get(hf, "v_head_dim"),
        rope_interleave=bool(hf.get("rope_interleave", True)),  # transformers' default
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_seq_len=hf.get("max_position_embeddings", 4096),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
        num_experts=hf_get(hf, "n_routed_experts"),
        top_k=hf_get(hf, "num_experts_per_tok"),
        moe_hidden=hf_get(hf, "moe_intermediate_size"),
        n_shared_experts=hf.get("n_shared_experts") or 0,
        num_expert_groups=hf.get("n_group") or 1,
        top_k_groups=hf.get("topk_group") or 1,
        route_norm=bool(hf.get("norm_topk_prob", True)),
        route_scale=float(hf.get("routed_scaling_factor", 1.0)),
        aux_loss_coef=0.0,
        n_dense_layers=hf.get("first_k_dense_replace") or 0,
        dense_ffn_hidden=hf_get(hf, "intermediate_size"),
    )


def _config_to_hf(config: DeepSeekV3Config, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_heads,
        "q_lora_rank": config.q_lora_rank or None,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "rope_interleave": config.rope_interleave,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        **rope_to_hf(config.rope_theta, config.rope_scaling),
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "intermediate_size": config.dense_ffn_hidden,
        "moe_intermediate_size": config.moe_hidden,
        "n_routed_experts": config.num_experts,
        "num_experts_per_tok": config.top_k,
        "n_shared_experts": config.n_shared_experts,
        "n_group": config.num_expert_groups,
        "topk_group": config.top_k_groups,
        "norm_topk_prob": config.route_norm,
        "routed_scaling_factor": config.route_scale,
        "first_k_dense_replace": config.n_dense_layers,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0,
    }


def _export_problems(config: DeepSeekV3Config) -> list[str]:
    if config.n_shared_experts == 0:
        return ["n_shared_experts=0 (transformers' DeepSeek-V3 always has shared experts)"]
    return []


DEEPSEEK_V3_ADAPTER = HFAdapter(
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    config_class=DeepSeekV3Config,
    model_class=DeepSeekV3,
    layer_names=_LAYER_NAMES,
    config_from_hf=_config_from_hf,
    config_to_hf=_config_to_hf,
    export_problems=_export_problems,
    extra_layers_are_mtp=True,
    fp32_names=("e_score_correction_bias",),
)

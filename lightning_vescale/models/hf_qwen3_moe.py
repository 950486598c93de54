"""Hugging Face ``Qwen3MoeForCausalLM`` (``model_type: qwen3_moe``) to and from :class:`~.qwen3_moe.Qwen3MoE`.

``mlp_only_layers`` and ``decoder_sparse_step`` become :attr:`~.qwen3_moe.Qwen3MoEConfig.dense_layers` by
transformers' rule (layer i is sparse unless it is in ``mlp_only_layers`` or ``(i + 1) % step != 0``);
saving writes ``decoder_sparse_step: 1`` and the dense layers as ``mlp_only_layers``, which builds the same
model. ``router_aux_loss_coef`` is only used by transformers when asked for router logits and its loss is
not ours (see moe.py's note), so loading sets ``aux_loss_coef = 0``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from lightning_vescale.models.hf_adapter import (
    COMMON_LAYER_NAMES,
    HFAdapter,
    check_silu,
    hf_get,
    rope_from_hf,
    rope_to_hf,
)
from lightning_vescale.models.qwen3_moe import Qwen3MoE, Qwen3MoEConfig

__all__ = ["QWEN3_MOE_ADAPTER"]

_LAYER_NAMES = (
    ("attention.wq.weight", "self_attn.q_proj.weight"),
    ("attention.wk.weight", "self_attn.k_proj.weight"),
    ("attention.wv.weight", "self_attn.v_proj.weight"),
    ("attention.wo.weight", "self_attn.o_proj.weight"),
    ("attention.q_norm.weight", "self_attn.q_norm.weight"),
    ("attention.k_norm.weight", "self_attn.k_norm.weight"),
    *COMMON_LAYER_NAMES,
)


def _config_from_hf(hf: dict[str, Any]) -> Qwen3MoEConfig:
    check_silu(hf)
    if hf.get("attention_bias", False):
        raise ValueError("config.json: attention_bias=true is not supported for qwen3_moe (q/k/v/o biases)")
    if hf.get("use_sliding_window", False):
        warnings.warn("config.json: use_sliding_window is ignored; full causal attention is used", stacklevel=4)
    n_layers = hf_get(hf, "num_hidden_layers")
    # transformers 5 writes num_experts as num_local_experts (an attribute alias).
    num_experts = hf["num_experts"] if "num_experts" in hf else hf_get(hf, "num_local_experts")
    step = hf.get("decoder_sparse_step", 1)
    mlp_only = set(hf.get("mlp_only_layers") or [])
    # transformers' rule for which layers are sparse (Qwen3MoeDecoderLayer).
    dense = tuple(i for i in range(n_layers) if i in mlp_only or not (num_experts > 0 and (i + 1) % step == 0))
    dim, n_heads = hf_get(hf, "hidden_size"), hf_get(hf, "num_attention_heads")
    rope_theta, rope_scaling = rope_from_hf(hf)
    return Qwen3MoEConfig(
        vocab_size=hf_get(hf, "vocab_size"),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or dim // n_heads,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_seq_len=hf.get("max_position_embeddings", 32768),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
        num_experts=num_experts,
        top_k=hf_get(hf, "num_experts_per_tok"),
        moe_hidden=hf_get(hf, "moe_intermediate_size"),
        route_norm=bool(hf.get("norm_topk_prob", False)),
        aux_loss_coef=0.0,
        dense_layers=dense,
        dense_ffn_hidden=hf_get(hf, "intermediate_size") if dense else int(hf.get("intermediate_size") or 0),
    )


def _config_to_hf(config: Qwen3MoEConfig, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
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
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.top_k,
        "norm_topk_prob": config.route_norm,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(config.dense_layers),
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": config.n_layers,
        "output_router_logits": False,
        "router_aux_loss_coef": config.aux_loss_coef,
    }


QWEN3_MOE_ADAPTER = HFAdapter(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    config_class=Qwen3MoEConfig,
    model_class=Qwen3MoE,
    layer_names=_LAYER_NAMES,
    config_from_hf=_config_from_hf,
    config_to_hf=_config_to_hf,
)

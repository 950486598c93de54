"""DeepSeek-V3 (Hugging Face ``DeepseekV3ForCausalLM``) in plain PyTorch.

An :class:`~lightning_vescale.models.moe.MoE` with two differences in the blocks:

* **Multi-head latent attention** (:class:`MLAttention`): queries go through a low-rank bottleneck
  (``wq_a`` to ``q_lora_rank``, RMSNorm, ``wq_b`` up to all heads), keys and values through a shared
  latent (``wkv_a`` to ``kv_lora_rank``, RMSNorm, ``wkv_b`` up to all heads). RoPE is *decoupled*: each
  query head has ``qk_rope_head_dim`` extra rotated dimensions, and ``wkv_a`` also produces one rotated
  key of that width shared by every head; the rest of each head (``qk_nope_head_dim``) carries no
  position. Values have their own width ``v_head_dim``.
* **Routing**: sigmoid scores, group-limited top-k (the experts form ``num_expert_groups`` groups, each
  token picks its ``top_k_groups`` best groups by the sum of their two best scores and chooses its top-k
  experts inside them), the auxiliary-loss-free bias ``expert_bias`` that only shifts the choice, chosen
  weights renormalized and scaled by ``route_scale``, plus ``n_shared_experts`` always-on experts. The first
  ``n_dense_layers`` blocks are dense SwiGLUs.

The multi-token-prediction module of the released checkpoint (its layer 61) is not part of the model.

Shape suffixes as in llama.py and moe.py, plus::

    C q_lora_rank   L kv_lora_rank   P qk_nope_head_dim   R qk_rope_head_dim   U v_head_dim

[Note: weights and Hugging Face names]
Inside ``layers.{i}.attention`` (Hugging Face: ``model.layers.{i}.self_attn``): ``wq`` = ``q_proj`` (when
``q_lora_rank`` is 0), ``wq_a`` = ``q_a_proj``, ``q_norm`` = ``q_a_layernorm``, ``wq_b`` =
``q_b_proj``, ``wkv_a`` = ``kv_a_proj_with_mqa``, ``kv_norm`` = ``kv_a_layernorm``, ``wkv_b`` =
``kv_b_proj``, ``wo`` = ``o_proj``. Inside ``layers.{i}.feed_forward`` (``mlp``): ``router.weight`` =
``gate.weight``, ``router.expert_bias`` = ``gate.e_score_correction_bias``, ``shared_experts.w1/w3/w2`` =
``shared_experts.gate_proj/up_proj/down_proj``, experts as in moe.py. No permutation: with
``rope_interleave`` (the released weights) the rotated dimensions come in interleaved pairs
``(2i, 2i+1)``, and :class:`MLAttention` regroups them to the rotate-half layout before RoPE, as
transformers does. :mod:`lightning_vescale.models.hf_deepseek_v3` does the renaming.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_vescale.models.llama import (
    Linear,
    RMSNorm,
    RotaryEmbedding,
    _lookup_preset,
    _require_positive,
    apply_rope,
)
from lightning_vescale.models.moe import MoE, check_group_routing
from lightning_vescale.models.yarn import YarnScaling, rotary_embedding, yarn_mscale

__all__ = ["DEEPSEEK_V3_CONFIGS", "DeepSeekV3", "DeepSeekV3Config", "MLAttention", "deepseek_v3_config"]

LATENT_NORM_EPS = 1e-6
"""Epsilon of the q/kv latent RMSNorms (fixed in DeepSeek's and transformers' code, not in the config)."""


@dataclass
class DeepSeekV3Config:
    """Shapes and hyper-parameters of a DeepSeek-V3 model. Validated on construction.

    Field names follow :class:`~lightning_vescale.models.moe.MoEConfig` where they mean the same; the Hugging
    Face name is given where it differs.
    """

    vocab_size: int = 256
    """Number of token ids."""
    dim: int = 64
    """Model width ``D`` (``hidden_size``)."""
    n_layers: int = 3
    """Number of transformer blocks (``num_hidden_layers``)."""
    n_heads: int = 4
    """Attention heads (``num_attention_heads``)."""
    q_lora_rank: int = 32
    """Rank ``C`` of the query bottleneck; 0: one full projection ``wq`` (Hugging Face's ``null``, as in
    DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 16
    """Width ``L`` of the shared key/value latent."""
    qk_nope_head_dim: int = 16
    """Per-head query/key dimensions without position ``P``."""
    qk_rope_head_dim: int = 8
    """Per-head rotated query/key dimensions ``R`` (the rotated key is shared by all heads)."""
    v_head_dim: int = 16
    """Per-head value width ``U``."""
    rope_interleave: bool = True
    """The rotated dimensions come in interleaved pairs ``(2i, 2i+1)`` (the released weights); False: the
    rotate-half layout ``(i, i + R/2)``."""
    norm_eps: float = 1e-6
    """Epsilon of the block and final RMSNorms (``rms_norm_eps``)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: Optional[YarnScaling] = None
    """YaRN context extension (DeepSeek-V3: factor 40 over 4096 positions), or ``None``. A dict of its fields
    is accepted. Its ``mscale_all_dim`` also scales the softmax (:attr:`softmax_scale`)."""
    max_seq_len: int = 128
    """Longest sequence the RoPE tables cover (``max_position_embeddings``)."""
    tie_embeddings: bool = False
    """Use ``tok_embeddings.weight`` as the output head's weight (``tie_word_embeddings``)."""
    init_std: float = 0.02
    """Standard deviation of the initial linear, embedding, router and expert weights (``initializer_range``)."""
    num_experts: int = 8
    """Routed experts per MoE layer (``n_routed_experts``)."""
    top_k: int = 2
    """Experts chosen per token (``num_experts_per_tok``)."""
    moe_hidden: int = 32
    """Hidden size of each routed and shared expert (``moe_intermediate_size``)."""
    n_shared_experts: int = 1
    """Always-on experts, run as one SwiGLU of width ``n_shared_experts * moe_hidden``."""
    num_expert_groups: int = 4
    """Expert groups of group-limited routing (``n_group``); 1 disables the limit."""
    top_k_groups: int = 2
    """Groups each token may choose experts from (``topk_group``)."""
    route_norm: bool = True
    """Renormalize the chosen sigmoid scores to sum to one (``norm_topk_prob``)."""
    route_scale: float = 2.5
    """Multiply the routing weights by this (``routed_scaling_factor``)."""
    aux_loss_coef: float = 0.0
    """Coefficient of the switch-style auxiliary loss (see moe.py's note); 0 disables it (DeepSeek-V3 balances
    with ``expert_bias``)."""
    n_dense_layers: int = 1
    """The first this many blocks use a dense SwiGLU (``first_k_dense_replace``)."""
    dense_ffn_hidden: int = 96
    """Hidden size of the dense SwiGLU (``intermediate_size``)."""

    # Fixed by the architecture; read by MoEFeedForward (class constants, not fields).
    score_func: ClassVar[str] = "sigmoid"
    shared_expert_gate: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _require_positive(self, ("vocab_size", "dim", "n_layers", "n_heads", "kv_lora_rank", "qk_nope_head_dim"))
        _require_positive(self, ("qk_rope_head_dim", "v_head_dim", "max_seq_len", "norm_eps", "rope_theta"))
        _require_positive(self, ("init_std", "num_experts", "top_k", "moe_hidden", "route_scale"))
        if self.q_lora_rank < 0:
            raise ValueError(f"DeepSeekV3Config.q_lora_rank must be >= 0 (0: no bottleneck), got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2 != 0:
            raise ValueError(f"DeepSeekV3Config.qk_rope_head_dim ({self.qk_rope_head_dim}) must be even for RoPE")
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = YarnScaling(**self.rope_scaling)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, YarnScaling):
            raise ValueError(
                f"DeepSeekV3Config.rope_scaling must be None, a YarnScaling or a dict of its fields, "
                f"got {self.rope_scaling!r}"
            )
        if self.top_k > self.num_experts:
            raise ValueError(f"DeepSeekV3Config.top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        check_group_routing(self, self.num_experts, self.top_k, self.num_expert_groups, self.top_k_groups)
        if self.n_shared_experts < 0:
            raise ValueError(f"DeepSeekV3Config.n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if self.aux_loss_coef < 0:
            raise ValueError(f"DeepSeekV3Config.aux_loss_coef must be >= 0, got {self.aux_loss_coef}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(
                f"DeepSeekV3Config.n_dense_layers must be in [0, n_layers={self.n_layers}], got {self.n_dense_layers}"
            )
        if self.n_dense_layers and not self.dense_ffn_hidden > 0:
            raise ValueError(
                f"DeepSeekV3Config.dense_ffn_hidden must be > 0 with n_dense_layers={self.n_dense_layers}, "
                f"got {self.dense_ffn_hidden}"
            )

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width ``P + R``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``(P + R) ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2`` under YaRN (as DeepSeek does)."""
        scale = self.qk_head_dim**-0.5
        if self.rope_scaling is not None and self.rope_scaling.mscale_all_dim:
            scale *= yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim) ** 2
        return scale

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """``(0, ..., n_dense_layers - 1)``."""
        return tuple(range(self.n_dense_layers))

    @property
    def shared_expert_hidden(self) -> int:
        """Width of the shared-expert SwiGLU, ``n_shared_experts * moe_hidden``."""
        return self.n_shared_experts * self.moe_hidden


DEEPSEEK_V3_CONFIGS: dict[str, DeepSeekV3Config] = {
    # Unit tests and CPU recipe runs: every feature on (low-rank q, groups, shared expert, a dense layer).
    "tiny": DeepSeekV3Config(
        vocab_size=256, dim=64, n_layers=3, n_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, num_experts=8, top_k=2, moe_hidden=32, n_shared_experts=1,
        num_expert_groups=4, top_k_groups=2, n_dense_layers=1, dense_ffn_hidden=96, max_seq_len=256,
    ),
    # deepseek-ai/DeepSeek-V3 (671B total, 37B active; without the multi-token-prediction layer).
    # Meta device only (dry-run planning).
    "671b": DeepSeekV3Config(
        vocab_size=129280, dim=7168, n_layers=61, n_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts=256, top_k=8, moe_hidden=2048,
        n_shared_experts=1, num_expert_groups=8, top_k_groups=4, route_scale=2.5, n_dense_layers=3,
        dense_ffn_hidden=18432, max_seq_len=163840,
        rope_scaling=YarnScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                                 mscale=1.0, mscale_all_dim=1.0),
    ),
}


def deepseek_v3_config(name: str) -> DeepSeekV3Config:
    """A fresh copy of the preset ``name`` from :data:`DEEPSEEK_V3_CONFIGS`.

    Raises:
        ValueError: ``name`` is not a preset; the message lists the valid names.
    """
    return _lookup_preset("deepseek_v3", DEEPSEEK_V3_CONFIGS, name)


class MLAttention(nn.Module):
    """Causal multi-head latent attention with decoupled RoPE (see the module docstring).

    Args:
        config: the model config (widths, ranks, ``rope_interleave``, ``softmax_scale``).
        out_init_std: std of ``wo`` (which writes into the residual stream).
    """

    def __init__(self, config: DeepSeekV3Config, *, out_init_std: float) -> None:
        super().__init__()
        std = config.init_std
        self.n_heads = config.n_heads
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.rope_interleave = config.rope_interleave
        self.softmax_scale = config.softmax_scale
        q_width = config.n_heads * config.qk_head_dim
        self.wq: Optional[Linear] = None
        self.wq_a: Optional[Linear] = None
        self.q_norm: Optional[RMSNorm] = None
        self.wq_b: Optional[Linear] = None
        if config.q_lora_rank == 0:
            self.wq = Linear(config.dim, q_width, init_std=std)
        else:
            self.wq_a = Linear(config.dim, config.q_lora_rank, init_std=std)
            self.q_norm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = Linear(config.q_lora_rank, q_width, init_std=std)
        self.wkv_a = Linear(config.dim, config.kv_lora_rank + config.qk_rope_head_dim, init_std=std)
        self.kv_norm = RMSNorm(config.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = Linear(config.kv_lora_rank, config.n_heads * (config.qk_nope_head_dim + config.v_head_dim),
                            init_std=std)
        self.wo = Linear(config.n_heads * config.v_head_dim, config.dim, init_std=out_init_std)

    def _rotate(self, x_BTHR: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
        if self.rope_interleave:
            # Pairs (2i, 2i+1) -> (i, i + R/2): the rotate-half layout apply_rope expects.
            x_BTHR = torch.cat([x_BTHR[..., 0::2], x_BTHR[..., 1::2]], dim=-1)
        return apply_rope(x_BTHR, cos_TR, sin_TR)

    def forward(self, x_BTD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        P, R, U = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        if self.wq is not None:
            q_BTX = self.wq(x_BTD)
        else:
            q_BTX = self.wq_b(self.q_norm(self.wq_a(x_BTD)))  # type: ignore[misc]
        # The heads this module computes: all of them, or a tensor-parallel rank's share when wq_b / wkv_b are split.
        H = q_BTX.shape[-1] // (P + R)
        q_nope_BTHP, q_rope_BTHR = q_BTX.view(B, T, H, P + R).split([P, R], dim=-1)
        kv_latent_BTL, k_rope_BTR = self.wkv_a(x_BTD).split([self.kv_lora_rank, R], dim=-1)
        kv_BTHX = self.wkv_b(self.kv_norm(kv_latent_BTL)).view(B, T, H, P + U)
        k_nope_BTHP, v_BTHU = kv_BTHX.split([P, U], dim=-1)

        q_rope_BTHR = self._rotate(q_rope_BTHR, cos_TR, sin_TR)
        k_rope_BT1R = self._rotate(k_rope_BTR.view(B, T, 1, R), cos_TR, sin_TR)
        q_BTHK = torch.cat([q_nope_BTHP, q_rope_BTHR], dim=-1)
        k_BTHK = torch.cat([k_nope_BTHP, k_rope_BT1R.expand(B, T, H, R)], dim=-1)
        out_BHTU = F.scaled_dot_product_attention(
            q_BTHK.transpose(1, 2), k_BTHK.transpose(1, 2), v_BTHU.transpose(1, 2), is_causal=True,
            scale=self.softmax_scale,
        )
        return self.wo(out_BHTU.transpose(1, 2).reshape(B, T, H * U))


class DeepSeekV3(MoE):
    """DeepSeek-V3 decoder: ``forward(tokens_BT) -> logits_BTV``.

    An :class:`~lightning_vescale.models.moe.MoE` (same submodules, balancing, expert parallelism) with
    :class:`MLAttention` blocks and RoPE tables of width ``qk_rope_head_dim``.
    """

    config: DeepSeekV3Config  # type: ignore[assignment]

    def __init__(self, config: DeepSeekV3Config) -> None:
        super().__init__(config)  # type: ignore[arg-type]

    @staticmethod
    def _rotary_embedding(config: DeepSeekV3Config) -> RotaryEmbedding:  # type: ignore[override]
        return rotary_embedding(config.qk_rope_head_dim, config.max_seq_len, config.rope_theta, config.rope_scaling)

    @staticmethod
    def _attention(config: DeepSeekV3Config, out_init_std: float) -> nn.Module:  # type: ignore[override]
        return MLAttention(config, out_init_std=out_init_std)

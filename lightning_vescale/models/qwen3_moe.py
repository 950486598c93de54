"""Qwen3-MoE (Hugging Face ``Qwen3MoeForCausalLM``) in plain PyTorch.

The model is an :class:`~lightning_vescale.models.moe.MoE` whose attention has its own head width
``head_dim`` (``n_heads * head_dim`` need not equal ``dim``: Qwen3-30B-A3B has ``dim=2048`` and
``32 x 128``-wide query heads) and RMS-normalizes every query and key head before RoPE (``q_norm`` /
``k_norm``). The MoE layers are softmax top-k routers over many experts (128, top-8 in the released
models) with optional renormalization of the chosen weights (``norm_topk_prob``), no shared expert;
``dense_layers`` use a dense SwiGLU (Hugging Face's ``mlp_only_layers`` and ``decoder_sparse_step``).

Shape suffixes as in llama.py and moe.py.

[Note: weights and Hugging Face names]
As for :class:`~lightning_vescale.models.moe.MoE` (see moe.py and hf.py), plus
``layers.{i}.attention.q_norm`` / ``k_norm`` = ``model.layers.{i}.self_attn.q_norm`` / ``k_norm``.
:mod:`lightning_vescale.models.hf_qwen3_moe` does the renaming.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from torch import nn

from lightning_vescale.models.llama import Attention, RotaryEmbedding, _lookup_preset, _require_positive
from lightning_vescale.models.moe import MoE
from lightning_vescale.models.yarn import YarnScaling, rotary_embedding

__all__ = ["QWEN3_MOE_CONFIGS", "Qwen3MoE", "Qwen3MoEConfig", "qwen3_moe_config"]


@dataclass
class Qwen3MoEConfig:
    """Shapes and hyper-parameters of a Qwen3-MoE model. Validated on construction.

    Field names and meanings follow :class:`~lightning_vescale.models.moe.MoEConfig`; the Hugging Face
    name is given where it differs.
    """

    vocab_size: int = 256
    """Number of token ids."""
    dim: int = 64
    """Model width ``D`` (``hidden_size``)."""
    n_layers: int = 2
    """Number of transformer blocks (``num_hidden_layers``)."""
    n_heads: int = 4
    """Query heads (``num_attention_heads``)."""
    n_kv_heads: int = 2
    """Key/value heads (``num_key_value_heads``); must divide ``n_heads``."""
    head_dim: int = 32
    """Per-head width ``K``, independent of ``dim`` (``head_dim``; 128 in the released models)."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm, the q/k norms included (``rms_norm_eps``)."""
    rope_theta: float = 1000000.0
    """RoPE base."""
    rope_scaling: Optional[YarnScaling] = None
    """YaRN context extension (``rope_scaling`` with ``rope_type: yarn``), or ``None``. A dict of its fields
    is accepted."""
    max_seq_len: int = 128
    """Longest sequence the RoPE tables cover (``max_position_embeddings``)."""
    tie_embeddings: bool = False
    """Use ``tok_embeddings.weight`` as the output head's weight (``tie_word_embeddings``)."""
    init_std: float = 0.02
    """Standard deviation of the initial linear, embedding, router and expert weights (``initializer_range``)."""
    num_experts: int = 8
    """Routed experts per MoE layer (``num_experts``)."""
    top_k: int = 2
    """Experts chosen per token (``num_experts_per_tok``)."""
    moe_hidden: int = 32
    """Hidden size of each routed expert (``moe_intermediate_size``)."""
    route_norm: bool = True
    """Renormalize the chosen top-k softmax weights to sum to one (``norm_topk_prob``)."""
    aux_loss_coef: float = 0.0
    """Coefficient of the switch-style auxiliary loss (see moe.py's note); 0 disables it."""
    dense_layers: tuple[int, ...] = ()
    """Layers with a dense SwiGLU instead of MoE (``mlp_only_layers``, and the layers ``decoder_sparse_step``
    skips)."""
    dense_ffn_hidden: int = 0
    """Hidden size of the dense layers' SwiGLU (``intermediate_size``); required when ``dense_layers`` is set."""

    # Fixed by the architecture; read by MoEFeedForward (class constants, not fields).
    score_func: ClassVar[str] = "softmax"
    route_scale: ClassVar[float] = 1.0
    num_expert_groups: ClassVar[int] = 1
    top_k_groups: ClassVar[int] = 1
    shared_expert_hidden: ClassVar[int] = 0
    shared_expert_gate: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _require_positive(self, ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim"))
        _require_positive(self, ("max_seq_len", "norm_eps", "rope_theta", "init_std"))
        _require_positive(self, ("num_experts", "top_k", "moe_hidden"))
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"Qwen3MoEConfig.n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads}) for "
                "grouped-query attention"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"Qwen3MoEConfig.head_dim ({self.head_dim}) must be even for RoPE")
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = YarnScaling(**self.rope_scaling)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, YarnScaling):
            raise ValueError(
                f"Qwen3MoEConfig.rope_scaling must be None, a YarnScaling or a dict of its fields, "
                f"got {self.rope_scaling!r}"
            )
        if self.top_k > self.num_experts:
            raise ValueError(f"Qwen3MoEConfig.top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if self.aux_loss_coef < 0:
            raise ValueError(f"Qwen3MoEConfig.aux_loss_coef must be >= 0, got {self.aux_loss_coef}")
        self.dense_layers = tuple(sorted(set(self.dense_layers)))
        bad = [i for i in self.dense_layers if not 0 <= i < self.n_layers]
        if bad:
            raise ValueError(f"Qwen3MoEConfig.dense_layers {bad} are not layers of a {self.n_layers}-layer model")
        if self.dense_layers and not self.dense_ffn_hidden > 0:
            raise ValueError(
                f"Qwen3MoEConfig.dense_ffn_hidden must be > 0 when dense_layers={self.dense_layers}, "
                f"got {self.dense_ffn_hidden}"
            )


QWEN3_MOE_CONFIGS: dict[str, Qwen3MoEConfig] = {
    # Unit tests and CPU recipe runs: head_dim (32) != dim // n_heads (16), as in the real models.
    "tiny": Qwen3MoEConfig(
        vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, num_experts=8, top_k=2,
        moe_hidden=32, max_seq_len=256,
    ),
    # Qwen/Qwen3-30B-A3B (30.5B total, 3.3B active). Meta device only (dry-run planning).
    "30b_a3b": Qwen3MoEConfig(
        vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, num_experts=128,
        top_k=8, moe_hidden=768, rope_theta=1000000.0, max_seq_len=40960,
    ),
    # Qwen/Qwen3-235B-A22B (235B total, 22B active). Meta device only (dry-run planning).
    "235b_a22b": Qwen3MoEConfig(
        vocab_size=151936, dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128, num_experts=128,
        top_k=8, moe_hidden=1536, rope_theta=1000000.0, max_seq_len=40960,
    ),
}


def qwen3_moe_config(name: str) -> Qwen3MoEConfig:
    """A fresh copy of the preset ``name`` from :data:`QWEN3_MOE_CONFIGS`.

    Raises:
        ValueError: ``name`` is not a preset; the message lists the valid names.
    """
    return _lookup_preset("qwen3_moe", QWEN3_MOE_CONFIGS, name)


class Qwen3MoE(MoE):
    """Qwen3-MoE decoder: ``forward(tokens_BT) -> logits_BTV``.

    An :class:`~lightning_vescale.models.moe.MoE` (same submodules, balancing, expert parallelism) whose
    attention has width ``config.head_dim`` per head and q/k norms.
    """

    config: Qwen3MoEConfig  # type: ignore[assignment]

    def __init__(self, config: Qwen3MoEConfig) -> None:
        super().__init__(config)  # type: ignore[arg-type]

    @staticmethod
    def _rotary_embedding(config: Qwen3MoEConfig) -> RotaryEmbedding:  # type: ignore[override]
        return rotary_embedding(config.head_dim, config.max_seq_len, config.rope_theta, config.rope_scaling)

    @staticmethod
    def _attention(config: Qwen3MoEConfig, out_init_std: float) -> nn.Module:  # type: ignore[override]
        return Attention(
            dim=config.dim,
            n_heads=config.n_heads,
            n_kv_heads=config.n_kv_heads,
            head_dim=config.head_dim,
            qk_norm=True,
            norm_eps=config.norm_eps,
            init_std=config.init_std,
            out_init_std=out_init_std,
        )

"""Llama 3 in plain PyTorch (the torchtitan / nanoGPT manner).

The model is architecture only: no process groups, no sharding, no device choices. Parallelism is
applied from outside (``fully_shard`` shards each :class:`TransformerBlock` in ``model.layers`` as a
group; expert parallelism lives in ``lightning_vescale.parallel``).

Shape suffixes (as in torchtitan's ``x_TD``)::

    B batch          T sequence        D model dim        V vocabulary
    H query heads    G key/value heads K head dim         F feed-forward hidden

[Note: weights and Hugging Face names]
Every weight maps one-to-one, with no permutation, to the Hugging Face ``LlamaForCausalLM`` weight of
the same role (``lightning_vescale.models.hf`` does the renaming):

=================================  ==========================================
ours                               Hugging Face
=================================  ==========================================
``tok_embeddings.weight``          ``model.embed_tokens.weight``
``layers.{i}.attention.wq/wk/wv``  ``model.layers.{i}.self_attn.q/k/v_proj``
``layers.{i}.attention.wo``        ``model.layers.{i}.self_attn.o_proj``
``layers.{i}.feed_forward.w1``     ``model.layers.{i}.mlp.gate_proj``
``layers.{i}.feed_forward.w3``     ``model.layers.{i}.mlp.up_proj``
``layers.{i}.feed_forward.w2``     ``model.layers.{i}.mlp.down_proj``
``layers.{i}.attention_norm``      ``model.layers.{i}.input_layernorm``
``layers.{i}.ffn_norm``            ``model.layers.{i}.post_attention_layernorm``
``norm.weight``                    ``model.norm.weight``
``output.weight``                  ``lm_head.weight``
=================================  ==========================================

This works because RoPE here uses Hugging Face's *rotate-half* convention: within a head, dimension
``i`` is rotated together with dimension ``i + K/2`` (see :func:`apply_rope`). Meta's original
checkpoints (``consolidated.*.pth``) rotate interleaved pairs ``(2i, 2i+1)`` as complex numbers; their
``wq``/``wk`` rows must be permuted per head, ``w.view(H, K//2, 2, D).transpose(1, 2).reshape(H*K, D)``
(row ``2i + c`` of a head moves to ``c*K/2 + i``), as transformers' ``convert_llama_weights_to_hf.py``
does, before loading here.

[Note: initialization and the meta device]
A model built under ``torch.device("meta")`` has no storage. After ``model.to_empty(device=...)``,
``model.init_weights()`` fills every parameter and buffer. ``init_weights`` is exactly "call
``reset_parameters()`` on every module in ``model.modules()`` order", and each module's
``reset_parameters()`` touches only its own direct parameters and buffers, so an engine that
materializes the model module by module in that order draws the same random numbers and produces the
same values as ``init_weights()`` under the same seed. Linear and embedding weights are drawn from
N(0, ``init_std``); projections that write into the residual stream (``wo``, ``w2``) use the depth
scaled ``init_std / sqrt(2 * (layer_id + 1))`` as torchtitan does; the untied output head uses
N(0, ``dim ** -0.5``); norms are ones; biases are zeros; RoPE tables are recomputed.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LLAMA_CONFIGS",
    "Attention",
    "Embedding",
    "FeedForward",
    "Linear",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "RopeScaling",
    "RotaryEmbedding",
    "TiedOutput",
    "TransformerBlock",
    "apply_rope",
    "ffn_hidden_size",
    "llama_config",
    "num_params",
    "reset_parameters_in_module_order",
    "rope_inv_freq",
]


# ----------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------


@dataclass
class RopeScaling:
    """Llama-3.1 RoPE frequency scaling (Hugging Face ``rope_type="llama3"``).

    Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` are kept, longer
    than ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, and the band
    in between is interpolated smoothly.
    """

    factor: float = 8.0
    """Divisor of the low frequencies (``8`` for Llama 3.1, ``32`` for Llama 3.2)."""
    low_freq_factor: float = 1.0
    """Sets the low-frequency wavelength bound ``original_max_position_embeddings / low_freq_factor``."""
    high_freq_factor: float = 4.0
    """Sets the high-frequency wavelength bound ``original_max_position_embeddings / high_freq_factor``."""
    original_max_position_embeddings: int = 8192
    """Context length the model was pretrained with before scaling."""

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ValueError(f"rope_scaling.factor must be >= 1, got {self.factor}")
        if not self.low_freq_factor > 0:
            raise ValueError(f"rope_scaling.low_freq_factor must be > 0, got {self.low_freq_factor}")
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must be greater than "
                f"rope_scaling.low_freq_factor ({self.low_freq_factor})"
            )
        if not self.original_max_position_embeddings > 0:
            raise ValueError(
                "rope_scaling.original_max_position_embeddings must be > 0, got "
                f"{self.original_max_position_embeddings}"
            )


def ffn_hidden_size(dim: int, multiple_of: int, ffn_dim_multiplier: float) -> int:
    """SwiGLU hidden size as Meta computes it: ``2/3 * 4 * dim``, times the multiplier, rounded up.

    Llama-3-8B: ``ffn_hidden_size(4096, 1024, 1.3) == 14336``.
    """
    hidden = int(2 * (4 * dim) / 3)
    hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _require_positive(config: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        if not value > 0:
            raise ValueError(f"{type(config).__name__}.{name} must be > 0, got {value!r}")


def _validate_attention_fields(config: Any) -> None:
    """Checks shared by :class:`LlamaConfig` and ``MoEConfig`` (embedding, attention, RoPE, norm)."""
    _require_positive(config, ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "max_seq_len"))
    _require_positive(config, ("norm_eps", "rope_theta", "init_std"))
    name = type(config).__name__
    if config.dim % config.n_heads != 0:
        raise ValueError(f"{name}.dim ({config.dim}) must be divisible by n_heads ({config.n_heads})")
    if config.n_heads % config.n_kv_heads != 0:
        raise ValueError(
            f"{name}.n_kv_heads ({config.n_kv_heads}) must divide n_heads ({config.n_heads}) for "
            "grouped-query attention"
        )
    if (config.dim // config.n_heads) % 2 != 0:
        raise ValueError(
            f"{name}: head dim dim // n_heads = {config.dim // config.n_heads} must be even for RoPE; "
            "change dim or n_heads"
        )
    if isinstance(config.rope_scaling, dict):
        config.rope_scaling = RopeScaling(**config.rope_scaling)
    if config.rope_scaling is not None and not isinstance(config.rope_scaling, RopeScaling):
        raise ValueError(
            f"{name}.rope_scaling must be None, a RopeScaling or a dict of its fields, "
            f"got {config.rope_scaling!r}"
        )


@dataclass
class LlamaConfig:
    """Shapes and hyper-parameters of a Llama 3 model. Validated on construction."""

    vocab_size: int = 256
    """Number of token ids."""
    dim: int = 64
    """Model (residual stream) width ``D``."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads ``H``; the head dim is ``dim // n_heads``."""
    n_kv_heads: int = 2
    """Key/value heads ``G`` (grouped-query attention); must divide ``n_heads``."""
    ffn_hidden: Optional[int] = None
    """SwiGLU hidden size ``F``. ``None``: computed from ``multiple_of`` and ``ffn_dim_multiplier``."""
    multiple_of: int = 256
    """Round the computed ``ffn_hidden`` up to a multiple of this (Meta's ``multiple_of``)."""
    ffn_dim_multiplier: float = 1.0
    """Scale of the computed ``ffn_hidden`` (Meta's ``ffn_dim_multiplier``; 1.3 for Llama-3-8B/70B)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 500000.0
    """RoPE base."""
    rope_scaling: Optional[RopeScaling] = None
    """Llama-3.1 frequency scaling, or ``None`` for plain RoPE. A dict of its fields is accepted."""
    max_seq_len: int = 128
    """Longest sequence the RoPE tables cover."""
    tie_embeddings: bool = False
    """Use ``tok_embeddings.weight`` as the output head's weight."""
    qkv_bias: bool = False
    """Add biases to the q/k/v projections (Qwen-style attention; Llama has none)."""
    init_std: float = 0.02
    """Standard deviation of the initial linear and embedding weights."""

    def __post_init__(self) -> None:
        _require_positive(self, ("multiple_of", "ffn_dim_multiplier"))
        _validate_attention_fields(self)
        if self.ffn_hidden is None:
            self.ffn_hidden = ffn_hidden_size(self.dim, self.multiple_of, self.ffn_dim_multiplier)
        _require_positive(self, ("ffn_hidden",))

    @property
    def head_dim(self) -> int:
        """Per-head width ``K = dim // n_heads``."""
        return self.dim // self.n_heads


LLAMA_CONFIGS: dict[str, LlamaConfig] = {
    # Unit tests: a few thousand parameters.
    "tiny": LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=128),
    # torchtitan's debugmodel scale: fast multi-process runs on CPU.
    "debug": LlamaConfig(
        vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, multiple_of=256, max_seq_len=512
    ),
    # ~50M parameters: a real training run on one GPU.
    "small": LlamaConfig(
        vocab_size=32000, dim=512, n_layers=12, n_heads=8, n_kv_heads=4, multiple_of=256, max_seq_len=2048,
        tie_embeddings=True,
    ),
    # Llama-3.2-1B.
    "1b": LlamaConfig(
        vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
        multiple_of=256, rope_theta=500000.0, max_seq_len=131072, tie_embeddings=True,
        rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
    ),
    # Llama-3-8B.
    "8b": LlamaConfig(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
        multiple_of=1024, rope_theta=500000.0, max_seq_len=8192,
    ),
    # Llama-3-70B.
    "70b": LlamaConfig(
        vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
        multiple_of=4096, rope_theta=500000.0, max_seq_len=8192,
    ),
}


def _lookup_preset(kind: str, presets: dict[str, Any], name: str) -> Any:
    if name not in presets:
        raise ValueError(f"unknown {kind} config {name!r}; valid names are: {', '.join(sorted(presets))}")
    return copy.deepcopy(presets[name])  # a fresh copy: callers may mutate it


def llama_config(name: str) -> LlamaConfig:
    """A fresh copy of the preset ``name`` from :data:`LLAMA_CONFIGS`.

    Raises:
        ValueError: ``name`` is not a preset; the message lists the valid names.
    """
    return _lookup_preset("llama", LLAMA_CONFIGS, name)


# ----------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------


class Linear(nn.Linear):
    """``nn.Linear`` (no bias by default) whose ``reset_parameters`` draws the weight from N(0, init_std).

    Args:
        init_std: standard deviation of the weight.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        init_std: float = 0.02,
    ) -> None:
        self.init_std = init_std  # set before nn.Linear.__init__, which calls reset_parameters()
        super().__init__(in_features, out_features, bias=bias)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose ``reset_parameters`` draws from N(0, init_std)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_std: float = 0.02) -> None:
        self.init_std = init_std
        super().__init__(num_embeddings, embedding_dim)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and cast back before the weight (as Hugging Face does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_fp32 = x_BTD.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x_BTD.dtype)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: Optional[RopeScaling] = None,
    *,
    device: Optional[torch.device | str] = None,
) -> torch.Tensor:
    """RoPE inverse frequencies ``theta ** (-2i / head_dim)``, i < head_dim/2, in fp32, shape ``[K/2]``.

    With ``scaling``, applies the Llama-3.1 rule (bitwise the same arithmetic as Hugging Face's
    ``_compute_llama3_parameters``).
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are divided by the factor; short ones are kept.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    # In between, interpolate smoothly between the two.
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Holds the RoPE cos/sin tables as non-persistent buffers ``[max_seq_len, K]``.

    The tables are derived data: they are not saved in checkpoints and are recomputed by
    :meth:`init_rope` (also :meth:`reset_parameters`), which is what makes a model built on the meta
    device usable after ``to_empty``.
    """

    cos_TK: torch.Tensor
    sin_TK: torch.Tensor

    def __init__(self, head_dim: int, max_seq_len: int, theta: float, scaling: Optional[RopeScaling]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("cos_TK", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin_TK", torch.empty(max_seq_len, head_dim), persistent=False)
        self.init_rope()

    @torch.no_grad()
    def init_rope(self) -> None:
        """(Re)compute the tables in fp32 on the buffers' device; they are cast to the buffers' dtype."""
        device = self.cos_TK.device
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, device=device)
        positions_T = torch.arange(self.max_seq_len, device=device, dtype=torch.int64).float()
        angles_TK = torch.outer(positions_T, inv_freq)
        # Rotate-half layout: dimension i pairs with i + K/2, both at frequency i.
        angles_TK = torch.cat([angles_TK, angles_TK], dim=-1)
        self.cos_TK.copy_(angles_TK.cos())
        self.sin_TK.copy_(angles_TK.sin())

    def reset_parameters(self) -> None:
        self.init_rope()

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        if seq_len > self.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_seq_len={self.max_seq_len}; "
                "raise max_seq_len in the model config"
            )
        return self.cos_TK[:seq_len], self.sin_TK[:seq_len]

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, theta={self.theta}"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BTHK: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor) -> torch.Tensor:
    """Rotate each pair ``(x[..., i], x[..., i + K/2])`` by the angle of position t at frequency i."""
    cos = cos_TK[None, :, None, :].to(x_BTHK.dtype)
    sin = sin_TK[None, :, None, :].to(x_BTHK.dtype)
    return x_BTHK * cos + _rotate_half(x_BTHK) * sin


def _repeat_kv(x_BTGK: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Query head h uses key/value head ``h // n_rep`` (torch.repeat_interleave on the head dim)."""
    if n_rep == 1:
        return x_BTGK
    B, T, G, K = x_BTGK.shape
    return x_BTGK[:, :, :, None, :].expand(B, T, G, n_rep, K).reshape(B, T, G * n_rep, K)


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE, through ``F.scaled_dot_product_attention``.

    Args:
        dim: model width ``D``.
        n_heads: query heads ``H``.
        n_kv_heads: key/value heads ``G`` (``H % G == 0``); each is shared by ``H // G`` query heads.
        qkv_bias: biases on the q/k/v projections.
        init_std: std of ``wq``, ``wk``, ``wv``.
        out_init_std: std of ``wo`` (which writes into the residual stream).
        head_dim: per-head width ``K``; default ``dim // n_heads`` (Qwen3 sets it independently of ``dim``).
        qk_norm: RMS-normalize each query and key head over ``K`` before RoPE (Qwen3's ``q_norm`` /
            ``k_norm``, weights of shape ``[K]`` shared by all heads).
        norm_eps: epsilon of the q/k norms.
    """

    def __init__(
        self,
        *,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        qkv_bias: bool = False,
        init_std: float = 0.02,
        out_init_std: float = 0.02,
        head_dim: Optional[int] = None,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = dim // n_heads if head_dim is None else head_dim
        self.wq = Linear(dim, n_heads * self.head_dim, bias=qkv_bias, init_std=init_std)
        self.wk = Linear(dim, n_kv_heads * self.head_dim, bias=qkv_bias, init_std=init_std)
        self.wv = Linear(dim, n_kv_heads * self.head_dim, bias=qkv_bias, init_std=init_std)
        self.wo = Linear(n_heads * self.head_dim, dim, init_std=out_init_std)
        self.q_norm: Optional[RMSNorm] = RMSNorm(self.head_dim, norm_eps) if qk_norm else None
        self.k_norm: Optional[RMSNorm] = RMSNorm(self.head_dim, norm_eps) if qk_norm else None

    def forward(self, x_BTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        # -1, not n_heads: under tensor parallelism each rank's projections hold only its heads.
        q_BTHK = self.wq(x_BTD).view(B, T, -1, self.head_dim)
        k_BTGK = self.wk(x_BTD).view(B, T, -1, self.head_dim)
        v_BTGK = self.wv(x_BTD).view(B, T, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q_BTHK, k_BTGK = self.q_norm(q_BTHK), self.k_norm(k_BTGK)
        q_BTHK = apply_rope(q_BTHK, cos_TK, sin_TK)
        k_BTGK = apply_rope(k_BTGK, cos_TK, sin_TK)
        n_rep = self.n_heads // self.n_kv_heads
        k_BTHK = _repeat_kv(k_BTGK, n_rep)
        v_BTHK = _repeat_kv(v_BTGK, n_rep)
        out_BHTK = F.scaled_dot_product_attention(
            q_BTHK.transpose(1, 2), k_BTHK.transpose(1, 2), v_BTHK.transpose(1, 2), is_causal=True
        )
        out_BTD = out_BHTK.transpose(1, 2).reshape(B, T, -1)
        return self.wo(out_BTD)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden: int, *, init_std: float = 0.02, out_init_std: float = 0.02) -> None:
        super().__init__()
        self.w1 = Linear(dim, hidden, init_std=init_std)
        self.w2 = Linear(hidden, dim, init_std=out_init_std)
        self.w3 = Linear(dim, hidden, init_std=init_std)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_BTD)) * self.w3(x_BTD))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(norm(x)); out = h + feed_forward(norm(h))``.

    The feed-forward module is passed in, so dense (:class:`FeedForward`) and MoE blocks share this.
    """

    def __init__(self, attention: nn.Module, feed_forward: nn.Module, *, dim: int, norm_eps: float) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(dim, norm_eps)
        self.feed_forward = feed_forward

    def forward(self, x_BTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor) -> torch.Tensor:
        h_BTD = x_BTD + self.attention(self.attention_norm(x_BTD), cos_TK, sin_TK)
        return h_BTD + self.feed_forward(self.ffn_norm(h_BTD))


def residual_init_std(init_std: float, layer_id: int) -> float:
    """torchtitan's depth-scaled std for projections into the residual stream of layer ``layer_id``."""
    return init_std / math.sqrt(2 * (layer_id + 1))


def reset_parameters_in_module_order(model: nn.Module) -> None:
    """Call ``reset_parameters()`` on every module of ``model`` that has one, in ``modules()`` order.

    This is the whole of ``init_weights``; an engine that materializes a meta model module by module
    in the same order gets the same values.
    """
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if reset is not None and module is not model:
            reset()


def num_params(model: nn.Module) -> int:
    """Number of parameter elements (a tied weight counts once); works on the meta device."""
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------


class Llama(nn.Module):
    """Llama 3 decoder: ``forward(tokens_BT) -> logits_BTV``.

    Submodules: ``tok_embeddings``, ``rope`` (tables only), ``layers`` (an ``nn.ModuleList`` of
    :class:`TransformerBlock`; the sharding engine treats each as a group), ``norm`` and ``output``
    (a :class:`Linear`, or with ``config.tie_embeddings`` a :class:`TiedOutput` whose ``weight`` *is*
    ``tok_embeddings.weight``).

    Build large models on the meta device and materialize them with ``to_empty`` + :meth:`init_weights`
    (see the note at the top of this file).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        assert config.ffn_hidden is not None  # set by LlamaConfig.__post_init__
        self.config = config
        self.tok_embeddings = Embedding(config.vocab_size, config.dim, init_std=config.init_std)
        self.rope = RotaryEmbedding(config.head_dim, config.max_seq_len, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(
            TransformerBlock(
                Attention(
                    dim=config.dim,
                    n_heads=config.n_heads,
                    n_kv_heads=config.n_kv_heads,
                    qkv_bias=config.qkv_bias,
                    init_std=config.init_std,
                    out_init_std=residual_init_std(config.init_std, layer_id),
                ),
                FeedForward(
                    config.dim,
                    config.ffn_hidden,
                    init_std=config.init_std,
                    out_init_std=residual_init_std(config.init_std, layer_id),
                ),
                dim=config.dim,
                norm_eps=config.norm_eps,
            )
            for layer_id in range(config.n_layers)
        )
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = _output_head(config.dim, config.vocab_size, self.tok_embeddings, config.tie_embeddings)

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        cos_TK, sin_TK = self.rope(tokens_BT.shape[1])
        h_BTD = self.tok_embeddings(tokens_BT)
        for layer in self.layers:
            h_BTD = layer(h_BTD, cos_TK, sin_TK)
        return self.output(self.norm(h_BTD))

    def init_weights(self) -> None:
        """(Re)initialize every parameter and buffer; see the note at the top of this file."""
        reset_parameters_in_module_order(self)

    def init_buffers(self) -> None:
        """Recompute the non-persistent buffers only (after ``to_empty``, before loading a checkpoint)."""
        self.rope.init_rope()


class TiedOutput(nn.Module):
    """Output head that multiplies by the token embedding's weight: ``logits = x @ tok_embeddings.weight.T``.

    The weight is registered only in the embedding (this module has no parameters), so it has a single
    owner through ``to_empty``, module-by-module materialization, sharding and ``state_dict`` (which
    has no ``output.weight``); ``self.weight`` always returns the embedding's current weight.
    """

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self._embedding = (embedding,)  # a tuple, so it is not registered as a submodule

    @property
    def weight(self) -> torch.Tensor:
        return self._embedding[0].weight

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return F.linear(x_BTD, self.weight)


def _output_head(dim: int, vocab_size: int, tok_embeddings: Embedding, tie: bool) -> nn.Module:
    if tie:
        return TiedOutput(tok_embeddings)
    return Linear(dim, vocab_size, init_std=dim**-0.5)

"""YaRN RoPE scaling (arXiv 2309.00071), as DeepSeek-V3 and long-context Qwen3 checkpoints use it.

The arithmetic follows transformers' ``_compute_yarn_parameters`` step for step, so the tables equal
Hugging Face's bitwise: frequencies whose wavelength fits many times in the pretraining context are kept
(extrapolated), those that do not are divided by ``factor`` (interpolated), with a linear ramp in between
over the dimensions ``[low, high]`` found from ``beta_fast`` / ``beta_slow`` rotations. The cos/sin tables
are multiplied by an attention factor (``0.1 * ln(factor) + 1`` unless ``mscale`` says otherwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from lightning_vescale.models.llama import RotaryEmbedding

__all__ = ["YarnRotaryEmbedding", "YarnScaling", "rotary_embedding", "yarn_inv_freq", "yarn_mscale"]


@dataclass
class YarnScaling:
    """YaRN parameters (Hugging Face ``rope_type="yarn"``; same names as in ``config.json``)."""

    factor: float = 4.0
    """Context extension factor (DeepSeek-V3: 40)."""
    original_max_position_embeddings: int = 4096
    """Context length the model was pretrained with before scaling."""
    beta_fast: float = 32.0
    """Dimensions that rotate more than this many times over the original context are kept (extrapolated)."""
    beta_slow: float = 1.0
    """Dimensions that rotate fewer than this many times are divided by ``factor`` (interpolated)."""
    mscale: Optional[float] = None
    """With ``mscale_all_dim``: the attention factor is ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``."""
    mscale_all_dim: Optional[float] = None
    """DeepSeek: also scales the softmax by ``mscale(factor, mscale_all_dim) ** 2`` (see :func:`yarn_mscale`)."""
    attention_factor: Optional[float] = None
    """Explicit factor of the cos/sin tables; ``None``: derived from ``factor`` and ``mscale``."""
    truncate: bool = True
    """Round the ramp's ends to whole dimensions."""

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ValueError(f"rope_scaling.factor must be >= 1 for YaRN, got {self.factor}")
        if not self.original_max_position_embeddings > 0:
            raise ValueError(
                "rope_scaling.original_max_position_embeddings must be > 0, got "
                f"{self.original_max_position_embeddings}"
            )
        if not self.beta_fast > 0 or not self.beta_slow > 0:
            raise ValueError(
                f"rope_scaling.beta_fast and beta_slow must be > 0, got {self.beta_fast}, {self.beta_slow}"
            )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(
    head_dim: int, theta: float, scaling: YarnScaling, *, device: Optional[torch.device | str] = None
) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies ``[head_dim / 2]`` (fp32) and the attention factor of the cos/sin tables."""
    s = scaling
    if s.attention_factor is not None:
        attention_factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention_factor = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(s.factor)

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength fits num_rotations times into the original context.
        return head_dim * math.log(s.original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp

    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (s.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = inv_freq_interpolation * (1 - extrapolation_weight) + inv_freq_extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


class YarnRotaryEmbedding(RotaryEmbedding):
    """:class:`~lightning_vescale.models.llama.RotaryEmbedding` with YaRN frequencies and scaled tables."""

    scaling: YarnScaling  # type: ignore[assignment]  # the base class stores the scaling it is given, YaRN's here

    @torch.no_grad()
    def init_rope(self) -> None:
        device = self.cos_TK.device
        inv_freq, attention_factor = yarn_inv_freq(self.head_dim, self.theta, self.scaling, device=device)
        positions_T = torch.arange(self.max_seq_len, device=device, dtype=torch.int64).float()
        angles_TK = torch.outer(positions_T, inv_freq)
        angles_TK = torch.cat([angles_TK, angles_TK], dim=-1)  # rotate-half layout, as in llama.py
        self.cos_TK.copy_(angles_TK.cos() * attention_factor)
        self.sin_TK.copy_(angles_TK.sin() * attention_factor)


def rotary_embedding(
    head_dim: int, max_seq_len: int, theta: float, scaling: Optional[YarnScaling]
) -> Union[RotaryEmbedding, YarnRotaryEmbedding]:
    """Plain RoPE tables, or YaRN-scaled ones when ``scaling`` is given."""
    if scaling is None:
        return RotaryEmbedding(head_dim, max_seq_len, theta, None)
    return YarnRotaryEmbedding(head_dim, max_seq_len, theta, scaling)  # type: ignore[arg-type]

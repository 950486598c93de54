"""A small vision-language model: a ViT-style encoder over image patches, a projector, a Llama decoder.

Plain PyTorch, no parallelism: ``VLM.forward(images, tokens) = decoder(projector(encoder(images)), tokens)``.
The three top-level sub-modules are what an MPMD plan places on groups of ranks (``configs/experiment/
vlm_mpmd.yaml``: the encoder and projector on one rank, the decoder sharded over the others).

Shapes: ``B`` batch, ``C`` image channels, ``S`` image side, ``P`` patches, ``E`` encoder width, ``D`` decoder
width, ``T`` text positions, ``V`` vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from lightning_vescale.models.llama import Attention as LlamaAttention
from lightning_vescale.models.llama import (
    Embedding,
    FeedForward,
    LlamaConfig,
    RMSNorm,
    RotaryEmbedding,
)
from lightning_vescale.models.llama import TransformerBlock as LlamaBlock

__all__ = ["VLM", "Projector", "VLMConfig", "VLMDecoder", "VisionEncoder", "synthetic_vlm_batch", "vlm_config"]


@dataclass
class VLMConfig:
    """Shapes of a :class:`VLM`."""

    image_size: int = 16
    """Side ``S`` of the square input images."""
    patch_size: int = 4
    """Side of a square patch; ``(S / patch_size)**2`` patches per image."""
    channels: int = 3
    """Image channels ``C``."""
    encoder_dim: int = 32
    """Encoder width ``E``."""
    encoder_layers: int = 2
    """Encoder blocks."""
    encoder_heads: int = 4
    """Encoder attention heads."""
    decoder: LlamaConfig = field(default_factory=lambda: LlamaConfig(
        vocab_size=64, dim=48, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=96, max_seq_len=64))
    """The Llama decoder (its ``max_seq_len`` must cover patches + text)."""

    def __post_init__(self) -> None:
        if isinstance(self.decoder, dict):
            self.decoder = LlamaConfig(**self.decoder)
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} must be a multiple of patch_size={self.patch_size}")
        if self.encoder_dim % self.encoder_heads:
            raise ValueError(f"encoder_dim={self.encoder_dim} must be divisible by encoder_heads={self.encoder_heads}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


VLM_CONFIGS = {
    "tiny": VLMConfig(),
    # The recipe's model: a decoder much larger than the encoder (the case MPMD is for).
    "small": VLMConfig(image_size=32, patch_size=8, encoder_dim=64, encoder_layers=2, encoder_heads=4,
                       decoder=LlamaConfig(vocab_size=256, dim=128, n_layers=6, n_heads=8, n_kv_heads=4,
                                           ffn_hidden=384, max_seq_len=128)),
}


def vlm_config(name: str) -> VLMConfig:
    """A preset: ``tiny`` (tests) or ``small`` (the recipe)."""
    if name not in VLM_CONFIGS:
        raise ValueError(f"unknown VLM config {name!r}; valid names are: {', '.join(sorted(VLM_CONFIGS))}")
    import copy

    return copy.deepcopy(VLM_CONFIGS[name])


class EncoderBlock(nn.Module):
    """Pre-norm ViT block: bidirectional self-attention and a GELU MLP."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x_BPE: torch.Tensor) -> torch.Tensor:
        B, P, E = x_BPE.shape
        q, k, v = self.qkv(self.norm1(x_BPE)).view(B, P, 3, self.n_heads, E // self.n_heads).unbind(2)
        attn_BHPK = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x_BPE = x_BPE + self.proj(attn_BHPK.transpose(1, 2).reshape(B, P, E))
        return x_BPE + self.fc2(F.gelu(self.fc1(self.norm2(x_BPE))))


class VisionEncoder(nn.Module):
    """Images -> patch features: a linear patch embedding, learned positions, ViT blocks, a final norm."""

    def __init__(self, config: VLMConfig) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.patch_embed = nn.Linear(config.channels * config.patch_size**2, config.encoder_dim)
        self.pos_embed = nn.Parameter(torch.randn(config.num_patches, config.encoder_dim) * 0.02)
        self.blocks = nn.ModuleList(EncoderBlock(config.encoder_dim, config.encoder_heads)
                                    for _ in range(config.encoder_layers))
        self.norm = nn.LayerNorm(config.encoder_dim)

    def forward(self, images_BCSS: torch.Tensor) -> torch.Tensor:
        p = self.patch_size
        patches_BPX = F.unfold(images_BCSS, kernel_size=p, stride=p).transpose(1, 2)  # (B, P, C*p*p)
        x_BPE = self.patch_embed(patches_BPX) + self.pos_embed
        for block in self.blocks:
            x_BPE = block(x_BPE)
        return self.norm(x_BPE)


class Projector(nn.Module):
    """Encoder features -> decoder embeddings (two linear layers with a GELU, as LLaVA's)."""

    def __init__(self, encoder_dim: int, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(encoder_dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, features_BPE: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(features_BPE)))


class VLMDecoder(nn.Module):
    """A Llama decoder over ``[image embeddings; text embeddings]``; logits of the text positions only."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        assert config.ffn_hidden is not None  # set by LlamaConfig.__post_init__
        self.tok_embeddings = Embedding(config.vocab_size, config.dim, init_std=config.init_std)
        self.rope = RotaryEmbedding(config.head_dim, config.max_seq_len, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(
            LlamaBlock(LlamaAttention(dim=config.dim, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads,
                                      init_std=config.init_std, out_init_std=config.init_std / math.sqrt(2 * (i + 1))),
                       FeedForward(config.dim, config.ffn_hidden, init_std=config.init_std),
                       dim=config.dim, norm_eps=config.norm_eps)
            for i in range(config.n_layers)
        )
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, image_BPD: torch.Tensor, tokens_BT: torch.Tensor) -> torch.Tensor:
        P = image_BPD.shape[1]
        h_BLD = torch.cat([image_BPD, self.tok_embeddings(tokens_BT)], dim=1)
        cos, sin = self.rope(h_BLD.shape[1])
        for layer in self.layers:
            h_BLD = layer(h_BLD, cos, sin)
        return self.output(self.norm(h_BLD[:, P:]))


class VLM(nn.Module):
    """``forward(images_BCSS, tokens_BT) -> logits_BTV``: encoder, projector, decoder (top-level sub-modules)."""

    def __init__(self, config: VLMConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = VisionEncoder(config)
        self.projector = Projector(config.encoder_dim, config.decoder.dim)
        self.decoder = VLMDecoder(config.decoder)

    def forward(self, images_BCSS: torch.Tensor, tokens_BT: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.projector(self.encoder(images_BCSS)), tokens_BT)


def synthetic_vlm_batch(config: VLMConfig, batch_size: int, seq_len: int, step: int, *, num_classes: int = 8,
                        seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A deterministic batch ``(images, tokens_in, tokens_out)`` for ``step``: each image shows one of
    ``num_classes`` fixed patterns plus noise, and its caption is a token sequence determined by the class, so the
    decoder can only predict the caption by looking at the image. Same arguments, same batch, on any rank."""
    V = config.decoder.vocab_size
    patterns = torch.randn(num_classes, config.channels, config.image_size, config.image_size,
                           generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
    classes = torch.randint(0, num_classes, (batch_size,), generator=g)
    images = patterns[classes] + 0.3 * torch.randn(batch_size, config.channels, config.image_size,
                                                   config.image_size, generator=g)
    positions = torch.arange(seq_len + 1)
    tokens = (classes[:, None] * 7 + positions[None, :] * (classes[:, None] + 1)) % V
    return images, tokens[:, :-1], tokens[:, 1:]

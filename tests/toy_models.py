"""Tiny models for engine tests: an MLP and a transformer with a tied embedding and a frozen param."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class MLP(nn.Module):
    """Sizes chosen so nothing divides evenly by 2, 3 or 4 ranks."""

    def __init__(self, dim: int = 13, hidden: int = 37, num_blocks: int = 3, out: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(7, dim)
        self.blocks = nn.ModuleList(MLPBlock(dim, hidden) for _ in range(num_blocks))
        self.out = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        q, k, v = self.qkv(x_BTD).view(B, T, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLPBlock(dim, 3 * dim + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Tied input/output embedding, a frozen positional table, blocks as FSDP groups."""

    def __init__(self, vocab: int = 53, dim: int = 24, n_heads: int = 4, n_layers: int = 2, seq: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02, requires_grad=False)  # frozen
        self.layers = nn.ModuleList(Block(dim, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens_BT) + self.pos[: tokens_BT.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))

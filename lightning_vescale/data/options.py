"""The arguments of :class:`~lightning_vescale.data.TextDataModule`: their defaults and checks, without Lightning.

The data module and the recipes' ``data`` config both take them from here, so a recipe's config is checked (before
any process starts) by the data module's own rules, and checking it does not import Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_vescale.data.tokenizer import TOKENIZERS

__all__ = ["TEXT_DATA_DEFAULTS", "TextDataOptions"]


@dataclass(frozen=True)
class TextDataOptions:
    """:class:`~lightning_vescale.data.TextDataModule`'s arguments besides the corpus path, with their defaults."""

    tokenizer: str = "byte"
    """``"byte"`` (vocab 256) or ``"bpe"`` (trained on the corpus at start-up)."""
    bpe_vocab_size: int = 512
    """Upper bound of the BPE vocabulary (at least the 256 bytes; must fit the model's ``vocab_size``)."""
    seq_len: int = 128
    """Tokens per window (must fit the model's ``max_seq_len``)."""
    batch_size: int = 16
    """Windows per micro-batch per process."""
    val_fraction: float = 0.05
    """Tail of the corpus held out for validation, in (0, 1)."""
    stride: Optional[int] = None
    """Distance between training windows; ``None``: ``seq_len`` (no overlap)."""
    num_workers: int = 0
    """DataLoader worker processes."""
    seed: int = 0
    """Seed of the training sampler's shuffle."""

    def problem(self, *, prefix: str = "", null: str = "None") -> Optional[str]:
        """The first thing wrong with these options, or None; keys named as the caller's users write them (``prefix``
        ``"data."`` and ``null`` ``"null"`` in a recipe)."""
        o, p = self, prefix
        if o.tokenizer not in TOKENIZERS:
            return f"{p}tokenizer must be one of {', '.join(TOKENIZERS)}, got {o.tokenizer!r}"
        checks = [
            (o.bpe_vocab_size >= 256, f"{p}bpe_vocab_size must be >= 256 (the byte alphabet), got {o.bpe_vocab_size}"),
            (o.seq_len >= 1, f"{p}seq_len must be >= 1, got {o.seq_len}"),
            (o.batch_size >= 1, f"{p}batch_size must be >= 1, got {o.batch_size}"),
            (0.0 < o.val_fraction < 1.0, f"{p}val_fraction must be in (0, 1), got {o.val_fraction}"),
            (o.stride is None or o.stride >= 1, f"{p}stride must be >= 1 or {null}, got {o.stride}"),
            (o.num_workers >= 0, f"{p}num_workers must be >= 0, got {o.num_workers}"),
        ]
        return next((message for ok, message in checks if not ok), None)


TEXT_DATA_DEFAULTS = TextDataOptions()

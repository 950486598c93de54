"""The embedded default corpus, tokenizers and the LightningDataModule the recipes train on.

The corpus and tokenizers need only the standard library; :class:`TextDataModule` (and the window dataset it
uses) imports Lightning, so it is imported on first use: checking a recipe's config does not pay for Lightning.
"""

from typing import Any

from lightning_vescale.data.corpus import (
    EMBEDDED_CORPUS_PATH,
    check_windows_fit,
    generate_corpus,
    load_text,
)
from lightning_vescale.data.options import TEXT_DATA_DEFAULTS, TextDataOptions
from lightning_vescale.data.tokenizer import (
    TOKENIZERS,
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    build_tokenizer,
    train_bpe,
)

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "EMBEDDED_CORPUS_PATH",
    "TEXT_DATA_DEFAULTS",
    "TOKENIZERS",
    "TextDataModule",
    "TextDataOptions",
    "Tokenizer",
    "TokenWindows",
    "build_tokenizer",
    "check_windows_fit",
    "generate_corpus",
    "load_text",
    "split_tokens",
    "train_bpe",
]

_DATAMODULE_NAMES = ("TextDataModule", "TokenWindows", "split_tokens")


def __getattr__(name: str) -> Any:
    if name in _DATAMODULE_NAMES:
        from lightning_vescale.data import datamodule

        return getattr(datamodule, name)
    raise AttributeError(f"module 'lightning_vescale.data' has no attribute {name!r}")

"""The embedded default corpus, tokenizers and the LightningDataModule the recipes train on."""

from lightning_vescale.data.corpus import (
    EMBEDDED_CORPUS_PATH,
    generate_corpus,
    load_text,
)
from lightning_vescale.data.datamodule import TextDataModule, TokenWindows, split_tokens
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
    "TOKENIZERS",
    "TextDataModule",
    "Tokenizer",
    "TokenWindows",
    "build_tokenizer",
    "generate_corpus",
    "load_text",
    "split_tokens",
    "train_bpe",
]

"""Tokenizers for the recipes: byte-level (vocab 256) and a small byte-level BPE trained on the corpus.

Both map text to ids and back losslessly for any UTF-8 text: every BPE token is a sequence of bytes,
and the 256 single bytes are always in the vocabulary, so nothing is ever out of vocabulary.

[Note: deterministic BPE]
:func:`train_bpe` is the classic byte-pair-encoding loop (Sennrich et al.; GPT-2's byte-level form):
split the text into pre-tokens (a word with its leading space, a run of punctuation, or a run of
whitespace), count them, and repeatedly merge the most frequent adjacent pair of tokens into a new
token. Ties are broken by the smallest ``(left id, right id)``, so the same text and vocabulary size
give the same merges on every rank and every run, with no file to ship or download. On the embedded
corpus (a few hundred distinct words) training takes well under a second; it stops early, with a
smaller vocabulary, when no pair occurs twice.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from typing import Protocol, Sequence, runtime_checkable

__all__ = ["BPETokenizer", "ByteTokenizer", "Tokenizer", "build_tokenizer", "train_bpe", "TOKENIZERS"]

TOKENIZERS = ("byte", "bpe")
"""Names accepted by :func:`build_tokenizer` (and ``data.tokenizer``)."""

# A word with an optional leading space, a run of other non-space characters, or a run of whitespace.
_PRETOKEN = re.compile(r" ?[A-Za-z0-9]+| ?[^\sA-Za-z0-9]+|\s+")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data module needs from a tokenizer."""

    name: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocab 256; matches the Llama/MoE ``tiny`` presets)."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


class BPETokenizer:
    """Byte-level BPE from a list of merges ``(left id, right id)``; merge ``k`` creates id ``256 + k``."""

    name = "bpe"

    def __init__(self, merges: Sequence[tuple[int, int]]) -> None:
        self.merges = [tuple(m) for m in merges]
        self._rank = {pair: i for i, pair in enumerate(self.merges)}
        self._bytes: list[bytes] = [bytes([i]) for i in range(256)]
        for left, right in self.merges:
            self._bytes.append(self._bytes[left] + self._bytes[right])
        self.vocab_size = len(self._bytes)

    def _encode_pretoken(self, piece: bytes) -> tuple[int, ...]:
        ids = list(piece)
        while len(ids) > 1:
            # The earliest-learned merge present in the piece is applied first (everywhere it occurs).
            best = min(
                (self._rank.get((a, b), len(self._rank)), a, b) for a, b in zip(ids, ids[1:])
            )
            rank, a, b = best
            if rank == len(self._rank):
                break
            ids = _merge(ids, (a, b), 256 + rank)
        return tuple(ids)

    def encode(self, text: str) -> list[int]:
        cache: dict[str, tuple[int, ...]] = {}
        out: list[int] = []
        for piece in _PRETOKEN.findall(text):
            ids = cache.get(piece)
            if ids is None:
                ids = cache[piece] = self._encode_pretoken(piece.encode("utf-8"))
            out.extend(ids)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self._bytes[int(i)] for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for."""
        return self._bytes[token_id]

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"


def _merge(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    out: list[int] = []
    i = 0
    while i < len(ids):
        if i + 1 < len(ids) and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def train_bpe(text: str, vocab_size: int) -> BPETokenizer:
    """Learn ``vocab_size - 256`` merges on ``text`` (fewer if no pair occurs twice). Deterministic.

    Raises:
        ValueError: ``vocab_size`` < 256.
    """
    if vocab_size < 256:
        raise ValueError(f"BPE vocab_size must be >= 256 (the byte alphabet), got {vocab_size}")
    words: dict[tuple[int, ...], int] = Counter()
    for piece, count in Counter(_PRETOKEN.findall(text)).items():
        words[tuple(piece.encode("utf-8"))] += count
    word_list = [list(w) for w in words]
    freqs = list(words.values())
    merges: list[tuple[int, int]] = []
    for new_id in range(256, vocab_size):
        pairs: Counter = Counter()
        for ids, freq in zip(word_list, freqs):
            for pair in zip(ids, ids[1:]):
                pairs[pair] += freq
        if not pairs:
            break
        best_count = max(pairs.values())
        if best_count < 2:
            break
        best = min(pair for pair, count in pairs.items() if count == best_count)
        merges.append(best)
        word_list = [_merge(ids, best, new_id) if len(ids) > 1 else ids for ids in word_list]
    return BPETokenizer(merges)


@functools.lru_cache(maxsize=4)
def _cached_bpe(text: str, vocab_size: int) -> BPETokenizer:
    return train_bpe(text, vocab_size)


def build_tokenizer(name: str, text: str = "", *, vocab_size: int = 512) -> Tokenizer:
    """The tokenizer ``name``: ``"byte"``, or ``"bpe"`` trained on ``text`` with ``vocab_size`` (cached).

    Raises:
        ValueError: unknown ``name``; the message lists the valid ones.
    """
    if name == "byte":
        return ByteTokenizer()
    if name == "bpe":
        if not text:
            raise ValueError("the bpe tokenizer is trained on the corpus: pass its text")
        return _cached_bpe(text, vocab_size)
    raise ValueError(f"unknown tokenizer {name!r}; valid tokenizers are: {', '.join(TOKENIZERS)}")

"""The embedded corpus, the tokenizers and the next-token windows (lightning_vescale.data)."""

from __future__ import annotations

import pytest
import torch

from lightning_vescale.data import (
    EMBEDDED_CORPUS_PATH,
    BPETokenizer,
    ByteTokenizer,
    TextDataModule,
    TokenWindows,
    build_tokenizer,
    generate_corpus,
    load_text,
    split_tokens,
    train_bpe,
)

SAMPLE = "Tale 1. The Old Key\n\nOnce there was a miller named Anna. \"Where is my key?\" asked Anna.\n"
UNICODE = "naïve café, 東京, emoji 🎉 and\ttabs\r\n"


def test_embedded_corpus_is_the_generator_output():
    text = load_text()
    assert text == EMBEDDED_CORPUS_PATH.read_text(encoding="utf-8")
    assert 100_000 <= len(text.encode("utf-8")) <= 300_000
    # The shipped file is exactly what the fixed-seed generator writes: reproducible, nothing downloaded.
    assert text == generate_corpus()
    assert text.isascii() and text.startswith("Tale 1.")


def test_generator_is_deterministic_and_seeded():
    assert generate_corpus(seed=3, num_chars=5000) == generate_corpus(seed=3, num_chars=5000)
    assert generate_corpus(seed=3, num_chars=5000) != generate_corpus(seed=4, num_chars=5000)


@pytest.mark.parametrize("text", [SAMPLE, UNICODE, ""])
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert tok.vocab_size == 256 and all(0 <= i < 256 for i in ids)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_bpe_round_trip_and_compression():
    corpus = load_text()[:40_000]
    tok = train_bpe(corpus, vocab_size=400)
    assert isinstance(tok, BPETokenizer) and tok.vocab_size == 400
    for text in (SAMPLE, UNICODE, corpus[:3000]):
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    # Merges learned on English-like text shorten it well below one token per byte.
    assert len(tok.encode(corpus)) < 0.5 * len(corpus.encode("utf-8"))


def test_bpe_is_deterministic_and_cached():
    corpus = load_text()[:20_000]
    assert train_bpe(corpus, 300).merges == train_bpe(corpus, 300).merges
    assert build_tokenizer("bpe", corpus, vocab_size=300) is build_tokenizer("bpe", corpus, vocab_size=300)


def test_bpe_stops_when_no_pair_repeats():
    tok = train_bpe("ab ab", vocab_size=10_000)
    assert 256 < tok.vocab_size < 300
    assert tok.decode(tok.encode("ab ab abc")) == "ab ab abc"


def test_tokenizer_errors_name_the_value():
    with pytest.raises(ValueError, match=r"unknown tokenizer 'wordpiece'.*byte, bpe"):
        build_tokenizer("wordpiece", SAMPLE)
    with pytest.raises(ValueError, match="vocab_size must be >= 256"):
        train_bpe(SAMPLE, vocab_size=100)


def test_windows_are_shifted_next_token_pairs():
    tokens = torch.arange(23)
    ds = TokenWindows(tokens, seq_len=5)
    assert len(ds) == 4  # starts 0, 5, 10, 15 (each needs 6 tokens)
    x, y = ds[1]
    assert x.tolist() == [5, 6, 7, 8, 9] and y.tolist() == [6, 7, 8, 9, 10]
    x, y = ds[3]
    assert y[-1].item() == 20
    with pytest.raises(IndexError):
        ds[4]
    overlapping = TokenWindows(tokens, seq_len=5, stride=2)
    assert len(overlapping) == 9 and overlapping[8][1][-1].item() == 21
    with pytest.raises(ValueError, match="do not fill one window of seq_len=30"):
        TokenWindows(tokens, seq_len=30)


def test_split_is_a_contiguous_tail():
    tokens = torch.arange(100)
    train, val = split_tokens(tokens, 0.1)
    assert train.tolist() == list(range(90)) and val.tolist() == list(range(90, 100))
    with pytest.raises(ValueError, match="val_fraction must be in"):
        split_tokens(tokens, 1.5)


def test_datamodule_on_the_embedded_corpus():
    dm = TextDataModule(seq_len=64, batch_size=4, val_fraction=0.05)
    dm.setup("fit")
    assert dm.tokenizer.vocab_size == 256
    n = len(load_text().encode("utf-8"))
    n_val = round(n * 0.05)
    assert len(dm.train_set) == (n - n_val - 65) // 64 + 1
    assert len(dm.val_set) == (n_val - 65) // 64 + 1
    # The splits do not overlap: the last training target comes before the first validation input.
    assert dm.train_set.tokens_N.numel() + dm.val_set.tokens_N.numel() == n
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 64) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    xv, _ = next(iter(dm.val_dataloader()))
    assert torch.equal(xv[0], dm.val_set.tokens_N[:64])


def test_datamodule_on_a_user_file_with_bpe(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(generate_corpus(seed=1, num_chars=30_000), encoding="utf-8")
    dm = TextDataModule(path, tokenizer="bpe", bpe_vocab_size=320, seq_len=32, batch_size=2, val_fraction=0.1)
    dm.setup("fit")
    assert dm.tokenizer.name == "bpe" and dm.tokenizer.vocab_size <= 320
    x, _ = next(iter(dm.train_dataloader()))
    assert int(x.max()) < dm.tokenizer.vocab_size


def test_missing_path_fails_at_construction_naming_it(tmp_path):
    missing = tmp_path / "nope" / "corpus.txt"
    with pytest.raises(FileNotFoundError, match=r"data.path '.*nope/corpus.txt' does not exist"):
        TextDataModule(missing)
    with pytest.raises(FileNotFoundError, match="is a directory, not a regular text file"):
        TextDataModule(tmp_path)


def test_a_device_or_pipe_as_data_path_is_named_for_what_it_is(tmp_path):
    import os

    with pytest.raises(FileNotFoundError, match=r"data.path '/dev/null' is a character device, not a regular text file"):
        TextDataModule("/dev/null")
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(FileNotFoundError, match=r"pipe' is a named pipe, not a regular text file"):
        TextDataModule(tmp_path / "pipe")


def test_too_short_validation_split_names_the_sizes(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("x" * 1000, encoding="utf-8")
    dm = TextDataModule(path, seq_len=128, val_fraction=0.05)
    with pytest.raises(ValueError, match=r"validation split of '.*short.txt' \(data.val_fraction=0.05: 50 of 1000 "
                                         r"tokens\) is shorter than one window of data.seq_len=128 .*"
                                         r"data.val_fraction=0.129 or more"):
        dm.setup("fit")
    path.write_text("x" * 200, encoding="utf-8")  # no fraction fits two windows: the advice is a longer text
    with pytest.raises(ValueError, match=r"has 200 tokens, fewer than the 258 .*use a longer text") as info:
        TextDataModule(path, seq_len=128, val_fraction=0.05).setup("fit")
    assert "val_fraction" not in str(info.value)

"""Fixed-length next-token windows over a text corpus, as a LightningDataModule.

Shape suffixes: ``T`` window length (``seq_len``), ``N`` tokens in the corpus.

The corpus (the embedded one, or ``path``) is tokenized once per process in :meth:`setup` into a
1-D token tensor ``tokens_N``. The last ``val_fraction`` of it is the validation split, so no window
of one split overlaps the other. A window is ``seq_len + 1`` consecutive tokens starting every
``stride`` tokens: ``input_T = w[:-1]``, ``target_T = w[1:]``. The training loader shuffles (Lightning
swaps in a ``DistributedSampler`` under a distributed strategy, so each rank sees its own windows);
the validation loader does not.

The training loader is torchdata's ``StatefulDataLoader``: Lightning saves its position in every checkpoint
and restores it on resume, so a run resumed mid-epoch continues with exactly the batches the uninterrupted
run would have drawn next (instead of restarting the epoch). Under a distributed strategy the module brings
its own ``StatefulDistributedSampler`` (the same permutation as Lightning's ``DistributedSampler`` with the same
seed): Lightning would otherwise wrap torchdata's sampler in a ``DistributedSamplerWrapper``, whose order
depends on the global RNG at the start of each epoch, which a resumed run restores to a later state.
One process uses the same sampler over one replica, so a position saved on any world size loads on any other
(:class:`ResumableDistributedSampler`): the resumed run skips the windows the saved run's ranks had drawn.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Optional, Union

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from lightning_vescale.data.corpus import check_windows_fit, load_text
from lightning_vescale.data.options import TEXT_DATA_DEFAULTS, TextDataOptions
from lightning_vescale.data.tokenizer import Tokenizer, build_tokenizer

__all__ = ["TextDataModule", "TokenWindows", "split_tokens"]

logger = logging.getLogger(__name__)

# torchdata calls a torch API that torch deprecated; nothing for a user to act on.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


class TokenWindows(Dataset):
    """Windows ``(input_T, target_T)`` of ``seq_len`` tokens and their next tokens, every ``stride`` tokens.

    Args:
        tokens_N: the token ids, 1-D.
        seq_len: window length ``T``.
        stride: distance between window starts; ``seq_len`` (the default) makes windows that do not
            overlap (each target token is predicted once per epoch).

    Raises:
        ValueError: the tokens do not fill one window (``seq_len + 1`` tokens), or a bad length.
    """

    def __init__(self, tokens_N: torch.Tensor, seq_len: int, stride: Optional[int] = None) -> None:
        stride = seq_len if stride is None else stride
        if tokens_N.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens_N.shape)}")
        if seq_len < 1 or stride < 1:
            raise ValueError(f"seq_len and stride must be >= 1, got seq_len={seq_len}, stride={stride}")
        if tokens_N.numel() < seq_len + 1:
            raise ValueError(
                f"{tokens_N.numel()} tokens do not fill one window of seq_len={seq_len} (+1 for the target); "
                "use a longer text or a shorter data.seq_len"
            )
        self.tokens_N = tokens_N
        self.seq_len = seq_len
        self.stride = stride
        self.num_windows = (tokens_N.numel() - seq_len - 1) // stride + 1

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_windows:
            raise IndexError(f"window {index} out of range [0, {self.num_windows})")
        start = index * self.stride
        window = self.tokens_N[start : start + self.seq_len + 1]
        return window[:-1], window[1:]


def split_tokens(tokens_N: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Split into (train, val): val is the last ``val_fraction`` of the tokens (contiguous, no overlap)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    num_val = max(1, int(round(tokens_N.numel() * val_fraction)))
    return tokens_N[:-num_val], tokens_N[-num_val:]


class ResumableDistributedSampler(StatefulDistributedSampler):
    """torchdata's ``StatefulDistributedSampler`` whose saved position also names its number of replicas, so it
    resumes on another world size: the permutation of an epoch is the same for every world size (it depends on
    the seed and the epoch only) and rank ``r`` of ``n`` takes its elements ``r, r + n, ...``; ``k`` drawn by each of
    ``n_saved`` ranks are the permutation's first ``k * n_saved``, which ``n`` ranks skip as ``k * n_saved / n``
    each (rounded down; with DistributedSampler's padding, which repeats the epoch's first windows to even out
    the ranks' shares, fewer than ``n`` windows are drawn twice)."""

    num_replicas: int  # set by DistributedSampler.__init__

    def state_dict(self) -> dict[str, int]:
        return {**super().state_dict(), "num_replicas": self.num_replicas}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        saved = int(state_dict.get("num_replicas", self.num_replicas))
        super().load_state_dict({"yielded": state_dict["yielded"]})
        if saved != self.num_replicas:
            consumed = int(state_dict["yielded"]) * saved
            self.next_yielded = consumed // self.num_replicas
            if self.rank == 0:
                logger.info("data: the position was saved on %d rank(s) and is loaded on %d: the epoch continues after "
                            "its first %d windows, %d per rank", saved, self.num_replicas, consumed, self.next_yielded)


class TextDataModule(LightningDataModule):
    """Next-token windows over the embedded corpus or a user's UTF-8 text file.

    Args:
        path: a text file; ``None`` uses the corpus shipped in the package.
        tokenizer: ``"byte"`` (vocab 256) or ``"bpe"`` (trained on the corpus at first use).
        bpe_vocab_size: vocabulary size for ``"bpe"`` (an upper bound: training stops when no pair repeats).
        seq_len: window length.
        batch_size: windows per batch per process.
        val_fraction: the tail of the corpus held out for validation.
        stride: distance between training window starts (default ``seq_len``); validation windows never overlap.
        num_workers: DataLoader workers.
        seed: seed of the training order (each epoch's permutation is seeded with ``seed + epoch``).

    .. note::
        A missing ``path`` raises ``FileNotFoundError`` and an argument out of range ``ValueError`` here, at
        construction, so a run stops before any process group or model is created. A corpus whose validation tail is shorter than one window
        raises ``ValueError`` in :meth:`setup`, naming the sizes.
    """

    def __init__(
        self,
        path: Optional[Union[str, Path]] = None,
        *,
        tokenizer: str = TEXT_DATA_DEFAULTS.tokenizer,
        bpe_vocab_size: int = TEXT_DATA_DEFAULTS.bpe_vocab_size,
        seq_len: int = TEXT_DATA_DEFAULTS.seq_len,
        batch_size: int = TEXT_DATA_DEFAULTS.batch_size,
        val_fraction: float = TEXT_DATA_DEFAULTS.val_fraction,
        stride: Optional[int] = TEXT_DATA_DEFAULTS.stride,
        num_workers: int = TEXT_DATA_DEFAULTS.num_workers,
        seed: int = TEXT_DATA_DEFAULTS.seed,
    ) -> None:
        super().__init__()
        problem = TextDataOptions(tokenizer=tokenizer, bpe_vocab_size=bpe_vocab_size, seq_len=seq_len,
                                  batch_size=batch_size, val_fraction=val_fraction, stride=stride,
                                  num_workers=num_workers, seed=seed).problem()
        if problem is not None:
            raise ValueError(f"TextDataModule: {problem}")
        if path is not None and not Path(path).is_file():
            load_text(path)  # raises FileNotFoundError naming the path
        self.path = None if path is None else Path(path)
        self.tokenizer_name = tokenizer
        self.bpe_vocab_size = bpe_vocab_size
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.stride = stride
        self.num_workers = num_workers
        self.seed = seed
        self.tokenizer: Optional[Tokenizer] = None
        self.train_set: Optional[TokenWindows] = None
        self.val_set: Optional[TokenWindows] = None

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        text = load_text(self.path)
        self.tokenizer = build_tokenizer(self.tokenizer_name, text, vocab_size=self.bpe_vocab_size)
        tokens_N = torch.tensor(self.tokenizer.encode(text), dtype=torch.long)
        source = "the embedded corpus" if self.path is None else repr(str(self.path))
        check_windows_fit(tokens_N.numel(), seq_len=self.seq_len, val_fraction=self.val_fraction, source=source)
        train_N, val_N = split_tokens(tokens_N, self.val_fraction)
        self.train_set = TokenWindows(train_N, self.seq_len, self.stride)
        self.val_set = TokenWindows(val_N, self.seq_len)
        if self.trainer is None or self.trainer.is_global_zero:
            logger.info(
                "data: %s, %d tokens (%s, vocab %d); %d train / %d val windows of %d",
                source, tokens_N.numel(), self.tokenizer.name, self.tokenizer.vocab_size,
                len(self.train_set), len(self.val_set), self.seq_len,
            )

    def train_dataloader(self) -> StatefulDataLoader:
        assert self.train_set is not None, "call setup() first"
        sampler = None
        trainer = self.trainer
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None
        if trainer is not None:
            # Each rank its own windows (as Lightning's DistributedSampler), with a position a checkpoint keeps; one
            # process too (one replica), so a position saved on another world size loads.
            kwargs = kwargs if kwargs and trainer.world_size > 1 else {"num_replicas": 1, "rank": 0}
            sampler = ResumableDistributedSampler(self.train_set, shuffle=True, seed=self.seed, **kwargs)
        return StatefulDataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=sampler is None, sampler=sampler, drop_last=True,
            num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
            generator=torch.Generator().manual_seed(self.seed) if sampler is None else None,
        )

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "call setup() first"
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)

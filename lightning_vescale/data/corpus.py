"""The embedded default corpus: English-like stories from a fixed-seed procedural generator.

The shipped file ``tiny_tales.txt`` is exactly ``generate_corpus()`` (a unit test checks it), so the
text is ours, public domain, reproducible, and nothing is fetched at run time. It is small (~200 KB)
but structured the way a byte-level language model finds learnable: a closed vocabulary of a few
hundred words, agreement between articles, nouns and pronouns, recurring characters inside a story,
punctuation, dialogue and paragraphs. A tiny Llama learns its spelling and phrase structure in a few
hundred steps, so the loss falls visibly in a CPU quick-start run.

The generator draws only ``random.Random(seed).random()`` (the Mersenne Twister stream, stable across
Python versions) and picks items with its own index arithmetic, so its output does not depend on how a
Python version implements ``choice`` or ``shuffle``.
"""

from __future__ import annotations

import random
import stat
from pathlib import Path
from typing import Optional, Sequence, TypeVar, Union

__all__ = ["EMBEDDED_CORPUS_PATH", "check_windows_fit", "generate_corpus", "load_text"]

EMBEDDED_CORPUS_PATH = Path(__file__).with_name("tiny_tales.txt")
"""Where the shipped corpus lives inside the package."""

_DEFAULT_SEED = 20260
_DEFAULT_NUM_CHARS = 200_000

_TRADES = (
    "miller", "fisher", "weaver", "shepherd", "baker", "smith", "sailor", "farmer", "potter", "hunter",
    "teacher", "carpenter", "gardener", "tailor", "painter", "merchant", "healer", "mason", "scribe", "piper",
)
# (name, pronoun) pairs; the pronoun keeps the sentences about one character consistent.
_NAMES = (
    ("Anna", "she"), ("Bram", "he"), ("Clara", "she"), ("Dario", "he"), ("Elsa", "she"), ("Finn", "he"),
    ("Greta", "she"), ("Hugo", "he"), ("Ida", "she"), ("Jonas", "he"), ("Kira", "she"), ("Lars", "he"),
    ("Mila", "she"), ("Nils", "he"), ("Olga", "she"), ("Pavel", "he"), ("Rosa", "she"), ("Sven", "he"),
    ("Tilda", "she"), ("Viktor", "he"),
)
_ANIMALS = ("fox", "owl", "goat", "crow", "horse", "cat", "dog", "hare", "bear", "swan", "mouse", "wolf")
_THINGS = (
    "lantern", "basket", "rope", "key", "kettle", "letter", "map", "coin", "bell", "blanket", "boat",
    "candle", "drum", "hammer", "ladder", "mirror", "needle", "pot", "ring", "shovel", "spoon", "wheel",
)
_PLACES = (
    "the mill", "the harbor", "the market", "the old bridge", "the forest", "the hill", "the village",
    "the river", "the orchard", "the tower", "the meadow", "the well", "the bakery", "the chapel",
    "the garden", "the cave", "the lake", "the road to the city",
)
_ADJECTIVES = (
    "old", "small", "quiet", "bright", "heavy", "broken", "golden", "warm", "cold", "tall", "round",
    "green", "red", "strange", "lost", "new", "wooden", "silver", "tired", "happy",
)
_TIMES = (
    "In the morning", "At dawn", "That evening", "Late at night", "One winter day", "At noon",
    "After the rain", "On the first day of spring", "Before sunrise", "When the bells rang",
)
_WEATHER = (
    "The wind was strong and cold.", "Snow fell over the roofs.", "The sun was warm on the stones.",
    "A grey fog lay over the water.", "Rain tapped on the windows.", "The sky was clear and blue.",
    "Thunder rolled far away.", "The air smelled of bread and smoke.",
)
_FEELINGS = ("glad", "afraid", "curious", "sad", "proud", "angry", "calm", "surprised")
# (present, past) verb forms that take a thing as object.
_VERBS = (
    ("find", "found"), ("carry", "carried"), ("mend", "mended"), ("hide", "hid"), ("sell", "sold"),
    ("buy", "bought"), ("clean", "cleaned"), ("lose", "lost"), ("wrap", "wrapped"), ("paint", "painted"),
    ("open", "opened"), ("hold", "held"),
)
_MOTIONS = ("walked", "ran", "hurried", "wandered", "rode", "climbed", "sailed", "went")
_NUMBERS = ("two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "twelve")
_PROVERBS = (
    "A kind word costs nothing.", "The river does not wait for the boat.", "Many hands make light work.",
    "Bread shared is bread doubled.", "A lantern is small, but the night is smaller.",
    "The patient hare catches the moon.", "Every road has two ends.", "Old wheels still turn.",
)


_T = TypeVar("_T")


class _Picker:
    """Deterministic picks from ``random.Random(seed).random()`` only."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def pick(self, items: Sequence[_T]) -> _T:
        return items[int(self._rng.random() * len(items))]

    def chance(self, p: float) -> bool:
        return self._rng.random() < p

    def count(self, low: int, high: int) -> int:
        return low + int(self._rng.random() * (high - low + 1))


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _plural(word: str) -> str:
    irregular = {"wolf": "wolves", "mouse": "mice", "fox": "foxes", "goat": "goats"}
    if word in irregular:
        return irregular[word]
    return word + "es" if word.endswith(("s", "sh", "ch", "x")) else word + "s"


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


class _Story:
    """One short tale: a hero (name, trade, pronoun), a companion animal, a thing and a place."""

    def __init__(self, p: _Picker) -> None:
        self.p = p
        self.name, self.pronoun = p.pick(_NAMES)
        self.trade = p.pick(_TRADES)
        self.possessive = "her" if self.pronoun == "she" else "his"
        self.animal = p.pick(_ANIMALS)
        self.thing = p.pick(_THINGS)
        self.adjective = p.pick(_ADJECTIVES)
        self.place = p.pick(_PLACES)
        self.friend = p.pick([n for n, _ in _NAMES if n != self.name])

    def opening(self) -> str:
        p = self.p
        return (
            f"Once there was {_article(self.trade)} {self.trade} named {self.name} who lived near {self.place}. "
            f"{_cap(self.pronoun)} had {_article(self.adjective)} {self.adjective} {self.thing} and a "
            f"{p.pick(_ADJECTIVES)} {self.animal}."
        )

    def sentence(self) -> str:
        p = self.p
        kind = p.count(0, 9)
        if kind == 0:
            return f"{p.pick(_TIMES)}, {self.name} {p.pick(_MOTIONS)} to {p.pick(_PLACES)}."
        if kind == 1:
            present, past = p.pick(_VERBS)
            return f"{_cap(self.pronoun)} {past} the {self.adjective} {self.thing} and felt {p.pick(_FEELINGS)}."
        if kind == 2:
            return p.pick(_WEATHER)
        if kind == 3:
            return (
                f"The {self.animal} followed {self.name} to {p.pick(_PLACES)}, and the {self.trade} "
                f"did not send it home."
            )
        if kind == 4:
            return (
                f'"Where is my {self.thing}?" asked {self.name}. "It is near {p.pick(_PLACES)}," '
                f"said {self.friend}."
            )
        if kind == 5:
            return (
                f"{self.friend} gave {self.name} {p.pick(_NUMBERS)} {_plural(p.pick(_THINGS))}, "
                f"and {self.pronoun} thanked {self.friend} with a smile."
            )
        if kind == 6:
            present, past = p.pick(_VERBS)
            return (
                f'"I will {present} the {p.pick(_THINGS)} before night," said the {self.trade}, '
                f"and {self.pronoun} did."
            )
        if kind == 7:
            return (
                f"{_cap(self.possessive)} {self.animal} was {p.pick(_FEELINGS)} because the "
                f"{p.pick(_ADJECTIVES)} {p.pick(_ANIMALS)} was near {p.pick(_PLACES)}."
            )
        if kind == 8:
            return (
                f"When {self.pronoun} came to {p.pick(_PLACES)}, {self.pronoun} saw {p.pick(_NUMBERS)} "
                f"{p.pick(_ADJECTIVES)} {_plural(p.pick(_ANIMALS))} and {_article(self.thing)} {self.thing}."
            )
        return f"{self.name} counted {p.pick(_NUMBERS)} stars and then {p.pick(_NUMBERS)} more."

    def ending(self) -> str:
        p = self.p
        return (
            f"At last {self.name} came home to {self.place} with the {self.thing}, and the {self.animal} slept "
            f"by the fire. {p.pick(_PROVERBS)}"
        )


def generate_corpus(seed: int = _DEFAULT_SEED, num_chars: int = _DEFAULT_NUM_CHARS) -> str:
    """Generate the English-like corpus: numbered tales of 2-4 paragraphs until ``num_chars`` is reached.

    Deterministic for a given ``(seed, num_chars)``; ASCII only (so byte and character counts agree).
    """
    p = _Picker(seed)
    parts: list[str] = []
    total = 0
    tale = 0
    while total < num_chars:
        tale += 1
        story = _Story(p)
        paragraphs = [story.opening() + " " + " ".join(story.sentence() for _ in range(p.count(2, 4)))]
        for _ in range(p.count(1, 3)):
            paragraphs.append(" ".join(story.sentence() for _ in range(p.count(3, 6))))
        paragraphs.append(story.ending())
        text = f"Tale {tale}. The {story.adjective.title()} {story.thing.title()}\n\n" + "\n\n".join(paragraphs)
        parts.append(text + "\n\n\n")
        total += len(parts[-1])
    return "".join(parts)


def _what_it_is(path: Path) -> str:
    """What a path that is not a regular file is, for the message."""
    if not path.exists():
        return "does not exist"
    mode = path.stat().st_mode
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return f"is {kind}, not a regular text file"
    return "is not a regular text file"


def load_text(path: Optional[Union[str, Path]] = None) -> str:
    """The text of ``path`` (UTF-8), or the embedded corpus when ``path`` is ``None``.

    Raises:
        FileNotFoundError: ``path`` does not exist or is not a regular file (a directory, a device such as
            ``/dev/null``, a pipe); the message names it and what it is.
        ValueError: the file is empty, is not UTF-8, or holds NUL bytes (a binary file); the message names the
            byte and how to convert the file.
    """
    if path is None:
        return EMBEDDED_CORPUS_PATH.read_text(encoding="utf-8")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"data.path {str(path)!r} {_what_it_is(path)} (resolved to {str(path.resolve())!r}); pass an existing "
            f"UTF-8 text file, or data=embedded for the built-in corpus"
        )
    data = path.read_bytes()
    if not data:
        raise ValueError(f"data.path {str(path)!r} is empty; a text corpus needs at least a few KB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"data.path {str(path)!r} is not UTF-8 text (byte {err.start} is 0x{data[err.start]:02x}): a binary file, "
            f"or text in another encoding; convert it with iconv -f <its encoding> -t UTF-8 (-c drops bytes that do "
            f"not convert)"
        ) from None
    if "\x00" in text:
        raise ValueError(
            f"data.path {str(path)!r} holds NUL bytes (the first at byte {data.index(0)}), so it is a binary file, not "
            f"text; pass a UTF-8 text file"
        )
    return text


def check_windows_fit(num_tokens: int, *, seq_len: int, val_fraction: float, source: str) -> None:
    """Raise unless ``num_tokens`` split by ``val_fraction`` (as :func:`~lightning_vescale.data.split_tokens`)
    gives at least one window of ``seq_len`` (+1 for the target) to train on and one to validate on.

    The message says what helps: a longer text or a shorter ``data.seq_len`` when the text cannot hold two
    windows, else the ``data.val_fraction`` that makes both splits fit.
    """
    window = seq_len + 1
    num_val = max(1, int(round(num_tokens * val_fraction)))
    if num_val >= window and num_tokens - num_val >= window:
        return
    if num_tokens < 2 * window:
        shorter = f", or data.seq_len={num_tokens // 2 - 1} at most" if num_tokens // 2 - 1 >= 1 else ""
        raise ValueError(
            f"{source} has {num_tokens} tokens, fewer than the {2 * window} of one training and one validation "
            f"window of data.seq_len={seq_len} (+1 for the target): use a longer text{shorter}"
        )
    if num_val < window:  # the smallest fraction that rounds to a whole window
        needed = next(f / 1000 for f in range(1, 1000) if int(round(num_tokens * f / 1000)) >= window)
        raise ValueError(
            f"the validation split of {source} (data.val_fraction={val_fraction}: {num_val} of {num_tokens} tokens) is "
            f"shorter than one window of data.seq_len={seq_len} (+1): set data.val_fraction={needed} or more"
        )
    most = max(f / 1000 for f in range(1, 1000) if num_tokens - max(1, int(round(num_tokens * f / 1000))) >= window)
    raise ValueError(
        f"data.val_fraction={val_fraction} leaves {num_tokens - num_val} of the {num_tokens} tokens of {source} to train "
        f"on, fewer than one window of data.seq_len={seq_len} (+1): set data.val_fraction={most} or less"
    )

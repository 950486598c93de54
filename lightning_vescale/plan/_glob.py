"""Globs on full-model names (``layers.0.attention.wq.weight``), with the dot as the separator.

* ``*`` matches within one name segment (``layers.*`` matches ``layers.0``, not ``layers.0.attention``);
* ``**`` matches any number of whole segments, none included (``**.weight`` matches ``weight`` and
  ``layers.0.attention.wq.weight``; ``layers.**`` matches ``layers`` and everything below it);
* ``?`` and ``[...]`` match one character within a segment, as in :mod:`fnmatch`;
* the root module's name is the empty string: only ``""`` and ``**`` match it.

``fnmatch``'s ``*`` crosses dots, so there ``layers.*`` would also match every submodule and parameter of
every layer: a plan that makes ``layers.*`` its groups would silently make each attention a group as well.
"""

from __future__ import annotations

import fnmatch
import functools
import re

__all__ = ["compile_glob", "glob_matches"]


def _segment_regex(segment: str) -> str:
    if "**" in segment:
        raise ValueError(f"'**' must be a whole name segment (between dots), got the segment {segment!r}")
    # fnmatch.translate gives '(?s:...)\Z'; its '.*' (from '*') must not cross a dot here.
    return fnmatch.translate(segment)[4:-3].replace(".*", "[^.]*")


@functools.lru_cache(maxsize=4096)
def compile_glob(pattern: str) -> re.Pattern:
    """The regular expression of ``pattern`` (see the module docstring); raises ValueError on a bad glob."""
    if not isinstance(pattern, str):
        raise ValueError(f"a name glob must be a string, got {pattern!r}")
    if pattern == "":
        return re.compile(r"\Z")
    segments = pattern.split(".")
    if any(s == "" for s in segments):
        raise ValueError(f"name glob {pattern!r} has an empty segment (two dots in a row, or a leading/trailing dot)")
    # Each segment becomes a regex for one dotted piece; "**" for any number of them. Pieces are joined with
    # the dot inside the optional groups, so "**" can also stand for no segment at all.
    regex = ""
    for i, seg in enumerate(segments):
        if seg == "**":
            regex += r"(?:[^.]+)?(?:\.[^.]+)*" if i == 0 else r"(?:\.[^.]+)*"
        else:
            piece = _segment_regex(seg)
            if i == 0:
                regex += piece
            elif segments[i - 1] == "**" and i == 1:
                # "**.x": x is either the whole name or follows a dot.
                regex = r"(?:[^.]+\.)*" + piece
            else:
                regex += r"\." + piece
    try:
        return re.compile(regex + r"\Z", re.DOTALL)
    except re.error as err:
        raise ValueError(f"name glob {pattern!r} is not a valid glob: {err}") from None


def glob_matches(pattern: str, name: str) -> bool:
    """Whether the full-model ``name`` matches ``pattern``."""
    if name == "":
        return pattern in ("", "**")
    return compile_glob(pattern).match(name) is not None

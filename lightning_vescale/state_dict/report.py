"""One report of what differs between two sets of named tensors: missing, unexpected, wrong shape (or dtype kind).

Used wherever a state is loaded into a model (sharded checkpoints, Hugging Face weights, recipe
``init_from``), so every mismatch reads the same way and lists the names with their shapes.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

__all__ = ["mismatch_report", "listing"]

MAX_LISTED = 20


def listing(items: Sequence[str], limit: int = MAX_LISTED) -> str:
    """``items`` joined by commas, the first ``limit`` only, with how many more there are."""
    shown = ", ".join(items[:limit])
    return shown + (f", ... and {len(items) - limit} more" if len(items) > limit else "")


def _fmt(value: Any) -> str:
    if value is None:
        return "(non-tensor)"
    if isinstance(value, tuple) and all(isinstance(d, int) for d in value):
        return str(value)
    return str(value)


def mismatch_report(
    expected: Mapping[Any, Any],
    given: Mapping[Any, Any],
    *,
    ours: str,
    theirs: str,
    name: Callable[[Any], str] = str,
) -> Optional[str]:
    """Lines naming the entries missing from ``given``, unexpected in it, and present in both with another
    shape (or other description), or None when they agree.

    Args:
        expected: name -> shape (a tuple; None for a non-tensor) of what ``ours`` holds.
        given: name -> shape of what ``theirs`` (the state being loaded) holds.
        ours, theirs: how the two are called in the text (``"model"``, ``"checkpoint"``).
        name: renders a key (e.g. a DCP path tuple) for the text.
    """
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    mismatched = [k for k in expected if k in given and expected[k] != given[k]]
    if not (missing or unexpected or mismatched):
        return None
    lines = []
    if missing:
        lines.append(f"  missing from the {theirs} ({len(missing)}): "
                     + listing([f"{name(k)} {_fmt(expected[k])}" for k in missing]))
    if unexpected:
        lines.append(f"  unexpected in the {theirs}, not in the {ours} ({len(unexpected)}): "
                     + listing([f"{name(k)} {_fmt(given[k])}" for k in unexpected]))
    if mismatched:
        lines.append(f"  shape mismatch ({len(mismatched)}): "
                     + listing([f"{name(k)}: {theirs} {_fmt(given[k])}, {ours} {_fmt(expected[k])}"
                                for k in mismatched]))
    return "\n".join(lines)

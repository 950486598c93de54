"""How the recipes print numbers: bytes in binary units and counts in decimal ones, three significant digits
(``1,024,620`` bytes -> ``0.977 MiB``, ``671,026,404,352`` parameters -> ``671B``), losses with four decimals."""

from __future__ import annotations

import math

__all__ = ["format_bytes", "format_count", "format_loss"]


def _significant(value: float, digits: int = 3) -> str:
    if value == 0:
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}"


def _scaled(value: float, base: int, units: tuple[str, ...]) -> tuple[float, str]:
    """``value`` divided by ``base`` until it shows in three digits (below 999.5), and its unit."""
    for unit in units[:-1]:
        if abs(value) < 999.5:
            return value, unit
        value /= base
    return value, units[-1]


def format_bytes(num_bytes: float) -> str:
    """``512`` -> ``"512 B"``, ``1536`` -> ``"1.50 KiB"``, ``1024620`` -> ``"0.977 MiB"``: powers of 1024, three
    significant digits (whole bytes below 1000 B)."""
    value, unit = _scaled(float(num_bytes), 1024, ("B", "KiB", "MiB", "GiB", "TiB", "PiB"))
    return f"{value:.0f} B" if unit == "B" else f"{_significant(value)} {unit}"


def format_count(count: float) -> str:
    """``106816`` -> ``"107K"``, ``1235814400`` -> ``"1.24B"``, ``671026404352`` -> ``"671B"``: powers of 1000,
    three significant digits."""
    value, unit = _scaled(float(count), 1000, ("", "K", "M", "B", "T"))
    return f"{value:.0f}" if unit == "" else f"{_significant(value)}{unit}"


def format_loss(loss: float) -> str:
    """A loss with four decimals (``2.3140``), the same in every line."""
    return f"{loss:.4f}"

"""The memory ledger: bytes per state class and tier, current and peak, beside ``comm_stats``."""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

__all__ = ["MemoryLedger", "memory_stats"]


@dataclass
class MemoryLedger:
    """Bytes the memory manager holds, per ``(class, tier)``: current, peak since the last ``step()``, and peak ever."""

    current: dict = field(default_factory=lambda: defaultdict(int))
    step_peak: dict = field(default_factory=lambda: defaultdict(int))
    peak: dict = field(default_factory=lambda: defaultdict(int))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str, tier: str, num_bytes: int) -> None:
        key = (kind, tier)
        with self._lock:
            self.current[key] += num_bytes
            self.step_peak[key] = max(self.step_peak[key], self.current[key])
            self.peak[key] = max(self.peak[key], self.current[key])

    def step(self) -> dict:
        """Close a step: its peaks per ``"class/tier"``, then start a new one from the current values."""
        with self._lock:
            out = {f"{k}/{t}": v for (k, t), v in self.step_peak.items()}
            self.step_peak = defaultdict(int, self.current)
            return out

    def reset(self) -> None:
        """Restart the peaks from the current values (what is on each tier now stays counted)."""
        with self._lock:
            self.step_peak = defaultdict(int, self.current)
            self.peak = defaultdict(int, self.current)

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """``{"class/tier": (current, peak since the last step())}`` of every class and tier seen."""
        with self._lock:
            keys = sorted(set(self.current) | set(self.step_peak))
            return {f"{k}/{t}": (self.current[(k, t)], self.step_peak[(k, t)]) for k, t in keys}


memory_stats = MemoryLedger()
"""The process-wide ledger every tier move records into."""

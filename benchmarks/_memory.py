"""A device-agnostic peak-memory ledger: live tensor storage bytes, sampled after every op.

CPU has no caching-allocator statistics, so this counts what the engines actually keep alive: every
tensor created under the mode is tracked by weak reference and the unique storages of the live ones
are summed after each op (a freed buffer, ``storage.resize_(0)``, counts 0). Slow: use it in a
separate pass from the timed steps.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakMemory(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self._tensors: list[weakref.ref] = []
        self.peak = 0
        self.current = 0
        self._ops = 0

    def track(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._tensors.append(weakref.ref(t))

    def _measure(self) -> int:
        seen: dict[int, int] = {}
        alive = []
        for ref in self._tensors:
            t = ref()
            if t is None:
                continue
            alive.append(ref)
            try:
                s = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            seen[s._cdata] = s.nbytes()
        self._tensors = alive
        return sum(seen.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._tensors.append(weakref.ref(t))
        self._ops += 1
        self.current = self._measure()
        self.peak = max(self.peak, self.current)
        return out

"""Peak memory per rank, measured two ways that must agree: the operating system and a tensor ledger.

[Note: why two measures]
The operating system's high-water mark of the resident set (``VmHWM``, what ``ru_maxrss`` reports) cannot
miss an allocation, but it cannot say what the memory was. The ledger says what it was: a dispatch mode
that follows every tensor storage alive (by class) and samples the total after every op. Each checks the
other: a ledger that disagrees with the system by more than a few percent is missing something.

* The system's measure follows live memory only if freed memory goes back to it: run the process with
  :data:`MALLOC_ENV` (glibc returns every freed block of 128 KiB or more), and take the baseline after the
  imports and the process group. ``reset_peak_rss()`` (Linux ``clear_refs``) restarts the high-water mark,
  so the peak of each op and each phase is read exactly, not only the peak of the whole process.
* What the old ledger missed (measured, see ``benchmarks/results/memory.md``): (1) the pieces inside tensor
  subclasses -- a dispatch mode only sees the wrapper that ``RaggedTensor`` / ``DTensor`` ops return, never
  the local tensors created inside them, so every optimizer state of both sharded engines was invisible;
  (2) the staging copy gloo makes inside ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` (a full
  buffer-sized allocation in C++ that lives as long as the collective's ``Work`` handle, not only until the
  collective completes). The ledger unwraps subclasses, and it counts each collective's staging from its
  call until its handle is released, sized by :func:`measure_staging` (a measurement on this backend, not
  an assumption).
"""

from __future__ import annotations

import math
import sys
import weakref
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
"""glibc: serve every block of 128 KiB or more with mmap and trim the heap above 128 KiB, so that the
resident set follows live memory instead of allocator slack (set before the process starts)."""

CLASSES = (
    "sharded params", "gradients", "optimizer states", "unsharded params", "unsharded grads",
    "activations", "comm buffers", "comm staging (backend)", "not tensors",
)
"""Every byte of a ledger sample is in exactly one class. "activations" is every tensor the classifier does
not name (activations, autograd's saved tensors and temporaries); "comm buffers" are the engine's own
collective buffers (FSDP2's AllGather / ReduceScatter buffers, casts); "comm staging (backend)" the copies the
backend makes inside a collective; "not tensors" what the process holds above the baseline that is not a
tensor storage (Python objects, allocator pages, kernel libraries' workspaces), measured once after a warm-up
step and held constant."""

CLAIM_ORDER = (
    "unsharded params", "unsharded grads", "gradients", "comm buffers", "optimizer states", "sharded params",
)
"""A storage named by several classes counts in the first of these (the engines' buffers are named exactly; the
parameters registered on the model are the unsharded ones while a group is gathered)."""


# --------------------------------------------------------------------------------------------------------
# The operating system's measure (Linux /proc; falls back to ru_maxrss, which cannot be reset)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_bytes() -> int:
    """The resident set now."""
    return _status("VmRSS")


def peak_rss_bytes() -> int:
    """The resident set's high-water mark since the process started or since :func:`reset_peak_rss`."""
    return _status("VmHWM")


def reset_peak_rss() -> None:
    """Restart the high-water mark at the current resident set (Linux >= 4.0: ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure_staging(group: Optional[dist.ProcessGroup] = None, numel: int = 1 << 22) -> dict[str, dict[str, float]]:
    """Bytes the backend allocates inside each collective, per byte of the buffer that sizes it (AllGather: its
    output; ReduceScatter: its input; AllReduce / all-to-all: the tensor), measured on this process's resident
    set: ``during`` a synchronous call (its peak), and ``held`` after an asynchronous one completed while its
    ``Work`` handle is still held (gloo keeps the ReduceScatter's copy inside the handle)."""
    n = dist.get_world_size(group)
    full = torch.ones(numel * n)
    piece = torch.ones(numel)
    calls = {
        "all_gather": (lambda **kw: dist.all_gather_into_tensor(full, piece, group=group, **kw), 0),
        "reduce_scatter": (lambda **kw: dist.reduce_scatter_tensor(piece, full, group=group, **kw), 0),
        "all_reduce": (lambda **kw: dist.all_reduce(full, group=group, **kw), 0),
        "all_to_all": (lambda **kw: dist.all_to_all_single(out, full, group=group, **kw), 0),
    }
    out = torch.empty_like(full)
    nbytes = full.numel() * full.element_size()
    ratios = {}
    for name, (call, _) in calls.items():
        during = held = 0
        for _ in range(2):  # the first calls set up connections and buffers that stay
            dist.barrier(group)
            before = rss_bytes()
            reset_peak_rss()
            call()
            during = peak_rss_bytes() - before
            dist.barrier(group)
            before = rss_bytes()
            work = call(async_op=True)
            work.wait()
            held = rss_bytes() - before
            del work
        ratios[name] = {"during": max(0.0, round(during / nbytes, 2)), "held": max(0.0, round(held / nbytes, 2))}
    return ratios


_STAGED = {
    # torch.distributed function: (kind in measure_staging, the tensor argument that sizes the staging)
    "all_gather_single": ("all_gather", 0),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "all_reduce": ("all_reduce", 0),
    "all_to_all_single": ("all_to_all", 1),
}


class _StagingTracker:
    """Backend staging alive now, per collective: ``during`` bytes from its call until it completes, then
    ``held`` bytes until its ``Work`` handle is released (a synchronous call releases it before returning).

    The tracker wraps the ``torch.distributed`` functions every deprecated alias ends in, wherever a module
    holds a reference to them, and watches each handle through a weak reference (it never keeps one alive:
    holding a gloo handle would keep its staging alive).
    """

    def __init__(self, ratios: dict[str, dict[str, float]]) -> None:
        self.ratios = ratios
        self.live: dict[int, tuple[Optional[weakref.ref], int, int]] = {}
        self._next = 0
        self._originals: list[tuple[object, str, object]] = []

    def bytes(self) -> int:
        total = 0
        for ref, during, held in list(self.live.values()):
            work = ref() if ref is not None else None
            total += held if work is not None and work.is_completed() else during
        return total

    def _wrap(self, name: str, kind: str, position: int):
        original = getattr(dist.distributed_c10d, name)

        def staged(*args, **kwargs):
            tensor = args[position] if len(args) > position else None
            nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
            ratio = self.ratios.get(kind, {})
            key = self._next
            self._next += 1
            self.live[key] = (None, int(ratio.get("during", 0.0) * nbytes), 0)
            work = original(*args, **kwargs)
            if work is None:
                self.live.pop(key, None)
            else:
                self.live[key] = (weakref.ref(work), int(ratio.get("during", 0.0) * nbytes),
                                  int(ratio.get("held", 0.0) * nbytes))
                weakref.finalize(work, self.live.pop, key, None)
            return work

        return original, staged

    def __enter__(self) -> _StagingTracker:
        replace = {}
        for name, (kind, position) in _STAGED.items():
            original, staged = self._wrap(name, kind, position)
            replace[id(original)] = (original, staged)
        # Every module-level reference (``from torch.distributed import all_reduce``, aliases bound at import).
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for attr, value in list(namespace.items()):
                hit = replace.get(id(value))
                if hit is not None and value is hit[0]:
                    self._originals.append((module, attr, value))
                    setattr(module, attr, hit[1])
        return self

    def __exit__(self, *exc) -> None:
        for module, name, original in reversed(self._originals):
            setattr(module, name, original)
        self._originals.clear()


# --------------------------------------------------------------------------------------------------------
# The ledger


def _inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s memory: itself, or a subclass's pieces."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return [t]
    if isinstance(getattr(t, "_local_tensor", None), torch.Tensor):  # DTensor
        return _inner_tensors(t._local_tensor)
    if hasattr(t, "to_local"):  # RaggedTensor
        return _inner_tensors(t.to_local())
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, name) for name in names]
        return [x for i in inner if isinstance(i, torch.Tensor) for x in _inner_tensors(i)]
    return [t]


def _storage(t: torch.Tensor) -> Optional[torch.UntypedStorage]:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(s.nbytes() for s in _unique_storages(tensors).values())


def _unique_storages(tensors: Iterable) -> dict[int, torch.UntypedStorage]:
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        for inner in _inner_tensors(t):
            s = _storage(inner)
            if s is not None and s.device.type != "meta":
                seen[s._cdata] = s
    return seen


Classifier = Callable[[], dict[str, list]]
"""Returns, for the classes it can name, the tensors in them now (each storage is counted once, in the first
class of :data:`CLAIM_ORDER` that names it)."""


class PhaseRecord:
    """The peak of one phase: the system's, and the ledger's with its breakdown at that moment."""

    def __init__(self) -> None:
        self.os_peak = 0  # bytes above the baseline
        self.ledger_peak = 0
        self.breakdown: dict[str, int] = {}
        self.op_at_peak = ""

    def as_dict(self) -> dict:
        return {"os_peak": self.os_peak, "ledger_peak": self.ledger_peak, "breakdown": dict(self.breakdown),
                "op_at_peak": self.op_at_peak}


class MemoryLedger(TorchDispatchMode):
    """Live tensor bytes by class after every op, next to the system's peak during that op.

    Args:
        classify: names the engine's tensors (parameters, gradients, states, buffers) at a sample.
        baseline_rss: the resident set the system's measure starts from (after imports and process group).
        staging: bytes the backend allocates per byte of each collective (:func:`measure_staging`).

    Enter it around the steps to measure; call :meth:`phase` at each phase boundary. Slow (every op walks the
    live storages): use it in its own pass, never around timed steps.
    """

    def __init__(self, classify: Classifier, *, baseline_rss: int, staging: dict[str, float]) -> None:
        super().__init__()
        self.classify = classify
        self.baseline_rss = baseline_rss
        self._tensors: list[weakref.ref] = []
        self._staging = _StagingTracker(staging)
        self.phases: dict[str, PhaseRecord] = {}
        self._phase: Optional[PhaseRecord] = None
        self.not_tensors = 0

    # -- setup ----------------------------------------------------------------------------------------------
    def track(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for inner in _inner_tensors(t):
                    self._tensors.append(weakref.ref(inner))

    def start(self) -> None:
        """Fix "not tensors": what the process holds above the baseline now that is not a tracked storage. Call
        it after a warm-up step, once libraries have set up their workspaces."""
        self.not_tensors = max(0, rss_bytes() - self.baseline_rss - self._live_bytes()[0])
        reset_peak_rss()

    def phase(self, name: str) -> None:
        self._sample("(boundary)")
        self._phase = self.phases.setdefault(name, PhaseRecord())

    # -- sampling -------------------------------------------------------------------------------------------
    def _live_bytes(self) -> tuple[int, dict[int, torch.UntypedStorage]]:
        alive, tensors = [], []
        for ref in self._tensors:
            t = ref()
            if t is not None:
                alive.append(ref)
                tensors.append(t)
        self._tensors = alive
        storages = _unique_storages(tensors)
        return sum(s.nbytes() for s in storages.values()), storages

    def __enter__(self) -> MemoryLedger:
        self._staging.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._staging.__exit__(*exc)

    def _sample(self, op_name: str) -> None:
        os_peak = peak_rss_bytes() - self.baseline_rss
        reset_peak_rss()
        live, storages = self._live_bytes()
        staging = self._staging.bytes()
        total = live + staging + self.not_tensors
        phase = self._phase
        if phase is None:
            return
        phase.os_peak = max(phase.os_peak, os_peak)
        if total > phase.ledger_peak:
            phase.ledger_peak = total
            phase.op_at_peak = op_name
            phase.breakdown = self._breakdown(storages, staging)

    def _breakdown(self, storages: dict[int, torch.UntypedStorage], staging: int) -> dict[str, int]:
        named = self.classify()
        out = dict.fromkeys(CLASSES, 0)
        claimed: set[int] = set()
        for cls in CLAIM_ORDER:
            for key, s in _unique_storages(named.get(cls, [])).items():
                if key in storages and key not in claimed:
                    claimed.add(key)
                    out[cls] += s.nbytes()
        out["activations"] += sum(s.nbytes() for k, s in storages.items() if k not in claimed)
        out["comm staging (backend)"] += staging
        out["not tensors"] += self.not_tensors
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outputs = tree_flatten(out)[0]
        self.track(*[t for t in outputs if isinstance(t, torch.Tensor)])
        self._sample(str(func))
        return out

    # -- results --------------------------------------------------------------------------------------------
    def results(self) -> dict:
        phases = {name: rec.as_dict() for name, rec in self.phases.items()}
        os_peak = max((r["os_peak"] for r in phases.values()), default=0)
        ledger_peak = max((r["ledger_peak"] for r in phases.values()), default=0)
        return {"os_peak": os_peak, "ledger_peak": ledger_peak, "not_tensors": self.not_tensors, "phases": phases}


def agreement(ledger: int, os_peak: int) -> float:
    """The ledger over the system's measure (1.0: they agree)."""
    return ledger / os_peak if os_peak else math.nan


__all__ = [
    "CLASSES", "MALLOC_ENV", "MemoryLedger", "agreement", "measure_staging", "peak_rss_bytes", "reset_peak_rss",
    "rss_bytes",
]

"""Where each kind of training state lives: the tiers, and the policy that places state classes on them."""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional, Union

__all__ = [
    "TIERS", "MemoryPolicy", "Tier", "check_explicit_policy", "check_plan_tiers", "check_policy_fields", "parse_bytes",
]

Tier = Literal["device", "host", "disk"]
TIERS: tuple[str, ...] = ("device", "host", "disk")

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value: Union[int, str]) -> int:
    """``6GiB``, ``512MB``, ``1.5GiB`` or a plain number of bytes -> bytes."""
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a byte budget must be >= 0, got {value}")
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?I?B?)\s*", str(value), flags=re.IGNORECASE)
    if m is None or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as bytes: write e.g. 6GiB, 512MB or 1073741824")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


@dataclass(frozen=True)
class MemoryPolicy:
    """Which tier holds each class of training state.

    ``device`` is the training device, ``host`` CPU memory (pinned, copied on a side stream, on CUDA; the same
    as ``device`` on a CPU-only machine), ``disk`` files under ``disk_dir`` read and written in large chunks
    (ZeRO-Infinity's NVMe tier). States on ``host`` / ``disk`` are brought to the device just before they are
    used (prefetched ahead when ``prefetch``) and written back after.
    """

    optimizer_states: Tier = "device"
    """Per-element optimizer states (Adam's moments, Muon's momentum)."""
    params: Tier = "device"
    """This rank's pieces of the sharded master weights (each group's DBuffer piece): on ``host`` / ``disk`` they
    are read back just before the group's AllGather (the next group's ahead) and for the optimizer step."""
    grads: Tier = "device"
    """This rank's pieces of the reduced gradients: on ``host`` / ``disk`` each is written there as soon as its
    ReduceScatter finished and read back by the optimizer step (and by clipping, gradient accumulation)."""
    gathered_params: Tier = "device"
    """The gathered (unsharded) parameters of groups that reshard after forward, between their forward and
    backward: ``device`` frees them and gathers again in backward; ``disk`` writes them under ``disk_dir`` and
    reads them back for backward instead of the AllGather (see [Note: gathered parameters on disk]); ``host`` is
    the device's memory on a CPU-only machine (nothing moves) and not available on accelerators yet."""
    activations: str = "device"
    """Activations saved for backward by ``activation_blocks``: ``device``, ``host``, ``disk``, or ``checkpoint``
    (recompute the blocks' forward in backward instead of keeping them)."""
    activation_blocks: tuple[str, ...] = ("*layers.*",)
    """Globs on module names: the blocks whose activations ``activations`` places (outermost matches only)."""
    budget: Optional[Union[int, str]] = None
    """Bytes per rank (e.g. ``"6GiB"``): the recipes then choose ``optimizer_states`` and ``activations`` by the
    cost model of :mod:`lightning_vescale.memory.budget` and print the table before training."""
    disk_dir: Optional[str] = None
    """Directory for the ``disk`` tier, on a local disk: created if only its last component is missing (a missing
    parent is more likely a typo or an unmounted disk: an error); must be writable, and have room for what goes
    there (checked by :func:`~lightning_vescale.memory.apply_memory_policy` before anything moves)."""
    prefetch: bool = True
    """Read optimizer states ahead on a background thread (the step's first buckets at the end of backward, the
    next ones while earlier buckets step) and write stepped buckets back on another (the last completing during
    the next forward), with at most ``prefetch_buckets`` buckets in memory at a time; off, every read and write
    is synchronous, inside ``step``. See [Note: swapping optimizer states]."""
    bucket_bytes: int = 64 * 2**20
    """Target size of one swapped bucket of optimizer states."""
    prefetch_buckets: int = 5
    """With ``prefetch``: buckets of offloaded optimizer states in memory at once (read ahead, stepping or being
    written back), the transient memory offload needs (``prefetch_buckets * bucket_bytes``). More hides more of
    the disk's time behind backward and the next forward, at that much more peak memory."""

    def __post_init__(self) -> None:
        check_policy_fields({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, "MemoryPolicy.")
        object.__setattr__(self, "activation_blocks", tuple(self.activation_blocks))
        if "disk" in (self.optimizer_states, self.params, self.grads, self.gathered_params, self.activations):
            if not self.disk_dir:
                raise ValueError("MemoryPolicy: a 'disk' tier needs disk_dir=<a directory on a local disk>")
            _check_writable(self.disk_dir)


def check_policy_fields(values: Mapping[str, Any], prefix: str) -> None:
    """Raise ``ValueError`` (naming ``<prefix><field>``) for a :class:`MemoryPolicy` field value it cannot take:
    the checks that need nothing but the values (no disk), shared by the policy and the recipes' ``memory``
    config, which holds the same fields for Hydra."""
    for name in ("optimizer_states", "params", "grads", "gathered_params"):  # a tier
        if name in values and values[name] not in TIERS:
            raise ValueError(f"{prefix}{name} must be one of {', '.join(TIERS)}, got {values[name]!r}")
    activations = values.get("activations", "device")
    if activations not in (*TIERS, "checkpoint"):
        raise ValueError(f"{prefix}activations must be one of {', '.join((*TIERS, 'checkpoint'))}, got "
                         f"{activations!r}")
    if values.get("budget") is not None:
        try:
            parse_bytes(values["budget"])
        except ValueError as e:
            raise ValueError(f"{prefix}budget: {e}") from None
    if values.get("bucket_bytes", 1) <= 0:
        raise ValueError(f"{prefix}bucket_bytes must be > 0, got {values['bucket_bytes']}")
    if values.get("prefetch_buckets", 1) < 1:
        raise ValueError(f"{prefix}prefetch_buckets must be >= 1 (the bucket stepping), got "
                         f"{values['prefetch_buckets']}")


def _check_writable(directory: str) -> None:
    parent = os.path.dirname(os.path.abspath(directory))
    if not os.path.isdir(directory) and not os.path.isdir(parent):
        raise ValueError(f"MemoryPolicy.disk_dir={directory!r} does not exist, nor does its parent {parent!r} (a typo, "
                         f"or a disk that is not mounted?); create it or pick an existing directory on a local disk")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise ValueError(f"MemoryPolicy.disk_dir={directory!r} cannot be created ({e}); pick a writable directory") from None
    if not os.path.isdir(directory):
        raise ValueError(f"MemoryPolicy.disk_dir={directory!r} is not a directory; pick a directory on a local disk")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"MemoryPolicy.disk_dir={directory!r} is not writable; pick a writable directory")
    try:  # a read-only mount can pass os.access: write a byte to be sure
        with tempfile.TemporaryFile(dir=directory) as f:
            f.write(b"0")
    except OSError as e:
        raise ValueError(f"MemoryPolicy.disk_dir={directory!r} cannot be written ({e}); pick a writable directory") \
            from None


def check_explicit_policy(memory: object, where: str) -> None:
    """Raise unless ``memory`` is ``None`` or a :class:`MemoryPolicy` with explicit placements (the integrations
    take placements; a budget is turned into them by ``choose_placement``, as the recipes do)."""
    if memory is None:
        return
    if not isinstance(memory, MemoryPolicy):
        raise TypeError(f"{where} must be a lightning_vescale.memory.MemoryPolicy, got {type(memory).__name__}")
    if memory.budget is not None:
        raise ValueError(f"{where} takes explicit placements; a budget is turned into them by "
                         "lightning_vescale.memory.choose_placement (the recipes do this with memory.budget=...)")


def check_plan_tiers(plan: Any, memory: Optional[MemoryPolicy], where: str) -> None:
    """Raise now (before any process or process group) when ``plan`` puts state on the disk tier and ``memory``
    names no ``disk_dir`` (a plan holds no machine paths: the directory is the run's), or that directory is not
    writable. ``plan``: a :class:`~lightning_vescale.plan.Plan`, its dict form or a resolved plan (other values,
    e.g. MPMD plans, are checked where they are applied)."""
    if plan is None:
        return
    from lightning_vescale.plan import Plan, is_mpmd_plan

    if is_mpmd_plan(plan):
        return
    plan = getattr(plan, "plan", plan)  # a ResolvedPlan's own plan
    if isinstance(plan, Mapping):
        plan = Plan.from_dict(plan)
    if not isinstance(plan, Plan):
        return
    on_disk = [(who, sorted(c for c, t in classes.items() if t == "disk")) for who, classes in plan.tier_settings()]
    on_disk = [(who, classes) for who, classes in on_disk if classes]
    if not on_disk:
        return
    said = "; ".join(f"{who} puts {', '.join(classes)} on disk" for who, classes in on_disk[:3])
    if memory is None or not memory.disk_dir:
        raise ValueError(
            f"{where}: the plan{f' {plan.name!r}' if plan.name else ''} puts state on the disk tier ({said}), but "
            f"{'no memory policy is given' if memory is None else 'the memory policy names no disk_dir'}: pass "
            f"MemoryPolicy(disk_dir=<a directory on a local disk>) (the directory is the run's: a plan holds no "
            f"machine paths)"
        )
    _check_writable(memory.disk_dir)

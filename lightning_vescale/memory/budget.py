"""From a per-rank byte budget to a placement: which state classes leave the device, by a cost model.

[Note: choosing placements]
The per-rank bytes of each class (sharded parameters, gradients, optimizer states, gathered parameters,
activations of one micro-batch) come from the dry run (:mod:`lightning_vescale.plan`) or from a live model.
Each way to free device memory has a saving and a cost per step:

* optimizer states to disk: saves all but the swap buckets in memory at once around a step
  (``MemoryPolicy.prefetch_buckets``); costs writing and reading them once per step;
* master weights to disk: saves all but two buckets; costs reading them for the forward's and the backward's
  AllGathers and the optimizer step, and writing them once per step;
* gradient pieces to disk: saves all but two buckets; costs writing and reading them once per step;
* activations to disk: saves all but about two blocks' worth; costs writing and reading them once per step;
* activation checkpointing: saves all but the blocks' inputs and one block's activations; costs one more
  forward of the checkpointed blocks.

Costs are seconds from the bandwidths of the tiers measured at start-up (:func:`measure_disk_bandwidth`) and the
forward time estimate. The cheapest combination of options that fits the budget is chosen; if none does, the
error says the smallest device footprint reachable and what needs it.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from lightning_vescale.memory.policy import parse_bytes

__all__ = ["MemoryEstimate", "Placement", "choose_placement", "measure_disk_bandwidth"]

CLASSES = ("params", "grads", "optimizer_states", "gathered_params", "activations")


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes of each state class, and what the cost model needs to price moving them."""

    params: float
    grads: float
    optimizer_states: float
    gathered_params: float
    activations: float
    num_blocks: int = 1
    """Blocks the activations are spread over (they are offloaded or checkpointed per block)."""
    block_inputs: float = 0.0
    """Bytes of the blocks' inputs (what checkpointing keeps)."""
    forward_seconds: float = 0.0
    """Estimated forward time of one micro-batch (what checkpointing adds)."""
    bucket_bytes: float = 64 * 2**20
    prefetch_buckets: int = 5
    """Buckets of optimizer states that stay in memory around a step when they are offloaded."""

    def total(self) -> float:
        return sum(getattr(self, c) for c in CLASSES)


@dataclass
class Placement:
    """The chosen placement: the tier (or policy) of each class, the resulting device bytes and the price."""

    tiers: dict = field(default_factory=dict)
    device_bytes: dict = field(default_factory=dict)
    seconds_per_step: dict = field(default_factory=dict)
    budget: float = 0.0

    @property
    def total(self) -> float:
        return float(sum(self.device_bytes.values()))

    def table(self) -> str:
        rows = ["| state | placement | on the device (MiB) | cost per step (s) |", "|---|---|---|---|"]
        for c in CLASSES:
            rows.append(f"| {c} | {self.tiers[c]} | {self.device_bytes[c] / 2**20:.1f} | "
                        f"{self.seconds_per_step.get(c, 0.0):.3f} |")
        rows.append(f"| total | | {self.total / 2**20:.1f} of a {self.budget / 2**20:.1f} MiB budget | "
                    f"{sum(self.seconds_per_step.values()):.3f} |")
        return "\n".join(rows)


def measure_disk_bandwidth(directory: str, nbytes: int = 64 * 2**20) -> float:
    """Bytes per second of writing then reading ``nbytes`` under ``directory`` (the disk tier's speed here)."""
    os.makedirs(directory, exist_ok=True)
    data = torch.empty(nbytes, dtype=torch.uint8)
    with tempfile.NamedTemporaryFile(dir=directory) as f:
        start = time.perf_counter()
        f.write(data.numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
        f.seek(0)
        f.read()
        elapsed = time.perf_counter() - start
    return 2 * nbytes / max(elapsed, 1e-9)


def choose_placement(estimate: MemoryEstimate, budget: int | str, *, disk_bandwidth: float,
                     allow: tuple[str, ...] = ("optimizer_states", "params", "grads", "activations_disk",
                                               "checkpoint")) -> Placement:
    """The cheapest placement of ``estimate`` within ``budget`` bytes per rank (see [Note: choosing placements])."""
    limit = float(parse_bytes(budget))
    device = {c: float(getattr(estimate, c)) for c in CLASSES}
    tiers = {c: "device" for c in CLASSES}
    cost: dict = {}
    per_block = estimate.activations / max(estimate.num_blocks, 1)
    two_buckets = 2 * estimate.bucket_bytes
    state_buckets = estimate.prefetch_buckets * estimate.bucket_bytes
    options = {
        "optimizer_states": (device["optimizer_states"] - min(device["optimizer_states"], state_buckets),
                             2 * device["optimizer_states"] / disk_bandwidth),
        "params": (device["params"] - min(device["params"], two_buckets), 4 * device["params"] / disk_bandwidth),
        "grads": (device["grads"] - min(device["grads"], two_buckets), 2 * device["grads"] / disk_bandwidth),
        "activations_disk": (device["activations"] - min(device["activations"], 2 * per_block),
                             2 * device["activations"] / disk_bandwidth),
        "checkpoint": (device["activations"] - min(device["activations"], estimate.block_inputs + per_block),
                       estimate.forward_seconds),
    }
    # Few options: try every combination (activations are offloaded or recomputed, not both) and keep the
    # cheapest that fits; cheaper combinations first, so ties keep fewer moves.
    best: Optional[tuple[float, tuple[str, ...]]] = None
    smallest: Optional[tuple[float, tuple[str, ...]]] = None
    for mask in range(1 << len(allow)):
        combo = tuple(o for i, o in enumerate(allow) if mask >> i & 1)
        if "activations_disk" in combo and "checkpoint" in combo:
            continue
        total = sum(device.values()) - sum(options[o][0] for o in combo)
        seconds = sum(options[o][1] for o in combo)
        if total <= limit and (best is None or seconds < best[0]):
            best = (seconds, combo)
        if smallest is None or total < smallest[0]:
            smallest = (total, combo)
    assert smallest is not None  # set by the first combination (nothing freed)
    combo = best[1] if best is not None else smallest[1]  # the most that can be freed, for the error
    for option in combo:
        saved, seconds = options[option]
        if option in ("optimizer_states", "params", "grads"):
            device[option] -= saved
            tiers[option] = "disk"
            cost[option] = seconds
        else:
            device["activations"] -= saved
            tiers["activations"] = "disk" if option == "activations_disk" else "checkpoint"
            cost["activations"] = seconds
    placement = Placement(tiers, device, cost, limit)
    if placement.total > limit:
        need = ", ".join(f"{c} {device[c] / 2**20:.1f} MiB" for c in CLASSES if device[c])
        raise ValueError(
            f"a budget of {limit / 2**20:.1f} MiB per rank is too small for this model and micro-batch: with every "
            f"available offload the device still needs {placement.total / 2**20:.1f} MiB ({need}). Raise the "
            f"budget to at least that, shard over more ranks, or use a smaller micro-batch."
        )
    return placement

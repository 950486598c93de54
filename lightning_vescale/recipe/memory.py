"""The recipes' ``memory`` group: explicit placements, or a per-rank budget turned into them by the cost model."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

from lightning_vescale.memory import MemoryEstimate, MemoryPolicy, choose_placement, measure_disk_bandwidth

logger = logging.getLogger(__name__)

__all__ = ["check_disk_room", "memory_policy_for", "estimate_for", "world_size_of"]

_PRECISION = {"fp32": "32-true", "32-true": "32-true", "bf16_mixed": "bf16-mixed", "bf16-mixed": "bf16-mixed",
              "bf16_true": "bf16-true", "bf16-true": "bf16-true"}


def world_size_of(config) -> int:
    """The number of training processes the recipe's trainer settings start (Lightning's choice for "auto")."""
    devices, accelerator = config.trainer.devices, config.trainer.accelerator
    if isinstance(devices, int):
        per_node = devices
    elif isinstance(devices, list):
        per_node = len(devices)
    elif accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available():
        per_node = torch.cuda.device_count()
    else:
        per_node = 1
    return per_node * config.trainer.num_nodes


def replicate_of(config, world_size: int) -> int:
    """Replicas of an HSDP run (``strategy.replicate_size``; ``"auto"``: one per node), 1 otherwise: each group is
    sharded over ``world_size / replicas`` ranks, so that is what a rank holds."""
    r = getattr(config.strategy, "replicate_size", None)
    if r == "auto":
        r = int(getattr(config.trainer, "num_nodes", 1) or 1)
    return r if isinstance(r, int) and r > 0 and world_size % r == 0 else 1


def estimate_for(config, world_size: int) -> MemoryEstimate:
    """Per-rank bytes of the recipe's run from the dry-run planner (the model on the meta device)."""
    from lightning_vescale.plan import Workload, dry_run, load_profile, resolve_for

    with torch.device("meta"):
        model = config.model.build_model()
    resolved = resolve_for(model, config.plan)
    precision = _PRECISION.get(str(getattr(config.trainer, "precision", "32-true")), "32-true")
    optimizer = {"MuonConfig": "muon", "AdamW8bitConfig": "adamw8bit"}.get(type(config.optimizer).__name__, "adamw")
    workload = Workload(batch_size=config.data.batch_size, seq_len=config.data.seq_len, precision=precision,
                        optimizer=optimizer)
    hardware = load_profile("cpu" if not torch.cuda.is_available() else "h200")
    run = dry_run(model, resolved, world_size, workload=workload, hardware=hardware,
                  replicate=replicate_of(config, world_size)).vescale
    blocks = sum(1 for name, _ in model.named_modules() if name.count(".") == 1 and name.startswith("layers."))
    hidden = run.activations / max(workload.tokens, 1)
    return MemoryEstimate(
        params=run.params, grads=run.grads, optimizer_states=run.optimizer, gathered_params=run.gathered_peak,
        activations=run.activations, num_blocks=max(blocks, 1),
        block_inputs=max(blocks, 1) * workload.tokens * config.model.build_config().dim * 4 if hidden else 0.0,
        forward_seconds=run.compute_seconds / 3,
        bucket_bytes=config.memory.bucket_bytes, prefetch_buckets=config.memory.prefetch_buckets,
    )


def memory_policy_for(config, run_dir: Path, world_size: int) -> Optional[MemoryPolicy]:
    """The :class:`MemoryPolicy` of ``config.memory`` (``None``: everything on the device). With a budget, the
    placement is chosen here and its table logged before training. Without a ``memory`` group, a plan that puts
    state on disk gets the recipes' disk directory, ``<run dir>/swap``, as ``memory.disk_dir: null`` does."""
    m = config.memory
    if m is None:
        from lightning_vescale.plan import Plan

        if config.plan is not None and any("disk" in c.values() for _, c in Plan.from_dict(config.plan).tier_settings()):
            return MemoryPolicy(disk_dir=os.path.join(str(run_dir), "swap"))
        return None
    disk_dir = m.disk_dir or os.path.join(str(run_dir), "swap")
    optimizer_states, params, grads, activations = m.optimizer_states, m.params, m.grads, m.activations
    if m.budget is not None:
        estimate = estimate_for(config, world_size)
        placement = choose_placement(estimate, m.budget, disk_bandwidth=measure_disk_bandwidth(disk_dir))
        optimizer_states, activations = placement.tiers["optimizer_states"], placement.tiers["activations"]
        params, grads = placement.tiers["params"], placement.tiers["grads"]
        logger.info("memory budget %s per rank: placement chosen by the cost model\n%s", m.budget, placement.table())
    return MemoryPolicy(optimizer_states=optimizer_states, params=params, grads=grads, activations=activations,
                        gathered_params=m.gathered_params, activation_blocks=tuple(m.activation_blocks), disk_dir=disk_dir, prefetch=m.prefetch,
                        bucket_bytes=m.bucket_bytes, prefetch_buckets=m.prefetch_buckets)


_DISK_NAMES = {"params": "master weights", "grads": "gradients", "optimizer_states": "optimizer states",
               "gathered_params": "gathered parameters", "activations": "activations of a micro-batch"}


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk_room(config) -> None:
    """Refuse a ``memory`` placement whose disk tier cannot hold what it puts there, before anything starts.

    The bytes are the dry run's per rank (weights, gradients, optimizer states, gathered parameters and, with
    ``memory.activations=disk``, one micro-batch's activations), times the ranks of a node (every rank's folder
    is on the same disk), against the free space where ``memory.disk_dir`` (default ``<run dir>/swap``) will be.
    With ``memory.budget``, the placement the cost model would choose is checked.

    Raises:
        ValueError: names the bytes per class, the free space and the fixes.
    """
    m = config.memory
    if m is None:
        return
    tiers = {c: getattr(m, c) for c in _DISK_NAMES}
    world = world_size_of(config)
    estimate = None
    if m.budget is not None:
        estimate = estimate_for(config, world)
        tiers = choose_placement(estimate, m.budget, disk_bandwidth=1e9).tiers
    on_disk = [c for c, t in tiers.items() if t == "disk"]
    if not on_disk:
        return
    estimate = estimate or estimate_for(config, world)
    per_node = max(1, world // max(1, int(getattr(config.trainer, "num_nodes", 1) or 1)))
    need = {c: getattr(estimate, c) * per_node for c in on_disk if getattr(estimate, c)}
    where = Path(m.disk_dir) if m.disk_dir else Path(config.output_root)
    free = shutil.disk_usage(_existing_ancestor(where)).free
    if sum(need.values()) > free:
        parts = ", ".join(f"{_DISK_NAMES[c]} {v / 2**20:.1f} MiB" for c, v in need.items())
        raise ValueError(
            f"memory: the disk tier at {where} has {free / 2**20:.1f} MiB free, but this placement puts "
            f"{sum(need.values()) / 2**20:.1f} MiB there ({parts}; for the {per_node} rank(s) of a node): free space, "
            f"set memory.disk_dir=<a larger disk>, or keep some of them on the device (e.g. memory.activations=checkpoint)"
        )

"""The MPMD recipe's loop (see :mod:`lightning_vescale.recipe.mpmd` for what it trains and writes)."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from lightning_vescale.recipe.mpmd import MPMDConfig

__all__ = ["run_mpmd"]

logger = logging.getLogger(__name__)


def run_mpmd(config: Any, run_dir: Path) -> dict[str, Any]:
    """Train ``config`` (a validated ``TrainConfig`` with ``mpmd`` set) and return the summary (on every rank)."""
    import torch.distributed as dist
    from lightning.fabric import Fabric

    from lightning_vescale.models.vlm import VLM, synthetic_vlm_batch, vlm_config
    from lightning_vescale.pipeline import MPMDModel, save_mpmd
    from lightning_vescale.recipe.module import build_optimizer_from_config, lr_multiplier

    mpmd_config: MPMDConfig = config.mpmd
    plan = mpmd_config.mpmd_plan()
    t = config.trainer
    fabric = Fabric(accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, strategy="ddp")
    fabric.launch()  # the processes and the default process group; nothing is wrapped
    plan.check_world_size(dist.get_world_size())
    arch = vlm_config(mpmd_config.model)
    torch.manual_seed(config.seed)
    images, tokens, _ = synthetic_vlm_batch(arch, mpmd_config.batch_size, mpmd_config.seq_len, 0, seed=config.seed)
    from lightning_vescale.parallelize import parallelize

    model = parallelize(VLM(arch), plan.to_dict(), example_inputs=(images, tokens), device=fabric.device)
    assert isinstance(model, MPMDModel)  # a plan with pipeline stages
    optimizer = build_optimizer_from_config(config.optimizer, model)
    peak = [g["lr"] for g in optimizer.param_groups]
    sched = config.scheduler
    losses, times = [], []
    for step in range(t.max_steps):
        factor = lr_multiplier(step, warmup_steps=sched.warmup_steps, max_steps=t.max_steps, decay=sched.decay,
                               min_lr_ratio=sched.min_lr_ratio)
        for group, lr in zip(optimizer.param_groups, peak):
            group["lr"] = lr * factor
        images, tokens, target = synthetic_vlm_batch(arch, mpmd_config.batch_size, mpmd_config.seq_len, step,
                                                     seed=config.seed)
        start = time.perf_counter()
        loss = model.step(images, tokens, target=target)
        norm = model.clip_grad_norm_(t.gradient_clip_val) if t.gradient_clip_val else None
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        if fabric.global_rank == 0 and ((step + 1) % t.log_every_n_steps == 0 or step + 1 == t.max_steps):
            logger.info("step %d/%d  loss %.4f%s  %.1f ms/step", step + 1, t.max_steps, losses[-1],
                        f"  grad_norm {float(norm):.3f}" if norm is not None else "", 1e3 * times[-1])
    if t.checkpoint_every_n_steps > 0:
        save_mpmd(run_dir / "checkpoints" / "final", model, optimizer, extra={"step": t.max_steps})
    steady = times[1:] or times
    summary = {
        "model": f"vlm_{mpmd_config.model}", "world_size": dist.get_world_size(), "steps": t.max_steps,
        "plan": plan.to_dict(), "losses": losses, "first_loss": losses[0], "final_loss": losses[-1],
        "loss_is_finite": all(math.isfinite(x) for x in losses),
        "step_time_s_mean": sum(steady) / len(steady), "run_dir": str(run_dir),
    }
    if fabric.global_rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        logger.info("MPMD run done: loss %.4f -> %.4f, %.1f ms/step; wrote %s", losses[0], losses[-1],
                    1e3 * summary["step_time_s_mean"], run_dir / "summary.json")
    return summary

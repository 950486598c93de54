"""The MPMD recipe's loop (see :mod:`lightning_vescale.recipe.mpmd` for what it trains and writes)."""

from __future__ import annotations

import json
import logging
import math
import statistics
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
    from lightning_vescale.pipeline import MPMDModel, lm_loss, save_mpmd
    from lightning_vescale.recipe.module import build_optimizer_from_config, lr_multiplier

    mpmd_config: MPMDConfig = config.mpmd
    t = config.trainer
    fabric = Fabric(accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, strategy="ddp")
    fabric.launch()  # the processes and the default process group; nothing is wrapped
    world = dist.get_world_size()
    profile = mpmd_config.hardware if mpmd_config.hardware != "auto" else ("h200" if torch.cuda.is_available() else "cpu")
    # The cost model runs on the first rank only (a few seconds of meta-device tracing) and its choice is sent.
    box: list[Any] = [mpmd_config.choose(world, profile) if fabric.global_rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    plan, costs = box[0]
    if plan is not None:
        plan.check_world_size(world)
    layout = "uniform" if plan is None else plan.name or "mpmd"
    if fabric.global_rank == 0:
        if costs:
            ranking = ", ".join(f"{c.name.removeprefix('mpmd:')} {1e3 * c.step_seconds:.0f} ms" for c in costs[:5])
            logger.info("mpmd.layout=auto (%s profile): %s predicted fastest of %d layouts (%s, ...)", profile, layout,
                        len(costs), ranking)
        else:
            logger.info("mpmd.layout=%s: %s", mpmd_config.layout, layout)
    arch = vlm_config(mpmd_config.model)
    torch.manual_seed(config.seed)
    images, tokens, _ = synthetic_vlm_batch(arch, mpmd_config.batch_size, mpmd_config.seq_len, 0, seed=config.seed)
    import lightning_vescale as lv

    if plan is not None:
        model = lv.parallelize(VLM(arch), plan.to_dict(), example_inputs=(images, tokens), device=fabric.device)
        assert isinstance(model, MPMDModel)  # a plan with pipeline stages
    else:
        from torch.distributed.device_mesh import init_device_mesh

        model = lv.parallelize(VLM(arch).to(fabric.device), None, init_device_mesh(fabric.device.type, (world,)))
    optimizer = build_optimizer_from_config(config.optimizer, model)
    peak = [g["lr"] for g in optimizer.param_groups]
    sched = config.scheduler
    per_rank = mpmd_config.batch_size // world
    mine = slice(fabric.global_rank * per_rank, (fabric.global_rank + 1) * per_rank)
    losses, times, cpu_times = [], [], []
    for step in range(t.max_steps):
        factor = lr_multiplier(step, warmup_steps=sched.warmup_steps, max_steps=t.max_steps, decay=sched.decay,
                               min_lr_ratio=sched.min_lr_ratio)
        for group, lr in zip(optimizer.param_groups, peak):
            group["lr"] = lr * factor
        images, tokens, target = synthetic_vlm_batch(arch, mpmd_config.batch_size, mpmd_config.seq_len, step,
                                                     seed=config.seed)
        start, start_cpu = time.perf_counter(), time.process_time()
        if isinstance(model, MPMDModel):
            loss = model.step(images, tokens, target=target)
            norm = model.clip_grad_norm_(t.gradient_clip_val) if t.gradient_clip_val else None
        else:
            dev = fabric.device
            loss = lm_loss(model(images[mine].to(dev), tokens[mine].to(dev)), target[mine].to(dev))
            loss.backward()
            norm = lv.clip_grad_norm_(model.parameters(), t.gradient_clip_val) if t.gradient_clip_val else None
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= world  # every rank's mean over an equal part: the whole batch's mean
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - start_cpu)
        losses.append(float(loss))
        if fabric.global_rank == 0 and ((step + 1) % t.log_every_n_steps == 0 or step + 1 == t.max_steps):
            logger.info("step %d/%d  loss %.4f%s  %.1f ms/step", step + 1, t.max_steps, losses[-1],
                        f"  grad_norm {float(norm):.3f}" if norm is not None else "", 1e3 * times[-1])
    if t.checkpoint_every_n_steps > 0:
        if isinstance(model, MPMDModel):
            save_mpmd(run_dir / "checkpoints" / "final", model, optimizer, extra={"step": t.max_steps})
        else:
            from lightning_vescale import checkpoint

            checkpoint.save(run_dir / "checkpoints" / "final", model, optimizer, extra={"step": t.max_steps})
    steady, steady_cpu = (times[1:] or times), (cpu_times[1:] or cpu_times)
    cpu_total = torch.tensor(sum(steady_cpu) / len(steady_cpu), dtype=torch.float64)
    dist.all_reduce(cpu_total)  # the machine's work per step: every rank's CPU seconds
    summary = {
        "model": f"vlm_{mpmd_config.model}", "world_size": world, "steps": t.max_steps, "layout": layout,
        "plan": plan.to_dict() if plan is not None else None,
        "predicted": [{"layout": c.name.removeprefix("mpmd:"), "step_seconds": c.step_seconds} for c in costs],
        "losses": losses, "first_loss": losses[0], "final_loss": losses[-1],
        "loss_is_finite": all(math.isfinite(x) for x in losses),
        "step_time_s_mean": sum(steady) / len(steady), "step_time_s_median": statistics.median(steady),
        "cpu_time_s_per_step": cpu_total.item(), "run_dir": str(run_dir),
    }
    if fabric.global_rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        logger.info("MPMD run (%s) done: loss %.4f -> %.4f, %.1f ms/step; wrote %s", layout, losses[0], losses[-1],
                    1e3 * summary["step_time_s_mean"], run_dir / "summary.json")
    return summary

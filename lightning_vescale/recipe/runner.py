"""The recipes' training run: :func:`run` checks a config, builds the data, model, strategy and callbacks, and fits
with the Lightning Trainer."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Optional, Union

import torch
from omegaconf import DictConfig

from lightning_vescale.export import export_hf
from lightning_vescale.models import num_params
from lightning_vescale.recipe.builders import (
    build_datamodule,
    build_strategy,
    limit_cpu_threads,
    precision_line,
    trainer_precision,
)
from lightning_vescale.recipe.checks import preflight
from lightning_vescale.recipe.init_weights import hf_model_type, load_initial_weights, record_run
from lightning_vescale.recipe.logs import loggers_for, quiet_other_ranks, tidy_lightning_output
from lightning_vescale.recipe.memory import memory_policy_for, world_size_of
from lightning_vescale.recipe.numbers import format_count
from lightning_vescale.recipe.paths import absolute, run_dir_for, run_dir_if_known
from lightning_vescale.recipe.schema import FinetuneConfig, TrainConfig

__all__ = ["SIGTERM_EXIT_CODE", "run"]

logger = logging.getLogger("lightning_vescale.recipe")

SIGTERM_EXIT_CODE = 128 + 15
"""Exit code of a run stopped by SIGTERM (the shell's convention for "terminated by SIGTERM")."""


def run(cfg: Union[DictConfig, TrainConfig]) -> Optional[dict[str, Any]]:
    """Check ``cfg`` and train with the Lightning Trainer; returns the run summary.

    Every check that can fail on the config happens first (:func:`~lightning_vescale.recipe.checks.preflight`;
    under Hydra the recipes already ran it before creating the run directory): the schema, the data path, the
    initial weights of a fine-tuning run and the checkpoint to resume from.

    Raises:
        SystemExit: code 143 when SIGTERM stopped the run (after saving it if ``trainer.save_on_signal``).
    """
    from lightning.fabric.utilities.rank_zero import _get_rank
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_vescale.recipe.callbacks import (
        LineProgress,
        NonFiniteError,
        NonFiniteGuard,
        PlanReport,
        RecipeProgressBar,
        RunSummary,
        StepCheckpoint,
        StepStats,
        StopOnSignal,
    )
    from lightning_vescale.recipe.module import CausalLMModule
    from lightning_vescale.recipe.quant import AdapterExport

    tidy_lightning_output()
    quiet_other_ranks(_get_rank() or 0)
    checked = preflight(cfg, run_dir=run_dir_if_known())
    config, resume = checked.config, checked.resume
    limit_cpu_threads(config)
    run_dir = run_dir_for(config)
    if config.mpmd is not None:
        from lightning_vescale.recipe.mpmd_run import run_mpmd

        return run_mpmd(config, run_dir)
    datamodule = build_datamodule(config.data, seed=config.seed)
    ckpt_path = str(resume.checkpoint) if resume is not None else None
    init_state = None
    if isinstance(config, FinetuneConfig) and ckpt_path is None:
        init_state = load_initial_weights(absolute(config.init_from), config.model, quant=config.quant,
                                          allow_unverified=config.allow_unverified)
    if (_get_rank() or 0) == 0:
        record_run(config, run_dir, resume)
    seed_everything(config.seed, workers=True, verbose=False)
    memory = memory_policy_for(config, run_dir, world_size_of(config))
    strategy = build_strategy(config, memory)

    t = config.trainer
    module = CausalLMModule(
        config.model, config.optimizer, config.scheduler, max_steps=t.max_steps,
        expert_bias_rate=config.expert_bias_rate, init_state_dict=init_state, quant=config.quant,
    )
    stats = StepStats(tokens_per_batch=config.data.batch_size * config.data.seq_len)
    with torch.device("meta"):
        total_params = num_params(config.model.build_model())
    extra = {
        "model": f"{config.model.family}_{config.model.preset}",
        "model_overrides": config.model.overrides(),
        "num_params": total_params,
        "strategy": type(strategy).__name__,
        "optimizer": config.optimizer._target_,
        "precision": t.precision,
        "data": config.data.path or "embedded",
        "tokenizer": config.data.tokenizer,
        "run_dir": str(run_dir),
        "resumed_from": ckpt_path,
        "init_from": getattr(config, "init_from", None),
        "notes": dict(config.notes),
    }
    summary = RunSummary(stats, run_dir, extra=extra)
    callbacks: list[Any] = [stats, summary, StopOnSignal(), PlanReport(run_dir), NonFiniteGuard(t.on_non_finite, stats)]
    if t.enable_progress_bar:
        callbacks.append(RecipeProgressBar() if sys.stdout.isatty() else LineProgress(t.log_every_n_steps))
    export = isinstance(config, FinetuneConfig) and config.export_hf
    if config.quant is not None and config.quant.mode == "qlora":
        # The checkpoints hold codes + adapters: the adapters (PEFT) and the merged model come from the live model.
        assert isinstance(config, FinetuneConfig)  # the schema allows qlora on fine-tunes only
        callbacks.append(AdapterExport(run_dir, config.model.build_config(), hf_model_type(config, resume),
                                       merged=export, base_model_name_or_path=str(absolute(config.init_from))))
    if t.checkpoint_every_n_steps > 0 or t.save_on_signal or export:
        callbacks.append(
            StepCheckpoint(
                dirpath=run_dir / "checkpoints", filename="step-{step:06d}", auto_insert_metric_name=False,
                every_n_train_steps=t.checkpoint_every_n_steps, save_top_k=t.checkpoint_keep, save_last="link",
                enable_version_counter=False, save_final=t.checkpoint_every_n_steps > 0 or export,
                save_on_signal=t.save_on_signal,
            )
        )
    trainer = Trainer(
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes,
        **trainer_precision(strategy, t.precision),
        strategy=strategy, max_steps=t.max_steps, max_epochs=-1,
        accumulate_grad_batches=t.accumulate_grad_batches, gradient_clip_val=t.gradient_clip_val,
        val_check_interval=t.val_every_n_steps * t.accumulate_grad_batches, check_val_every_n_epoch=None,
        limit_val_batches=t.limit_val_batches, log_every_n_steps=t.log_every_n_steps,
        num_sanity_val_steps=t.num_sanity_val_steps, deterministic=t.deterministic,
        enable_progress_bar=t.enable_progress_bar,
        enable_checkpointing=any(isinstance(c, StepCheckpoint) for c in callbacks),
        enable_model_summary=False, callbacks=callbacks, logger=loggers_for(run_dir), default_root_dir=run_dir,
    )
    quiet_other_ranks(trainer.global_rank)
    if trainer.is_global_zero:
        logger.info(
            "training %s (%s parameters) with %s on %d process(es), precision %s; %s; writing to %s",
            extra["model"], format_count(total_params), extra["strategy"], trainer.world_size,
            precision_line(strategy, t.precision),
            f"resuming from {ckpt_path}" if ckpt_path else "from scratch" if init_state is None else
            f"from {extra['init_from']}", run_dir,
        )
        if resume is not None:
            logger.info("%s", resume.reason)
        for note in resume.notes if resume is not None else []:
            logger.warning("resume: %s", note)
        if t.accelerator == "cpu" and t.precision.startswith("bf16"):
            logger.warning(
                "precision=%s on CPU is usually slower than fp32 (bf16 pays on GPUs with bf16 tensor cores; see the "
                "README's Precision section): use precision=fp32 on CPU", t.precision,
            )
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    except SIGTERMException:
        if trainer.is_global_zero:
            saved = ckpt.last_model_path if isinstance(ckpt := trainer.checkpoint_callback, StepCheckpoint) else ""
            logger.warning(
                "stopped by SIGTERM after step %d%s", trainer.global_step,
                f"; saved {saved}: continue with resume=true (or resume={run_dir})" if saved and t.save_on_signal
                else " (no checkpoint saved: trainer.save_on_signal=false)",
            )
        raise SystemExit(SIGTERM_EXIT_CODE) from None
    except NonFiniteError as err:
        if trainer.is_global_zero:
            saved = ckpt.last_model_path if isinstance(ckpt := trainer.checkpoint_callback, StepCheckpoint) else ""
            logger.error("%s%s", err, f" (last checkpoint: {os.path.realpath(saved)})" if saved else "")
        raise SystemExit(1) from None
    if export and trainer.is_global_zero and not any(isinstance(c, AdapterExport) for c in callbacks):
        out = export_hf(run_dir, run_dir / "hf")
        logger.info("wrote the Hugging Face model to %s (python -m lightning_vescale.export does the same)", out)
    return summary.summary

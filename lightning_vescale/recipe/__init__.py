"""Training recipes: typed Hydra configs, the causal-LM LightningModule, callbacks, and :func:`run`.

``recipes/train.py`` and ``recipes/finetune.py`` are thin ``@hydra.main`` apps around :func:`run`::

    python recipes/train.py                                   # llama_tiny, embedded corpus, vescale, 2 CPUs
    python recipes/train.py model=moe_tiny optimizer=muon trainer.max_steps=500
    python recipes/train.py experiment=fsdp2_baseline          # the same run on torch FSDP2
    python recipes/train.py resume=true                        # continue the newest run of this name
    python recipes/finetune.py init_from=/path/to/hf_checkpoint_dir export_hf=true

Everything that can be checked on the config is checked before the run directory exists
(:mod:`~lightning_vescale.recipe.checks`). A run writes to ``{output_root}/{name}/{timestamp}/``:
``.hydra/`` (the composed config), ``model.json`` (the resolved model config), ``checkpoints/``
(``step-000100.ckpt``..., ``last.ckpt``), ``csv/metrics.csv`` (and ``tb/`` when TensorBoard is installed),
``loss_curve.png`` and ``summary.json``; a fine-tune also ``tokenizer/`` (the files of ``init_from``) and,
with ``export_hf=true``, ``hf/`` (a Hugging Face directory). SIGTERM stops every rank after the same step,
saves it (``trainer.save_on_signal``) and exits with code 143. A step whose loss or gradients are not finite on
any rank stops every rank before its optimizer step and exits with code 1, naming the step and the ranks
(``trainer.on_non_finite=skip`` skips such steps instead).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import hydra.utils
import torch
from omegaconf import DictConfig, OmegaConf

from lightning_vescale.engine.planner import element_blocks
from lightning_vescale.export import (
    TOKENIZER_DIR,
    copy_tokenizer_files,
    export_hf,
    locate_checkpoint,
    read_model_state,
    read_run_model,
    tokenizer_source_of,
    write_run_model,
)
from lightning_vescale.models import from_pretrained, num_params
from lightning_vescale.models.hf import read_pretrained_config
from lightning_vescale.quant.tensor import weights_state_dict
from lightning_vescale.recipe.checks import (
    ConfigError,
    Resume,
    check_same_architecture,
    find_last_checkpoint,
    preflight,
)
from lightning_vescale.recipe.memory import memory_policy_for, world_size_of
from lightning_vescale.recipe.numbers import format_count
from lightning_vescale.recipe.schema import (
    AdamW8bitConfig,
    CheckpointModelConfig,
    DataConfig,
    FinetuneConfig,
    ModelConfig,
    ModelParallelStrategyConfig,
    MuonConfig,
    QuantConfig,
    TrainConfig,
    register_configs,
    validate,
)
from lightning_vescale.state_dict.report import mismatch_report

if TYPE_CHECKING:
    from lightning.pytorch.loggers import Logger
    from lightning.pytorch.strategies import Strategy

    from lightning_vescale.data import TextDataModule

# [Note: Lightning is imported where it is used]
# The recipes check a config (schema, checks, Hydra) before anything heavy is imported, so a typo costs the import
# of torch and not of Lightning: this package's face imports no Lightning, and the functions that build the run
# import it (and the modules that need it: callbacks, module, quant) inside.
_FROM_MODULE = ("CausalLMModule", "build_optimizer_from_config", "lr_multiplier")


def __getattr__(name: str) -> Any:
    if name in _FROM_MODULE:
        from lightning_vescale.recipe import module

        return getattr(module, name)
    raise AttributeError(f"module 'lightning_vescale.recipe' has no attribute {name!r}")


__all__ = [
    "CausalLMModule",
    "ConfigError",
    "FinetuneConfig",
    "TrainConfig",
    "build_datamodule",
    "build_optimizer_from_config",
    "build_strategy",
    "find_last_checkpoint",
    "load_initial_weights",
    "lr_multiplier",
    "preflight",
    "register_configs",
    "run",
    "validate",
]

logger = logging.getLogger(__name__)

SIGTERM_EXIT_CODE = 128 + 15
"""Exit code of a run stopped by SIGTERM (the shell's convention for "terminated by SIGTERM")."""


def build_datamodule(data: DataConfig, *, seed: int = 0) -> TextDataModule:
    """The data module ``data`` describes (a relative ``path`` is taken from the launch directory); ``seed``
    orders the training windows."""
    from lightning_vescale.data import TextDataModule

    path = None if data.path is None else hydra.utils.to_absolute_path(data.path) if _hydra_on() else data.path
    return TextDataModule(
        path, tokenizer=data.tokenizer, bpe_vocab_size=data.bpe_vocab_size, seq_len=data.seq_len,
        batch_size=data.batch_size, val_fraction=data.val_fraction, stride=data.stride, num_workers=data.num_workers,
        seed=seed,
    )


def build_strategy(config: TrainConfig, memory: Optional[Any] = None) -> Strategy:
    """Instantiate ``config.strategy`` (``_target_`` plus its arguments); ``memory``: its MemoryPolicy."""
    node = OmegaConf.to_container(OmegaConf.structured(config.strategy), resolve=True)
    assert isinstance(node, dict)  # a structured config's container
    if isinstance(config.optimizer, MuonConfig) and "granularity" in node and node["granularity"] is None:
        # Where the plan sets no granularity: keep Muon's matrices whole on their owner rank.
        node["granularity"] = "muon"
    if isinstance(config.optimizer, AdamW8bitConfig) and "granularity" in node and node["granularity"] is None:
        # Where the plan sets no granularity: cut on the 8-bit blocks, so every rank quantizes whole blocks.
        node["granularity"] = element_blocks(config.optimizer.block_size)
    if config.plan is not None:
        node["plan"] = config.plan
    if isinstance(config.strategy, ModelParallelStrategyConfig) and node["data_parallel_size"] is None:
        node["data_parallel_size"] = world_size_of(config)
    timeout = node.pop("timeout", None)  # seconds; Lightning's strategies take a timedelta, null: their default
    if timeout is not None:
        node["timeout"] = timedelta(seconds=timeout)
    strategy = hydra.utils.instantiate(node, _convert_="all")
    if memory is not None:
        strategy.memory_policy = memory  # a dataclass instance does not travel through Hydra's instantiate
    return strategy


def load_initial_weights(
    init_from: Union[str, Path], model: ModelConfig, *, quant: Optional[QuantConfig] = None,
    allow_unverified: bool = False,
) -> dict[str, torch.Tensor]:
    """The full state dict a fine-tuning run starts from, checked against the chosen ``model``.

    ``init_from`` is one of:

    * a Hugging Face checkpoint directory (``config.json`` + safetensors; loaded with
      :func:`lightning_vescale.models.from_pretrained`);
    * a recipe run directory (its ``checkpoints/last.ckpt``) or one of its checkpoints (a sharded directory
      of the vescale or fsdp2 strategy, or a DDP file): only the model's tensors are read, in this one
      process, whatever world size saved it;
    * a state-dict file (``.safetensors``, or a ``torch.save`` of a ``state_dict``; a Lightning checkpoint
      file's ``state_dict`` is accepted too).

    With ``model=from_checkpoint`` the model config is the checkpoint's own (plus the user's overrides), so
    only the tensors' names and shapes are checked. An FP8 block checkpoint (``quantization_config``) is
    dequantized, except for a QLoRA run (``quant``) in its own format and block size, which gets its codes and
    scales as they are (:class:`~lightning_vescale.quant.QuantizedTensor` entries). A sharded checkpoint without
    ``checksums.json`` is refused unless ``allow_unverified``.

    Raises:
        FileNotFoundError: the path does not exist, or a directory is none of the above.
        ValueError: the checkpoint's architecture or tensors do not match ``model``; the message lists the
            differing fields (or names and shapes) and how to pick the matching model.
    """
    from lightning_vescale.recipe.quant import quantized_weights_mode

    path = Path(init_from)
    arch = model.build_config()
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in model.build_model().state_dict().items()}
    chosen = f"model={model.family}_{model.preset}" + (f" with {model.overrides()}" if model.overrides() else "")
    from_checkpoint = isinstance(model, CheckpointModelConfig)
    if path.is_dir() and (path / "config.json").is_file():
        mode = quantized_weights_mode(quant, json.loads((path / "config.json").read_text()))
        hf_model, hf_arch = from_pretrained(path, quantized_weights=mode)
        if not from_checkpoint:
            check_same_architecture(hf_arch, arch, path, chosen)
        state = weights_state_dict(hf_model) if mode == "keep" else hf_model.state_dict()
    elif path.exists():
        try:
            checkpoint, _ = locate_checkpoint(path)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"init_from={str(path)!r} is a directory without config.json (found: "
                f"{sorted(p.name for p in path.iterdir())[:10]}). Fine-tuning starts from a Hugging Face checkpoint "
                f"directory, a recipe run or checkpoint, or a full state-dict file."
            ) from None
        try:
            state = read_model_state(checkpoint, allow_unverified=allow_unverified)
        except ValueError as err:
            raise ValueError(f"init_from={str(path)!r}: {err}") from None
    else:
        raise FileNotFoundError(f"init_from={str(path)!r} does not exist (resolved to {str(path.resolve())!r})")
    _check_state_matches(state, expected, path, chosen)
    return state


def _check_state_matches(state: dict, expected: dict, path: Path, chosen: str) -> None:
    report = mismatch_report(expected, {k: tuple(v.shape) for k, v in state.items()}, ours="model",
                             theirs="checkpoint")
    if report:
        raise ValueError(
            f"init_from={str(path)!r} does not match {chosen}:\n{report}\n"
            f"Pick the model the weights were saved from (model=...), or override its fields (model.<field>=...)."
        )


def _hydra_on() -> bool:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.initialized()


def _run_dir(config: TrainConfig) -> Path:
    if _hydra_on():
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    path = Path(config.output_root) / config.name / time.strftime("%Y-%m-%d_%H-%M-%S")
    from lightning.fabric.utilities.rank_zero import _get_rank

    if _get_rank() is not None:
        return path  # a process a launcher started (see lightning_vescale.recipe.run_dir)
    from lightning_vescale.recipe.run_dir import claim_new_folder

    return claim_new_folder(path, may_rename=True)


def _limit_cpu_threads(config: TrainConfig) -> None:
    """One process per device on CPU: give each ``cpu_count // processes`` intra-op threads.

    Lightning sets ``OMP_NUM_THREADS`` only after its launcher has started the other processes, which then
    start with a thread pool per core whose spinning workers starve the other ranks on a small machine. Set
    here, before the launch, the children inherit it. A user's ``OMP_NUM_THREADS`` is kept.
    """
    if config.trainer.accelerator != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // (world_size_of(config) // config.trainer.num_nodes))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def _loggers(run_dir: Path) -> list[Logger]:
    from lightning.pytorch.loggers import CSVLogger
    from lightning_utilities.core.imports import RequirementCache

    loggers: list[Logger] = [CSVLogger(run_dir, name="csv", version="")]
    if RequirementCache("tensorboard") or RequirementCache("tensorboardX"):
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(run_dir, name="tb", version=""))
    return loggers


def _tidy_lightning_output() -> None:
    """Each Lightning message once, in the run's log format, and none of its noise.

    Lightning, imported after Hydra configured logging (the recipes import it only once the config is checked),
    keeps a console handler of its own on the ``lightning`` logger and also propagates to the root's: drop its
    own, so a message prints once and is kept in the run's log file. Lightning's advertisement for its cloud
    logger and the deprecation warning its ``_pytree`` raises on torch 2.13 print on every run, about nothing the
    user can change: dropped.
    """
    if logging.getLogger().hasHandlers():
        lightning_log = logging.getLogger("lightning")
        for handler in list(lightning_log.handlers):
            lightning_log.removeHandler(handler)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
    rank_zero_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoLitLoggerTip) for f in rank_zero_log.filters):
        rank_zero_log.addFilter(_NoLitLoggerTip())


class _NoLitLoggerTip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in str(record.msg)


def _quiet_other_ranks(rank: int) -> None:
    """Print warnings once: ranks other than zero drop Python warnings and this package's and Lightning's log
    records below ERROR (every rank would repeat rank zero's)."""
    if rank != 0:
        warnings.simplefilter("ignore")
        logging.getLogger("lightning_vescale").setLevel(logging.ERROR)
        for name in ("lightning", "lightning.fabric", "lightning.pytorch"):  # each sets its own level
            logging.getLogger(name).setLevel(logging.ERROR)


def _hf_model_type(config: TrainConfig, resume: Optional[Resume]) -> Optional[str]:
    """The Hugging Face model_type the weights came from (what an export writes by default), if any."""
    if isinstance(config.model, CheckpointModelConfig):
        return config.model.hf_model_type
    if isinstance(config, FinetuneConfig):
        path = _absolute(config.init_from)
        if path.is_dir() and (path / "config.json").is_file():
            return read_pretrained_config(path)[1]
    if resume is not None and resume.run_dir is not None:
        try:
            return read_run_model(resume.run_dir)[1]
        except (OSError, ValueError):
            return None
    return None


def _tokenizer_source(config: TrainConfig, resume: Optional[Resume]) -> Optional[Path]:
    """Where the tokenizer files of the starting weights are: a Hugging Face ``init_from`` or an earlier run."""
    if isinstance(config, FinetuneConfig) and resume is None:
        return tokenizer_source_of(_absolute(config.init_from))
    if resume is not None and resume.run_dir is not None:
        return resume.run_dir / TOKENIZER_DIR
    return None


def _record_run(config: TrainConfig, run_dir: Path, resume: Optional[Resume]) -> None:
    """``model.json`` and the tokenizer files: what an export of this run needs, whatever moves later."""
    write_run_model(run_dir, config.model.build_config(), _hf_model_type(config, resume))
    source = _tokenizer_source(config, resume)
    if source is not None and source.is_dir():
        copy_tokenizer_files(source, run_dir / TOKENIZER_DIR)


def _absolute(path: Union[str, Path]) -> Path:
    return Path(hydra.utils.to_absolute_path(str(path)) if _hydra_on() else path)


def trainer_precision(strategy: Strategy, precision: str) -> dict[str, Any]:
    """The Trainer arguments for ``precision`` under ``strategy``.

    Under ``VeScaleStrategy`` the engine's precision plugin is passed directly: given ``precision="bf16-mixed"``,
    Lightning would announce "Automatic Mixed Precision (AMP)", which the engine does not use.
    """
    from lightning_vescale.lightning import VeScalePrecision, VeScaleStrategy

    if isinstance(strategy, VeScaleStrategy):
        return {"plugins": [VeScalePrecision(precision)]}
    return {"precision": precision}


def precision_line(strategy: Strategy, precision: str) -> str:
    """What ``precision`` runs as under ``strategy``, for the start-up log."""
    from lightning_vescale.lightning import VeScaleStrategy
    from lightning_vescale.parallel.spmd import describe_precision

    if isinstance(strategy, VeScaleStrategy):
        return f"{precision} ({describe_precision(precision)})"
    if precision == "bf16-mixed":
        return f"{precision} (Lightning's autocast: bf16 compute, fp32 weights and gradients)"
    return precision


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

    _tidy_lightning_output()
    _quiet_other_ranks(_get_rank() or 0)
    checked = preflight(cfg, run_dir=_run_dir_if_known())
    config, resume = checked.config, checked.resume
    _limit_cpu_threads(config)
    run_dir = _run_dir(config)
    if config.mpmd is not None:
        from lightning_vescale.recipe.mpmd_run import run_mpmd

        return run_mpmd(config, run_dir)
    datamodule = build_datamodule(config.data, seed=config.seed)
    ckpt_path = str(resume.checkpoint) if resume is not None else None
    init_state = None
    if isinstance(config, FinetuneConfig) and ckpt_path is None:
        init_state = load_initial_weights(_absolute(config.init_from), config.model, quant=config.quant,
                                          allow_unverified=config.allow_unverified)
    if (_get_rank() or 0) == 0:
        _record_run(config, run_dir, resume)
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
        callbacks.append(AdapterExport(run_dir, config.model.build_config(), _hf_model_type(config, resume),
                                       merged=export, base_model_name_or_path=str(_absolute(config.init_from))))
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
        enable_model_summary=False, callbacks=callbacks, logger=_loggers(run_dir), default_root_dir=run_dir,
    )
    _quiet_other_ranks(trainer.global_rank)
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


def _run_dir_if_known() -> Optional[Path]:
    if not _hydra_on():
        return None
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)

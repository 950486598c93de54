"""Training recipes: typed Hydra configs, the causal-LM LightningModule, callbacks, and :func:`run`.

``recipes/train.py`` and ``recipes/finetune.py`` are thin ``@hydra.main`` apps around :func:`run`::

    python recipes/train.py                                   # llama_tiny, embedded corpus, vescale, 2 CPUs
    python recipes/train.py model=moe_tiny optimizer=muon trainer.max_steps=500
    python recipes/train.py experiment=fsdp2_baseline          # the same run on torch FSDP2
    python recipes/train.py resume=true                        # continue the newest run of this name
    python recipes/finetune.py init_from=/path/to/hf_checkpoint_dir model=llama_tiny

A run writes to ``{output_root}/{name}/{timestamp}/``: ``.hydra/`` (the composed config),
``checkpoints/`` (``step-000100.ckpt``..., ``last.ckpt``), ``csv/metrics.csv`` (and ``tb/`` when
TensorBoard is installed), ``loss_curve.png`` and ``summary.json``.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

import hydra.utils
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.strategies import Strategy
from lightning_utilities.core.imports import RequirementCache
from omegaconf import DictConfig, OmegaConf

from lightning_vescale.data import TextDataModule
from lightning_vescale.models import from_pretrained, num_params
from lightning_vescale.recipe.callbacks import (
    RecipeProgressBar,
    RunSummary,
    StepCheckpoint,
    StepStats,
)
from lightning_vescale.recipe.module import (
    CausalLMModule,
    build_optimizer_from_config,
    lr_multiplier,
)
from lightning_vescale.recipe.schema import (
    DataConfig,
    FinetuneConfig,
    ModelConfig,
    ModelParallelStrategyConfig,
    MuonConfig,
    TrainConfig,
    register_configs,
    validate,
)
from lightning_vescale.state_dict_report import mismatch_report

__all__ = [
    "CausalLMModule",
    "FinetuneConfig",
    "TrainConfig",
    "build_datamodule",
    "build_optimizer_from_config",
    "build_strategy",
    "find_last_checkpoint",
    "load_initial_weights",
    "lr_multiplier",
    "register_configs",
    "run",
    "validate",
]

logger = logging.getLogger(__name__)

_TENSORBOARD = RequirementCache("tensorboard") or RequirementCache("tensorboardX")
# Architecture fields that do not change the weights' meaning (sizes of RoPE tables, init, derivations).
_ARCH_FIELDS_IGNORED = {"init_std", "max_seq_len", "multiple_of", "ffn_dim_multiplier"}


def build_datamodule(data: DataConfig) -> TextDataModule:
    """The data module ``data`` describes (a relative ``path`` is taken from the launch directory)."""
    path = None if data.path is None else hydra.utils.to_absolute_path(data.path) if _hydra_on() else data.path
    return TextDataModule(
        path, tokenizer=data.tokenizer, bpe_vocab_size=data.bpe_vocab_size, seq_len=data.seq_len,
        batch_size=data.batch_size, val_fraction=data.val_fraction, stride=data.stride, num_workers=data.num_workers,
    )


def build_strategy(config: TrainConfig) -> Strategy:
    """Instantiate ``config.strategy`` (``_target_`` plus its arguments)."""
    node = OmegaConf.to_container(OmegaConf.structured(config.strategy), resolve=True)
    if isinstance(config.optimizer, MuonConfig) and "granularity" in node and node["granularity"] is None:
        node["granularity"] = "muon"  # keep Muon's matrices whole on their owner rank
    if isinstance(config.strategy, ModelParallelStrategyConfig) and node["data_parallel_size"] is None:
        node["data_parallel_size"] = _processes_per_node(config) * config.trainer.num_nodes
    timeout = node.pop("timeout", None)  # seconds; Lightning's strategies take a timedelta, null: their default
    if timeout is not None:
        node["timeout"] = timedelta(seconds=timeout)
    return hydra.utils.instantiate(node, _convert_="all")


def _processes_per_node(config: TrainConfig) -> int:
    devices, accelerator = config.trainer.devices, config.trainer.accelerator
    if isinstance(devices, int):
        return devices
    if isinstance(devices, list):
        return len(devices)
    # "auto": every GPU when there are GPUs to use, else one process (Lightning's choice).
    if accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1


def find_last_checkpoint(output_root: Union[str, Path], name: str, run_dir: Optional[Path] = None) -> Optional[Path]:
    """The newest ``checkpoints/last.ckpt`` of runs named ``name`` (in ``run_dir`` or under ``output_root/name``)."""
    candidates = set(glob.glob(os.path.join(str(output_root), name, "*", "checkpoints", "last.ckpt")))
    if run_dir is not None:
        candidates.add(str(run_dir / "checkpoints" / "last.ckpt"))
    existing = [Path(c) for c in candidates if os.path.exists(c)]  # exists() follows the last.ckpt link
    if not existing:
        return None
    return max(existing, key=lambda p: os.path.getmtime(p))


def load_initial_weights(init_from: Union[str, Path], model: ModelConfig) -> dict[str, torch.Tensor]:
    """The full state dict a fine-tuning run starts from, checked against the chosen ``model``.

    ``init_from`` is one of:

    * a Hugging Face checkpoint directory (``config.json`` + safetensors; loaded with
      :func:`lightning_vescale.models.from_pretrained`);
    * a state-dict file (``.safetensors``, or a ``torch.save`` of a ``state_dict``; a Lightning
      checkpoint file's ``state_dict`` is accepted too);
    * a sharded checkpoint directory a recipe run saved (``checkpoints/step-*.ckpt`` of the vescale or
      fsdp2 strategy): only the model's tensors are read, in this one process, whatever world size saved it.

    Raises:
        FileNotFoundError: the path does not exist, or a directory lacks ``config.json``.
        ValueError: the checkpoint's architecture or tensors do not match ``model``; the message lists the
            differing fields (or names and shapes) and how to pick the matching model.
    """
    path = Path(init_from)
    arch = model.build_config()
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in model.build_model().state_dict().items()}
    chosen = f"model={model.family}_{model.preset}" + (f" with {model.overrides()}" if model.overrides() else "")
    if path.is_dir() and (path / ".metadata").is_file():
        state = _read_sharded_checkpoint(path)
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"init_from={str(path)!r} is a directory without config.json (found: "
                f"{sorted(p.name for p in path.iterdir())[:10]}). Fine-tuning starts from a Hugging Face checkpoint "
                f"directory, a full state-dict file or a recipe's sharded checkpoint directory (with .metadata)."
            )
        hf_model, hf_arch = from_pretrained(path)
        _check_same_architecture(hf_arch, arch, path, chosen)
        state = hf_model.state_dict()
    elif path.is_file():
        state = _read_state_dict_file(path)
    else:
        raise FileNotFoundError(f"init_from={str(path)!r} does not exist (resolved to {str(path.resolve())!r})")
    _check_state_matches(state, expected, path, chosen)
    return state


def _check_same_architecture(theirs: Any, ours: Any, path: Path, chosen: str) -> None:
    if type(theirs) is not type(ours):
        raise ValueError(
            f"init_from={str(path)!r} holds a {type(theirs).__name__.replace('Config', '')} model but {chosen} is a "
            f"{type(ours).__name__.replace('Config', '')}; pick a model of the checkpoint's family "
            f"(model=llama_... or model=moe_...)"
        )
    diffs = []
    for f in dataclasses.fields(ours):
        if f.name in _ARCH_FIELDS_IGNORED:
            continue
        a, b = getattr(theirs, f.name), getattr(ours, f.name)
        if a != b:
            diffs.append(f"{f.name}: checkpoint {a!r}, {chosen.split(' with ')[0]} {b!r}")
    if diffs:
        fix = " ".join(f"model.{d.split(':')[0]}={getattr(theirs, d.split(':')[0])!r}" for d in diffs[:4])
        raise ValueError(
            f"init_from={str(path)!r} does not match {chosen}:\n  " + "\n  ".join(diffs)
            + f"\nPick the preset the checkpoint was made from, or override the fields (e.g. {fix})."
        )


def _read_state_dict_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state: Any = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):  # a Lightning checkpoint
        state = {k.removeprefix("model."): v for k, v in state["state_dict"].items()}
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(
            f"init_from={str(path)!r} is not a state dict (a mapping of names to tensors); export one with "
            f"torch.save(model.state_dict(), path) or lightning_vescale.checkpoint.save_full"
        )
    return state


def _read_sharded_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP checkpoint directory, read whole in this process (no process group, nothing
    unpickled, checksums verified where the checkpoint has them)."""
    from lightning_vescale.checkpoint import read_full_tensors

    # VeScaleStrategy stores "model.<module fqn>", ModelParallelStrategy "state_dict.<module fqn>"; the
    # LightningModule holds the network as ``self.model``.
    for prefix in ("model.model.", "state_dict.model."):
        state = read_full_tensors(path, prefix=prefix)
        if state:
            return {k[len(prefix):]: v for k, v in state.items()}
    raise ValueError(
        f"init_from={str(path)!r} is a sharded checkpoint without the recipe model's tensors (no keys "
        f"'model.model.*' or 'state_dict.model.*')"
    )


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
    return Path(config.output_root) / config.name / time.strftime("%Y-%m-%d_%H-%M-%S")


def _resolve_ckpt_path(config: TrainConfig, run_dir: Path) -> Optional[str]:
    if config.ckpt_path:
        path = Path(hydra.utils.to_absolute_path(config.ckpt_path) if _hydra_on() else config.ckpt_path)
        if not path.exists():
            raise FileNotFoundError(f"ckpt_path={config.ckpt_path!r} does not exist (resolved to {str(path)!r})")
        return str(path)
    if not config.resume:
        return None
    root = hydra.utils.to_absolute_path(config.output_root) if _hydra_on() else config.output_root
    found = find_last_checkpoint(root, config.name, run_dir)
    if found is None:
        raise FileNotFoundError(
            f"resume=true found no checkpoint: no last.ckpt in {str(run_dir / 'checkpoints')!r} or under "
            f"{os.path.join(str(root), config.name, '*', 'checkpoints')!r}. Start without resume, or pass ckpt_path=..."
        )
    return str(found)


def _limit_cpu_threads(config: TrainConfig) -> None:
    """One process per device on CPU: give each ``cpu_count // processes`` intra-op threads.

    Lightning sets ``OMP_NUM_THREADS`` only after its launcher has started the other processes, which then
    start with a thread pool per core whose spinning workers starve the other ranks on a small machine. Set
    here, before the launch, the children inherit it. A user's ``OMP_NUM_THREADS`` is kept.
    """
    if config.trainer.accelerator != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // _processes_per_node(config))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def _loggers(run_dir: Path) -> list[Logger]:
    loggers: list[Logger] = [CSVLogger(run_dir, name="csv", version="")]
    if _TENSORBOARD:
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(run_dir, name="tb", version=""))
    return loggers


def run(cfg: Union[DictConfig, TrainConfig]) -> Optional[dict[str, Any]]:
    """Validate ``cfg`` and train with the Lightning Trainer; returns the run summary.

    Every check that can fail on the config happens before any process group or model exists: the schema,
    the data path, the initial weights of a fine-tuning run and the checkpoint to resume from.
    """
    config = validate(cfg)
    _limit_cpu_threads(config)
    run_dir = _run_dir(config)
    datamodule = build_datamodule(config.data)
    ckpt_path = _resolve_ckpt_path(config, run_dir)
    init_state = None
    if isinstance(config, FinetuneConfig) and ckpt_path is None:
        init_from = hydra.utils.to_absolute_path(config.init_from) if _hydra_on() else config.init_from
        init_state = load_initial_weights(init_from, config.model)
    seed_everything(config.seed, workers=True, verbose=False)
    strategy = build_strategy(config)

    t = config.trainer
    module = CausalLMModule(
        config.model, config.optimizer, config.scheduler, max_steps=t.max_steps,
        expert_bias_rate=config.expert_bias_rate, init_state_dict=init_state,
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
    }
    summary = RunSummary(stats, run_dir, extra=extra)
    callbacks: list[Any] = [stats, summary]
    if t.enable_progress_bar:
        callbacks.append(RecipeProgressBar())
    if t.checkpoint_every_n_steps > 0:
        callbacks.append(
            StepCheckpoint(
                dirpath=run_dir / "checkpoints", filename="step-{step:06d}", auto_insert_metric_name=False,
                every_n_train_steps=t.checkpoint_every_n_steps, save_top_k=t.checkpoint_keep, save_last="link",
                enable_version_counter=False,
            )
        )
    trainer = Trainer(
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, precision=t.precision,
        strategy=strategy, max_steps=t.max_steps, max_epochs=-1,
        accumulate_grad_batches=t.accumulate_grad_batches, gradient_clip_val=t.gradient_clip_val,
        val_check_interval=t.val_every_n_steps * t.accumulate_grad_batches, check_val_every_n_epoch=None,
        limit_val_batches=t.limit_val_batches, log_every_n_steps=t.log_every_n_steps,
        num_sanity_val_steps=t.num_sanity_val_steps, deterministic=t.deterministic,
        enable_progress_bar=t.enable_progress_bar, enable_checkpointing=t.checkpoint_every_n_steps > 0,
        enable_model_summary=False, callbacks=callbacks, logger=_loggers(run_dir), default_root_dir=run_dir,
    )
    if trainer.is_global_zero:
        logger.info(
            "training %s (%.2fM parameters) with %s on %d process(es), precision %s; %s; writing to %s",
            extra["model"], total_params / 1e6, extra["strategy"], trainer.world_size, t.precision,
            f"resuming from {ckpt_path}" if ckpt_path else "from scratch" if init_state is None else
            f"from {extra['init_from']}", run_dir,
        )
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return summary.summary

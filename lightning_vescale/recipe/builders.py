"""What a recipe config builds: the data module, the Lightning strategy, the Trainer's precision arguments, and the
CPU threads of each process. Lightning is imported inside the functions (see [Note: Lightning is imported where it is
used] in :mod:`lightning_vescale.recipe`)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import hydra.utils
import torch
from omegaconf import OmegaConf

from lightning_vescale.engine.planner import element_blocks
from lightning_vescale.recipe.memory import world_size_of
from lightning_vescale.recipe.paths import absolute
from lightning_vescale.recipe.schema import (
    AdamW8bitConfig,
    DataConfig,
    ModelParallelStrategyConfig,
    MuonConfig,
    TrainConfig,
)

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy

    from lightning_vescale.data import TextDataModule

__all__ = ["build_datamodule", "build_strategy", "limit_cpu_threads", "precision_line", "share_cpu_threads",
           "trainer_precision"]


def build_datamodule(data: DataConfig, *, seed: int = 0) -> TextDataModule:
    """The data module ``data`` describes (a relative ``path`` is taken from the launch directory); ``seed``
    orders the training windows."""
    from lightning_vescale.data import TextDataModule

    path = None if data.path is None else absolute(data.path)
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


def limit_cpu_threads(config: TrainConfig) -> None:
    """One process per device on CPU: give each ``cpu_count // processes`` intra-op threads.

    Lightning sets ``OMP_NUM_THREADS`` only after its launcher has started the other processes, which then
    start with a thread pool per core whose spinning workers starve the other ranks on a small machine. Set
    here, before the launch, the children inherit it. A user's ``OMP_NUM_THREADS`` is kept.
    """
    if config.trainer.accelerator == "cpu":
        share_cpu_threads(world_size_of(config) // config.trainer.num_nodes)


def share_cpu_threads(processes: int) -> None:
    """Give each of ``processes`` processes on this machine ``cpu_count // processes`` intra-op threads (at least
    one), in ``OMP_NUM_THREADS`` for the processes it starts and in torch; a user's ``OMP_NUM_THREADS`` is kept."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // processes)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


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

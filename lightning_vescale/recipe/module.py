"""The LightningModule of the recipes: causal language-model training of a Llama or MoE.

Shape suffixes: ``B`` batch, ``T`` sequence, ``V`` vocabulary, ``L`` MoE layers, ``E`` experts.

The model is built in :meth:`CausalLMModule.configure_model`, inside the strategy's init contexts, so a
sharding strategy never sees a full unsharded copy:

* ``VeScaleStrategy``: its ``model_sharded_context`` puts the build on the meta device (``meta_init``);
  in ``setup`` the strategy shards ``self.model`` (each block of ``model.layers`` a group, the model the
  root) and materializes the pieces with each module's ``reset_parameters`` (rank 0's RNG, so the values
  equal an unsharded init with the same seed).
* Lightning's ``ModelParallelStrategy``: this module builds on the meta device and applies FSDP2 itself
  (each block, then the root), as Lightning asks of user code; the strategy materializes in ``setup``.
* Any other strategy (DDP, single device): the model is built for real.

[Note: MoE balancing under Lightning]
``lightning_vescale.parallel.register_expert_bias_update`` runs the bias update as an optimizer *pre-step*
hook. Lightning's automatic optimization calls ``optimizer.step(closure)`` and runs forward and backward
*inside* the closure, i.e. after the pre-step hooks, so such a hook would see the previous step's counts.
This module does the same update (sum the routers' ``tokens_per_expert`` over the data-parallel ranks,
then ``update_expert_bias``) in :meth:`on_before_optimizer_step`, which Lightning calls after the
closure of the last micro-batch and before the parameters change: the counts are exactly this step's.
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from typing import Any, Mapping, Optional, Union, cast

import hydra.utils
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import nn

from lightning_vescale.models.moe import MoE, TopKRouter
from lightning_vescale.recipe.schema import (
    ModelConfig,
    OptimizerConfig,
    QuantConfig,
    SchedulerConfig,
)
from lightning_vescale.state_dict.dtype_kinds import check_dtype_kinds

__all__ = ["CausalLMModule", "build_optimizer_from_config", "load_full_state_dict_into", "lr_multiplier"]

logger = logging.getLogger(__name__)


def lr_multiplier(step: int, *, warmup_steps: int, max_steps: int, decay: str, min_lr_ratio: float) -> float:
    """Learning-rate factor at optimizer step ``step``: linear warmup, then ``decay`` down to ``min_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if decay == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_optimizer_from_config(
    config: Union[OptimizerConfig, Mapping[str, Any]], model: nn.Module
) -> torch.optim.Optimizer:
    """Instantiate the optimizer ``config`` describes for ``model``.

    A ``_target_`` that is a ``torch.optim.Optimizer`` subclass gets ``model.parameters()``; any other
    callable gets ``model`` (a factory such as ``lightning_vescale.optim.build_optimizer`` that routes
    parameters by name and shape).

    Raises:
        ImportError: the target cannot be imported; the message names it and the optimizer options.
    """
    node = dict(config) if isinstance(config, Mapping) else {k: getattr(config, k) for k in config.__dataclass_fields__}
    # Through instantiate (never get_object + call), so Hydra's blocklist of dangerous targets applies.
    extra = {"betas": tuple(node.pop("betas"))} if "betas" in node else {}
    try:
        factory = hydra.utils.instantiate(node, _partial_=True, _convert_="all")
    except Exception as err:  # hydra wraps ImportError / AttributeError in its own exception types
        raise ImportError(
            f"optimizer._target_={node['_target_']!r} cannot be built ({err.__class__.__name__}: {err}); "
            "fix the path or pick another optimizer, e.g. optimizer=adamw"
        ) from err
    if isinstance(factory.func, type) and issubclass(factory.func, torch.optim.Optimizer):
        return factory(model.parameters(), **extra)
    return factory(model, **extra)


class CausalLMModule(LightningModule):
    """Next-token prediction with a :class:`~lightning_vescale.models.Llama` or :class:`~lightning_vescale.models.MoE`.

    Args:
        model: which model (preset plus overrides); built in :meth:`configure_model`.
        optimizer: the optimizer config (``_target_`` plus kwargs).
        scheduler: the learning-rate schedule.
        max_steps: optimizer steps of the run (the schedule's end).
        expert_bias_rate: MoE auxiliary-loss-free balancing step; 0 disables.
        init_state_dict: a full (unsharded) state dict to start from (fine-tuning); loaded in
            :meth:`on_fit_start`, after the strategy has sharded and materialized the model.
        quant: block-quantized weights (:mod:`lightning_vescale.recipe.quant`): LoRA adapters over a frozen
            quantized base (``qlora``; ``init_state_dict`` is then the base's), or a quantized AllGather.

    The training loss (``loss``, averaged over ranks) and ``lr`` go to the progress bar and loggers,
    ``val_loss`` after each validation. Every row is logged at ``step`` = the number of optimizer steps done
    (1 for the first step's loss, as in ``summary.json`` and the checkpoint names; Lightning would write the
    0-based batch count); MoE models also log ``moe/layer{i}/expert{e}``, each expert's share
    of the routed tokens in the step, and ``moe/max_load`` (the busiest expert's share over the mean).
    """

    def __init__(
        self,
        model: ModelConfig,
        optimizer: OptimizerConfig,
        scheduler: SchedulerConfig,
        *,
        max_steps: int,
        expert_bias_rate: float = 1e-3,
        init_state_dict: Optional[Mapping[str, torch.Tensor]] = None,
        quant: Optional[QuantConfig] = None,
    ) -> None:
        super().__init__()
        self.quant = quant
        self.model_config = model
        self.optimizer_config = optimizer
        self.scheduler_config = scheduler
        self.max_steps = max_steps
        self.expert_bias_rate = expert_bias_rate
        self._init_state_dict = init_state_dict
        self.model: Optional[nn.Module] = None
        self.last_loss: Optional[torch.Tensor] = None
        self.save_hyperparameters(
            {
                "model": {"family": model.family, "preset": model.preset, **model.overrides()},
                "optimizer": {k: getattr(optimizer, k) for k in optimizer.__dataclass_fields__},
                "scheduler": {k: getattr(scheduler, k) for k in scheduler.__dataclass_fields__},
                "max_steps": max_steps,
                "expert_bias_rate": expert_bias_rate,
                **({"quant": {k: getattr(quant, k) for k in quant.__dataclass_fields__}} if quant else {}),
            }
        )

    # ------------------------------------------------------------------------------------------------
    # Model

    def configure_model(self) -> None:
        if self.model is not None:
            return  # Lightning may call this hook again (e.g. validate after fit)
        fsdp2 = isinstance(self.trainer.strategy, ModelParallelStrategy)
        # VeScaleStrategy opens its own meta-device context around this hook; ModelParallelStrategy does not.
        with torch.device("meta") if fsdp2 else nullcontext():
            model = self.model_config.build_model()
            if self.quant is not None:
                from lightning_vescale.recipe.quant import apply_quantization

                apply_quantization(model, self.quant)  # adapters / declarations before the strategy shards
        if fsdp2:
            _apply_fsdp2(model, self.device_mesh)
        self.model = model

    @property
    def is_moe(self) -> bool:
        return isinstance(self.model, MoE)

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        assert self.model is not None  # built by configure_model
        return self.model(tokens_BT)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs_BT, targets_BT = batch
        assert self.model is not None
        logits_BTV = self.model(inputs_BT)
        loss = F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten())
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.last_loss = loss.detach()
        # Lightning takes a logged "step" as the row's step: the step this loss belongs to, counted from 1.
        self.log("step", float(self.global_step + 1), on_step=True, on_epoch=False)
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        if isinstance(self.model, MoE) and self.model.config.aux_loss_coef > 0:  # self.is_moe
            aux = self.model.aux_loss()
            self.log("aux_loss", aux)
            loss = loss + aux
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("step", float(self.global_step), on_step=False, on_epoch=True, sync_dist=True)  # after that many steps
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    # ------------------------------------------------------------------------------------------------
    # Optimization

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        assert self.model is not None
        optimizer = build_optimizer_from_config(self.optimizer_config, self.model)
        s = self.scheduler_config
        if s.warmup_steps >= self.max_steps:
            logger.warning(
                "scheduler.warmup_steps=%d >= trainer.max_steps=%d: the run ends inside warmup and the decay "
                "(%s) has no effect", s.warmup_steps, self.max_steps, s.decay,
            )

        def multiplier(step: int) -> float:
            return lr_multiplier(
                step, warmup_steps=s.warmup_steps, max_steps=self.max_steps, decay=s.decay,
                min_lr_ratio=s.min_lr_ratio,
            )

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log("lr", optimizer.param_groups[0]["lr"])
        if self.is_moe:
            self._balance_experts()

    @torch.no_grad()
    def _balance_experts(self) -> None:
        assert self.model is not None
        routers = [m for m in self.model.modules() if isinstance(m, TopKRouter)]
        counts_LE = torch.stack([r.tokens_per_expert for r in routers]).to(torch.float64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts_LE)
        share_LE = counts_LE / counts_LE.sum(dim=1, keepdim=True).clamp(min=1)
        for layer, share_E in enumerate(share_LE):
            for expert, share in enumerate(share_E.tolist()):
                self.log(f"moe/layer{layer}/expert{expert}", share, rank_zero_only=True)
        mean_E = counts_LE.mean(dim=1).clamp(min=1)
        self.log("moe/max_load", (counts_LE.max(dim=1).values / mean_E).max().item(), rank_zero_only=True)
        if self.expert_bias_rate > 0:
            for router, counts_E in zip(routers, counts_LE):
                router.tokens_per_expert.copy_(counts_E.to(router.tokens_per_expert.dtype))
                router.update_expert_bias(self.expert_bias_rate)
        else:
            for router in routers:
                router.tokens_per_expert.zero_()

    # ------------------------------------------------------------------------------------------------
    # Starting from given weights

    def on_fit_start(self) -> None:
        if self._init_state_dict is None:
            return
        assert self.model is not None
        if self.quant is not None and self.quant.mode == "qlora":
            from lightning_vescale.quant.lora import load_base_state_dict

            load_base_state_dict(self.model, dict(self._init_state_dict))  # the base under its adapters
        else:
            load_full_state_dict_into(self.model, self._init_state_dict)
        self._init_state_dict = None
        logger.info("loaded the initial weights into the %s model", type(self.model).__name__)


def load_full_state_dict_into(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy a full (unsharded) state dict into ``model``, whichever way it is sharded.

    A ``lightning_vescale`` sharded model goes through ``lightning_vescale.checkpoint.load_full_state_dict``, FSDP2
    (DTensor parameters) through ``torch.distributed.checkpoint.state_dict.set_model_state_dict``, and a plain or DDP
    model through ``load_state_dict`` (strict).
    """
    from torch.distributed.tensor import DTensor

    from lightning_vescale.engine.fully_shard import get_state

    check_dtype_kinds(model, state_dict, what="initial state dict")
    if any(get_state(m) is not None for m in model.modules()):
        # Each rank copies its pieces straight from the full tensors (torch's helper would scatter even Shard(0)
        # chunks and gather them again).
        from lightning_vescale.checkpoint import load_full_state_dict

        load_full_state_dict(model, state_dict)
        return
    if any(isinstance(p, DTensor) for p in model.parameters()):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        set_model_state_dict(model, dict(state_dict), options=StateDictOptions(full_state_dict=True, strict=True))
        return
    model.load_state_dict(state_dict, strict=True)


def _apply_fsdp2(model: nn.Module, device_mesh: Any) -> None:
    """FSDP2 as torchtitan applies it: each transformer block, then the root."""
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    mesh = device_mesh["data_parallel"] if device_mesh.ndim > 1 else device_mesh
    for block in cast(nn.ModuleList, model.layers):
        fsdp2_fully_shard(block, mesh=mesh)
    fsdp2_fully_shard(model, mesh=mesh)

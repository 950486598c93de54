"""Hugging Face Accelerate adapter: the engine's ZeRO-3 sharding in an ordinary Accelerate loop.

Accelerate has no plug-in point for a new engine (``DistributedType`` is a closed enum, and
``accelerate launch`` rejects unknown config keys), so the adapter is a thin :class:`VeScaleAccelerator`
subclass configured from Python with :class:`VeScaleConfig`:

* ``prepare(model, optimizer, dataloader, scheduler)`` shards the model itself (blocks, then the model as
  the root), points the optimizer at the local pieces and marks the model ``_is_accelerate_prepared``,
  so Accelerate leaves the model alone while still wrapping optimizers, schedulers and dataloaders;
* ``accumulate(model)`` uses the sharded model's ``no_sync()``: no ReduceScatter on non-final micro-batches;
* ``clip_grad_norm_`` clips by the true global norm (Accelerate's own would use each rank's pieces only);
* ``save_state`` / ``load_state`` write and read the model and optimizer as a sharded checkpoint
  (``lightning_vescale.checkpoint``) on every rank — Accelerate would write the optimizer from the main
  process only — and leave schedulers, samplers, RNG and custom objects to Accelerate;
* ``get_state_dict`` (and so ``save_model``) gathers the full state dict onto the main process.

Launch with ``torchrun`` or ``accelerate launch`` as usual (``--cpu`` / ``Accelerator(cpu=True)`` on CPU).
``mixed_precision="bf16"`` maps to the engine's bf16 mixed precision (no autocast).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal, Optional, Protocol, Union, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

from lightning_vescale.engine.fully_shard import GranularityArg
from lightning_vescale.engine.policies import MixedPrecisionPolicy
from lightning_vescale.engine.tensor import is_sharded_param
from lightning_vescale.memory import MemoryPolicy
from lightning_vescale.parallel.parallelize import AutoWrapPolicy, PlanLike, is_sharded, mp_policy_for_precision
from lightning_vescale.parallel.session import ShardingConfig, ShardingSession

__all__ = ["VeScaleAccelerator", "VeScaleConfig", "prepare_vescale"]

_SUPPORTED_TYPES = (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
_CHECKPOINT_DIR = "vescale_model_{}"


@dataclass(frozen=True)
class VeScaleConfig:
    """How :class:`VeScaleAccelerator` shards a model: a plan, or the arguments of ``fully_shard`` plus the policy."""

    plan: PlanLike = None
    """A declarative plan (:mod:`lightning_vescale.plan`): a ``Plan``, its dict form, a YAML file or the name of a
    plan in ``configs/plan/``; names are the model's. The fields below apply where it sets nothing."""
    reshard_after_forward: bool = True
    """Free gathered parameters after forward and gather again in backward (ZeRO-3)."""
    mp_policy: Optional[MixedPrecisionPolicy] = None
    """None: from ``Accelerator(mixed_precision=...)`` ("no" -> fp32, "bf16" -> bf16 compute, fp32 reduction
    and master weights). Giving one together with ``mixed_precision="bf16"`` is an error."""
    granularity: GranularityArg = None
    """Cut granularity per parameter, as ``fully_shard`` takes it."""
    auto_wrap_policy: AutoWrapPolicy = None
    """Which submodules become groups: None (each element of an ``nn.ModuleList`` of identical blocks), a set
    of module classes (or import paths), or a callable ``module -> bool``."""
    replicate_size: Union[None, int, Literal["auto"]] = None
    """None: shard over every rank. An int R: HSDP on a (R, world_size // R) (replicate, shard) mesh; ``"auto"``: one
    replica per node (``WORLD_SIZE // LOCAL_WORLD_SIZE``, as ``accelerate launch`` and ``torchrun`` set them)."""
    sync_module_states: bool = True
    """Broadcast the main process's weights before sharding, so every rank cuts the same model."""
    memory: Optional[MemoryPolicy] = None
    """Where weights, gradients, optimizer states and activations live (explicit placements, as
    ``VeScaleStrategy(memory=...)``): applied when the model is sharded and to each optimizer prepared with or
    after it. None: everything on the device."""

    sharding: ShardingConfig = field(init=False, repr=False, compare=False)
    """The fields above as the sharding engine's config, checked as the Lightning strategies check theirs."""

    def __post_init__(self) -> None:
        sharding = ShardingConfig(
            who="VeScaleConfig", plan=self.plan, auto_wrap_policy=self.auto_wrap_policy,
            reshard_after_forward=self.reshard_after_forward, mp_policy=self.mp_policy, granularity=self.granularity,
            replicate_size=self.replicate_size, sync_module_states=self.sync_module_states, memory=self.memory,
            restore_rng_states=True,  # the sharded checkpoint's RNG states; Accelerate then restores its own
        )
        sharding.check_plan_tiers()  # a plan's disk tier needs memory.disk_dir
        object.__setattr__(self, "plan", sharding.plan)  # read and checked (unknown keys and values fail above)
        object.__setattr__(self, "sharding", sharding)


def _num_nodes(num_processes: int) -> int:
    """The number of nodes of this launch (``WORLD_SIZE // LOCAL_WORLD_SIZE``; one node if unset)."""
    return max(1, num_processes // int(os.environ.get("LOCAL_WORLD_SIZE", num_processes)))


def _unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


class _SavesPretrained(Protocol):
    """A ``transformers`` model, as :meth:`VeScaleAccelerator.save_pretrained` uses it."""

    def save_pretrained(self, save_directory: str, **kwargs: Any) -> Any: ...


class VeScaleAccelerator(Accelerator):
    """An ``Accelerator`` whose ``prepare`` shards the model with ``lightning_vescale.fully_shard``.

    Args:
        *args, **kwargs: as ``accelerate.Accelerator``; ``mixed_precision`` may be ``"no"`` or ``"bf16"``.
            Launched with several processes on a machine without CUDA, ``cpu`` defaults to True.
        vescale: how to shard (:class:`VeScaleConfig`); defaults to ZeRO-3 over every rank.

    In a single process (``DistributedType.NO``) nothing is sharded and it behaves like ``Accelerator``.
    """

    # Accelerate's own lists (created untyped in its __init__): the prepared models and optimizers.
    _models: list[nn.Module]
    _optimizers: list[Any]

    def __init__(self, *args: Any, vescale: Optional[VeScaleConfig] = None, **kwargs: Any) -> None:
        if "cpu" not in kwargs and not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # Under torchrun on a CPU-only machine a plain Accelerator() silently runs each rank alone.
            kwargs["cpu"] = True
        super().__init__(*args, **kwargs)
        self.vescale_config = vescale or VeScaleConfig()
        self._session = ShardingSession(self.vescale_config.sharding)
        if not self._vescale_active:
            if dist.is_initialized() and dist.get_world_size() > 1:
                raise RuntimeError(
                    f"VeScaleAccelerator runs in a process group of {dist.get_world_size()} ranks, but Accelerate "
                    f"chose DistributedType.{self.distributed_type.name}: on CPU pass Accelerator(cpu=True) or "
                    f"launch with `accelerate launch --cpu`"
                )
            return
        if self.distributed_type not in _SUPPORTED_TYPES:
            raise ValueError(
                f"VeScaleAccelerator shards the model itself and runs on DistributedType MULTI_CPU or MULTI_GPU, got "
                f"{self.distributed_type.name}: launch without an FSDP/DeepSpeed/Megatron plugin or config"
            )
        if self.mixed_precision not in ("no", "bf16"):
            raise ValueError(
                f"VeScaleAccelerator supports mixed_precision='no' or 'bf16', got {self.mixed_precision!r} "
                f"(fp16 needs a gradient scaler and fp8 a different engine path)"
            )
        if self.vescale_config.mp_policy is not None and self.mixed_precision != "no":
            raise ValueError(
                f"VeScaleConfig.mp_policy={self.vescale_config.mp_policy} and mixed_precision="
                f"{self.mixed_precision!r} both set the precision: choose one"
            )

    @property
    def sharding_session(self) -> ShardingSession:
        """The engine object this adapter delegates to (plan, mesh, sharding, memory, checkpoints), as the Lightning
        strategies do."""
        return self._session

    @property
    def _vescale_active(self) -> bool:
        return self.distributed_type != DistributedType.NO

    # -- sharding -----------------------------------------------------------------------------------------
    def shard_model(self, model: nn.Module) -> nn.Module:
        """Shard ``model`` in place (blocks, then the model as the root), materialize meta weights and mark it
        prepared. ``prepare`` calls this; call it yourself to build the optimizer after sharding."""
        if not self._vescale_active or getattr(model, "_is_accelerate_prepared", False):
            return model
        session = self._session
        if session.needs_sharding(model):
            # No timeout, as before: the groups the mesh creates keep torch's default.
            session.build_mesh(self.device, self.num_processes, num_nodes=_num_nodes(self.num_processes))
        session.shard(model, mp_policy=mp_policy_for_precision("bf16-mixed" if self.mixed_precision == "bf16" else "32-true"))
        # Accelerate's prepare() now leaves the model alone (no DDP wrapper, no autocast) and still
        # registers it, so accumulate() finds its no_sync().
        model._is_accelerate_prepared = True  # type: ignore[assignment]  # nn.Module's stub takes tensors and modules only
        if model not in self._models:
            self._models.append(model)
        # The policy's placement and the plan's tiers (with neither, nothing moves).
        session.place_memory(model, rank=self.process_index)
        return model

    def prepare(self, *args: Any, device_placement: Optional[list] = None) -> Any:
        if not self._vescale_active:
            return super().prepare(*args, device_placement=device_placement)
        models = [a for a in args if isinstance(a, nn.Module) and not getattr(a, "_is_accelerate_prepared", False)]
        if len(models) > 1:
            raise ValueError(
                f"VeScaleAccelerator.prepare shards one model per call, got {len(models)}: prepare each model with "
                f"its own optimizer(s) in separate calls"
            )
        if models:
            model = models[0]
            before = dict(model.named_parameters())
            self.shard_model(model)
            self._session.remap_optimizers(model, before, [o for o in args if isinstance(o, torch.optim.Optimizer)])
        for obj in args:  # optimizers of offloaded models step bucket by bucket with their states and pieces
            if isinstance(obj, torch.optim.Optimizer):
                self._session.add_optimizer(obj)
        return super().prepare(*args, device_placement=device_placement)

    # -- training-step helpers ----------------------------------------------------------------------------
    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """Clip by the global norm of the (sharded) gradients, the same on every rank."""
        parameters = list(parameters)
        if not any(is_sharded_param(p) for p in parameters):
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        self.unscale_gradients()
        return self._session.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The full (unsharded) state dict on the main process, ``{}`` elsewhere (collective)."""
        if not is_sharded(model):
            return super().get_state_dict(model, unwrap=unwrap)
        return self._session.full_state_dict(model, rank0_only=True)

    def save_pretrained(self, model: nn.Module, save_directory: str, **kwargs: Any) -> None:
        """Write a Hugging Face directory of a prepared ``transformers`` model (collective): the gathered state
        dict, written by the main process with the model's own ``save_pretrained``. Accelerate's idiom
        ``unwrap_model(model).save_pretrained(dir, state_dict=accelerator.get_state_dict(model),
        is_main_process=accelerator.is_main_process)`` does the same."""
        if not is_sharded(model):
            if self.is_main_process:
                cast(_SavesPretrained, model).save_pretrained(save_directory, **kwargs)
            self.wait_for_everyone()
            return
        self._session.save_pretrained(model, save_directory, **kwargs)

    # -- checkpoints --------------------------------------------------------------------------------------
    def _sharded_pairs(self) -> list[tuple[nn.Module, list[AcceleratedOptimizer]]]:
        pairs = []
        for model in self._models:
            if not is_sharded(model):
                continue
            mine = {id(p) for p in model.parameters()}
            opts = [
                o for o in self._optimizers
                if any(id(p) in mine for g in _unwrap_optimizer(o).param_groups for p in g["params"])
            ]
            pairs.append((model, opts))
        return pairs

    @contextlib.contextmanager
    def _hide(self, pairs: list) -> Iterator[None]:
        """Keep Accelerate's own saving/loading away from the sharded models and their optimizers."""
        models, optimizers = self._models, self._optimizers
        hidden_models = {id(m) for m, _ in pairs}
        hidden_opts = {id(o) for _, opts in pairs for o in opts}
        self._models = [m for m in models if id(m) not in hidden_models]
        self._optimizers = [o for o in optimizers if id(o) not in hidden_opts]
        try:
            yield
        finally:
            self._models, self._optimizers = models, optimizers

    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """Accelerate's ``save_state``, with each sharded model and its optimizer saved as a sharded directory
        ``vescale_model_<i>`` in the output folder by every rank."""
        pairs = self._sharded_pairs()
        if not pairs:
            return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)

        def save_sharded(models: list, weights: list, out_dir: str) -> None:
            for i, (model, opts) in enumerate(pairs):
                path = os.path.join(out_dir, _CHECKPOINT_DIR.format(i))
                self._session.save(path, model, [_unwrap_optimizer(o) for o in opts])

        handle = self.register_save_state_pre_hook(save_sharded)
        try:
            with self._hide(pairs):
                return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        finally:
            handle.remove()

    def load_state(self, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None, **kwargs: Any) -> None:
        """Accelerate's ``load_state``, with the sharded models and optimizers read from ``vescale_model_<i>``
        (on any world size)."""
        pairs = self._sharded_pairs()
        if not pairs:
            return super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)

        def load_sharded(models: list, in_dir: str) -> None:
            for i, (model, opts) in enumerate(pairs):
                path = os.path.join(in_dir, _CHECKPOINT_DIR.format(i))
                self._session.load(path, model, [_unwrap_optimizer(o) for o in opts])

        handle = self.register_load_state_pre_hook(load_sharded)
        try:
            with self._hide(pairs):
                return super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
        finally:
            handle.remove()


def prepare_vescale(
    accelerator: VeScaleAccelerator,
    model: nn.Module,
    optimizer: Union[None, torch.optim.Optimizer, Callable[[Any], torch.optim.Optimizer]] = None,
    *others: Any,
) -> tuple:
    """Shard ``model``, build the optimizer on its local pieces, and prepare everything.

    ``optimizer`` may be an optimizer (built on the unsharded parameters, no state yet) or a factory
    ``params -> optimizer`` called after sharding (e.g. ``functools.partial(torch.optim.AdamW, lr=1e-3)``),
    which also works for meta-device models. ``others`` are dataloaders and schedulers, prepared as usual
    (a scheduler needs the optimizer, so pass a factory ``optimizer -> scheduler`` for it).

    Returns:
        ``(model, optimizer, *others)`` as ``accelerator.prepare`` returns them.
    """
    if not isinstance(accelerator, VeScaleAccelerator):
        raise TypeError(
            f"prepare_vescale needs a VeScaleAccelerator, got {type(accelerator).__name__}: a plain Accelerator "
            f"would clip by each rank's local norm and save only the main process's optimizer shard"
        )
    accelerator.shard_model(model)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model.parameters())
    resolved = [o(optimizer) if callable(o) and not _is_preparable(o) else o for o in others]
    objs = [model] + ([optimizer] if optimizer is not None else []) + resolved
    out = accelerator.prepare(*objs)
    return out if isinstance(out, tuple) else (out,)


def _is_preparable(obj: Any) -> bool:
    return isinstance(obj, (nn.Module, torch.optim.Optimizer, torch.utils.data.DataLoader, torch.optim.lr_scheduler.LRScheduler))

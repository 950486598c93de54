"""``Fabric(strategy="vescale")``: the engine's ZeRO-3 sharding behind Lightning Fabric.

``fabric.setup(model, optimizer)`` shards the model (blocks first, then the model as the root),
materializes meta-device weights and points the optimizer at the local pieces; or set up the model
first and create the optimizer from ``model.parameters()`` afterwards, as with FSDP.
``fabric.no_backward_sync(model)`` skips the ReduceScatter on accumulation steps,
``fabric.clip_gradients(model, optimizer, max_norm=...)`` clips by the true global norm and
``fabric.save`` / ``fabric.load`` write and read sharded checkpoint directories (a state holding only state dicts,
as written for DDP, is saved as one full file), and ``fabric.load`` / ``fabric.load_raw`` also read single-file
checkpoints (``torch.save`` state dicts, ``.safetensors``), each rank keeping its pieces.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import TBroadcast, _BackwardSyncControl
from lightning.fabric.utilities.distributed import (
    ReduceOp,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, _Stateful
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_vescale.engine.collectives import named_collective
from lightning_vescale.engine.fully_shard import GranularityArg
from lightning_vescale.engine.policies import MixedPrecisionPolicy
from lightning_vescale.lightning._checkpoints import load_file_into, save_as_file
from lightning_vescale.lightning._common import (
    ProcessGroupEnvironment,
    _VeScalePrecisionMixin,
    check_accelerator,
    config_field,
    precision_with_mp_policy,
    register_vescale_names,
)
from lightning_vescale.memory import MemoryPolicy
from lightning_vescale.parallel.parallelize import AutoWrapPolicy, PlanLike, is_sharded, no_gradient_sync
from lightning_vescale.parallel.session import ShardingConfig, ShardingSession, tensor_parallel_sampler_kwargs

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["VeScaleFabricPrecision", "VeScaleFabricStrategy"]

_NO_MESH = "the device mesh exists once the processes are set up (fabric.launch())"


class VeScaleFabricPrecision(_VeScalePrecisionMixin, Precision):
    """Fabric's precision plugin under ``strategy="vescale"``: the engine's mixed precision, no autocast."""

    def __init__(self, precision: str = "32-true") -> None:
        self._setup_precision(precision)

    @override
    def convert_output(self, data: Any) -> Any:
        if self._true_dtype is None:
            return data
        from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
        from lightning_utilities import apply_to_collection

        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=torch.get_default_dtype())


class _VeScaleBackwardSyncControl(_BackwardSyncControl):
    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        """Skip every ReduceScatter in this backward; gradients accumulate unsharded and local."""
        return no_gradient_sync(module, enabled)


class VeScaleFabricStrategy(ParallelStrategy):
    """ZeRO-3 sharded data parallelism on RaggedShard placements for Fabric.

    Args: as :class:`~lightning_vescale.lightning.VeScaleStrategy` (``plan``, ``auto_wrap_policy``,
    ``reshard_after_forward``, ``mp_policy``, ``granularity``, ``replicate_size``, ``tensor_parallel_size``
    (a ``("data_parallel", "tensor_parallel")`` mesh: the plan's ``tp`` rules split modules over tp, or split them
    yourself with ``parallelize_module(..., fabric.strategy.device_mesh["tensor_parallel"], ...)`` before
    ``fabric.setup``; the ranks of one tp group read the same batches), ``sync_module_states``,
    ``process_group_backend``, ``timeout``, ``memory``: where weights, gradients, optimizer states and
    activations live, applied when the model is set up and to each optimizer set up with or after it;
    ``restore_rng_states``: ``fabric.load`` of a sharded checkpoint sets every rank's RNG states to the saved ones,
    default False as Lightning's strategies). ``fabric.init_module(empty_init=True)`` builds the model on the
    meta device; ``setup_module`` initializes it piece by piece with each module's ``reset_parameters``.
    """

    strategy_name = "vescale"

    def __init__(
        self,
        *,
        plan: PlanLike = None,
        auto_wrap_policy: AutoWrapPolicy = None,
        reshard_after_forward: bool = True,
        mp_policy: Optional[MixedPrecisionPolicy] = None,
        granularity: GranularityArg = None,
        replicate_size: Union[None, int, Literal["auto"]] = None,
        tensor_parallel_size: int = 1,
        sync_module_states: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Union[None, float, timedelta] = None,
        memory: Optional[MemoryPolicy] = None,
        restore_rng_states: bool = False,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
    ) -> None:
        # Every sharding argument is checked now, before any process starts (a plan file: its keys and values).
        self._session = ShardingSession(ShardingConfig(
            who="VeScaleFabricStrategy", plan=plan, auto_wrap_policy=auto_wrap_policy,
            reshard_after_forward=reshard_after_forward, mp_policy=mp_policy, granularity=granularity,
            replicate_size=replicate_size, tensor_parallel_size=tensor_parallel_size,
            sync_module_states=sync_module_states, memory=memory, timeout=timeout,
            restore_rng_states=restore_rng_states,
        ))
        self._session.config.check_plan_tiers()  # a plan's disk tier needs memory.disk_dir
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        check_accelerator(accelerator)
        if cluster_environment is None and ProcessGroupEnvironment.detect():
            cluster_environment = ProcessGroupEnvironment()
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self._backward_sync_control = _VeScaleBackwardSyncControl()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_vescale_names(cls, strategy_registry)

    # -- plugins ------------------------------------------------------------------------------------------
    @property
    @override
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else VeScaleFabricPrecision()

    @precision.setter
    @override
    def precision(self, precision: Optional[Precision]) -> None:
        if precision is None:
            self._precision = None
            return
        name = precision_with_mp_policy(precision, self._session.config.mp_policy, "VeScaleFabricStrategy")
        self._precision = precision if isinstance(precision, VeScaleFabricPrecision) else VeScaleFabricPrecision(name)

    @property
    @override
    def accelerator(self) -> Optional[Accelerator]:
        return self._accelerator

    @accelerator.setter
    @override
    def accelerator(self, accelerator: Optional[Accelerator]) -> None:
        check_accelerator(accelerator)
        self._accelerator = accelerator

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        raise NotImplementedError(f"{type(self).__name__} writes sharded checkpoints itself, not through CheckpointIO")

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        if io is not None:
            raise NotImplementedError(f"{type(self).__name__} does not take a CheckpointIO plugin")

    @property
    def sharding_session(self) -> ShardingSession:
        """The engine object this strategy delegates to (plan, mesh, sharding, memory, checkpoints), as the
        Trainer's strategy and the Accelerate adapter do."""
        return self._session

    # The sharding arguments, read from the session's config.
    _reshard_after_forward = config_field("reshard_after_forward")
    _granularity = config_field("granularity")
    _replicate_size = config_field("replicate_size")
    _timeout = config_field("timeout")
    _restore_rng_states = config_field("restore_rng_states")
    _tensor_parallel_size = config_field("tensor_parallel_size")

    # -- topology -----------------------------------------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh:
        if self._session.mesh is None:
            raise RuntimeError(_NO_MESH)
        return self._session.mesh

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        world = self.num_nodes * self.num_processes
        return tensor_parallel_sampler_kwargs(world, self.global_rank, self._tensor_parallel_size)

    @property
    def tensor_parallel_size(self) -> int:
        return self._tensor_parallel_size

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.num_processes > 0:
            self._session.config.check_world_size(self.num_nodes * self.num_processes)
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # the rank is an attribute of the function (Lightning's convention), which its stubs do not declare
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self._set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        timeout = self._session.process_group_timeout(self.root_device)
        kwargs: dict[str, Any] = {"timeout": timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        self._session.config.check_world_size(self.world_size)
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        self._session.build_mesh(self.root_device, self.world_size, num_nodes=self.num_nodes, timeout=timeout)

    # -- model and optimizers -----------------------------------------------------------------------------
    @override
    def setup_module(self, module: Module) -> Module:
        session = self._session
        precision = self.precision
        assert isinstance(precision, VeScaleFabricPrecision)
        if session.needs_sharding(module) and session.mesh is None:
            raise RuntimeError(_NO_MESH)
        session.shard(module, roots=[module], mp_policy=precision.mp_policy)
        if not session.places_memory_of(module):  # the policy's placement, and the plan's tiers (none: nothing moves)
            session.place_memory(module, rank=self.global_rank)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """An optimizer built on a set-up model's parameters steps as the memory policy says."""
        self._session.add_optimizer(optimizer)
        return optimizer

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
    ) -> tuple[Module, list[Optimizer], Optional[Any]]:
        """Shard the module, then point each optimizer (built on the unsharded parameters, no state yet) at
        the local pieces."""
        before = dict(module.named_parameters())
        module = self.setup_module(module)
        self._session.remap_optimizers(module, before, optimizers)
        for optimizer in optimizers:
            self.setup_optimizer(optimizer)
        return module, optimizers, scheduler

    @override
    def module_to_device(self, module: Module) -> None:
        pass  # fully_shard places each local piece on the mesh's device

    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        stack = ExitStack()
        if empty_init:
            stack.enter_context(torch.device("meta"))  # materialized piece by piece in setup_module
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the global norm of the sharded gradients (all-reduced over each shard group)."""
        return self._session.clip_grad_norm_(self.precision.main_params(optimizer), max_norm, norm_type=norm_type,
                                             error_if_nonfinite=error_if_nonfinite)

    # -- collectives --------------------------------------------------------------------------------------
    @override
    def all_reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Tensor:
        if isinstance(tensor, Tensor):
            with named_collective("all_reduce (Lightning)", group):
                return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        with named_collective("barrier (Lightning)"):
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        with named_collective("broadcast (Lightning)"):
            dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    # -- checkpoints --------------------------------------------------------------------------------------
    @staticmethod
    def _split_state(state: dict[str, Any]) -> tuple[tuple[str, Module], list[tuple[str, Optimizer]], dict[str, Any]]:
        modules = [(k, v) for k, v in state.items() if isinstance(v, Module)]
        optimizers = [(k, v) for k, v in state.items() if isinstance(v, Optimizer)]
        sharded = [(k, m) for k, m in modules if is_sharded(m)]
        if len(sharded) != 1 or len(modules) != 1:
            raise ValueError(
                f"strategy='vescale' saves and loads one sharded model per checkpoint; the state has modules "
                f"{[k for k, _ in modules]} of which {[k for k, _ in sharded]} are set up by the strategy. Pass the "
                f"model set up with fabric.setup (and save other models to other paths)."
            )
        rest = {k: v for k, v in state.items() if not isinstance(v, (Module, Optimizer))}
        return sharded[0], optimizers, rest

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Union[Module, Optimizer, Any]],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Write a sharded checkpoint directory: the model and its optimizers as DCP shards, every other entry of
        ``state`` (``state_dict()`` of stateful objects) as metadata. A state without a set-up model (state dicts,
        as saved under DDP) is written as one full file instead, as DDP writes it."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported")
        if filter is not None:
            raise NotImplementedError(f"{type(self).__name__} does not filter sharded checkpoints")
        path = Path(self.broadcast(path))
        if not any(isinstance(v, Module) for v in state.values()):
            save_as_file(path, state, self.global_rank)
            return
        (_, module), optimizers, rest = self._split_state(state)
        extra = {k: (v.state_dict() if isinstance(v, _Stateful) else v) for k, v in rest.items()}
        self._session.save(path, module, [o for _, o in optimizers], extra=extra)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Optional[Union[Module, Optimizer, dict[str, Union[Module, Optimizer, Any]]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Restore the model, its optimizers and entries of ``state`` in place; return what ``state`` didn't ask
        for. ``path`` is a sharded checkpoint directory, or one file (``torch.save`` of state dicts, a
        ``.safetensors`` file: LitGPT's ``lit_model.pth``), read without unpickling code."""
        path = Path(self.broadcast(path))
        if path.is_file():
            if weights_only is False:
                raise ValueError(f"{type(self).__name__} reads checkpoint files with weights_only=True only (a pickled "
                                 f"object could run code): save state dicts of tensors and plain values")
            return load_file_into(path, state, strict)
        if not state:
            raise ValueError(
                f"{type(self).__name__}.load_checkpoint needs state={{'model': model, ...}} (or the model) to load "
                f"the sharded checkpoint {str(path)!r} into"
            )
        safe = weights_only is not False  # nothing is unpickled unless the caller trusts the checkpoint
        if isinstance(state, Module):
            self._session.load(path, state, weights_only=safe)
            return {}
        if isinstance(state, Optimizer):
            raise NotImplementedError(f"{type(self).__name__} loads an optimizer together with its model")
        (_, module), optimizers, rest = self._split_state(state)
        extra = dict(self._session.load(path, module, [o for _, o in optimizers], weights_only=safe) or {})
        missing = [k for k in rest if k not in extra]
        if strict and missing:
            raise KeyError(f"the checkpoint at {str(path)!r} has no entries {missing}")
        for key in rest:
            if key not in extra:
                continue
            value = extra.pop(key)
            if isinstance(state[key], _Stateful):
                state[key].load_state_dict(value)
            else:
                state[key] = value
        return extra

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        return self._session.model_state_dict(module)

    @override
    def load_module_state_dict(
        self, module: Module, state_dict: dict[str, Union[Any, Tensor]], strict: bool = True
    ) -> None:
        """Load a full (unsharded) state dict into a sharded module: each rank keeps its pieces."""
        self._session.load_full_state_dict(module, state_dict, strict=strict)

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        modules = self._session.modules
        if len(modules) != 1:
            raise RuntimeError(
                f"{type(self).__name__}.get_optimizer_state needs exactly one model set up by the strategy, found "
                f"{len(modules)}"
            )
        return self._session.optimizer_state_dict(modules[0], optimizer)

    def save_pretrained(self, module: Module, save_directory: _PATH, **kwargs: Any) -> None:
        """Write a Hugging Face directory of the set-up ``module`` (a sharded ``transformers`` model); every rank
        calls it (``fabric.strategy.save_pretrained(model, "hf/")``). See
        :func:`lightning_vescale.checkpoint.save_pretrained`."""
        self._session.save_pretrained(getattr(module, "module", module), save_directory, **kwargs)  # unwraps _FabricModule

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self._session.close()
        self.cluster_environment.teardown()
        self.precision.teardown()
        self.accelerator.teardown()

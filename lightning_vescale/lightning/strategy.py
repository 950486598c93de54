"""``Trainer(strategy="vescale")``: the engine's ZeRO-3 sharding behind Lightning's Trainer.

The strategy is thin (STYLE 15): it sets up the process group and the mesh, shards the LightningModule with
``fully_shard`` (unless ``configure_model`` already did), materializes meta-device weights, builds the
optimizers on the local pieces, and routes clipping, accumulation and checkpoints to the engine.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher,
)
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_vescale.engine.collectives import named_collective
from lightning_vescale.engine.fully_shard import GranularityArg, get_state, sharded_groups
from lightning_vescale.engine.policies import MixedPrecisionPolicy
from lightning_vescale.lightning._common import (
    ProcessGroupEnvironment,
    _VeScalePrecisionMixin,
    check_accelerator,
    config_field,
    precision_with_mp_policy,
    register_vescale_names,
    warn_if_policy_ignored,
)
from lightning_vescale.lightning._signals import agree_on_sigterm, install_deferred_sigterm
from lightning_vescale.memory import MemoryPolicy
from lightning_vescale.parallel.parallelize import (
    AutoWrapPolicy,
    PlanLike,
    describe_precision,
    is_sharded,
    no_gradient_sync,
    resolved_plan_of,
    top_level_roots,
)
from lightning_vescale.parallel.session import ShardingConfig, ShardingSession, tensor_parallel_sampler_kwargs
from lightning_vescale.plan import ResolvedPlan

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

__all__ = ["VeScalePrecision", "VeScaleStrategy"]


class VeScalePrecision(_VeScalePrecisionMixin, Precision):
    """The Trainer's precision plugin under ``strategy="vescale"``: the engine's mixed precision, no autocast.

    ``"bf16-mixed"`` gathers bf16 parameters and reduces fp32 gradients into fp32 master pieces;
    ``"bf16-true"`` converts the model to bf16 before sharding. Norm clipping uses the true global norm.
    """

    def __init__(self, precision: str = "32-true") -> None:
        self._setup_precision(precision)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        ShardingSession.clip_grad_norm_(self.main_params(optimizer), clip_val)


class VeScaleStrategy(ParallelStrategy):
    """ZeRO-3 sharded data parallelism on RaggedShard placements (``lightning_vescale.fully_shard``).

    In ``setup`` the strategy shards the LightningModule with :func:`lightning_vescale.parallelize`: the
    groups, granularities, precision, prefetch and optimizer routing come from ``plan`` (by default every
    element of an ``nn.ModuleList`` of identical blocks becomes a group), and each child of the
    LightningModule that holds parameters becomes a root. A model sharded by the user in
    ``configure_model()`` (through ``self.device_mesh``) is kept as it is, and only its unsharded
    remainder is added. Meta-device weights (``configure_model`` runs on the meta device; or
    ``trainer.init_module(empty_init=True)``) are initialized piece by piece with each module's
    ``reset_parameters``, equal to an unsharded init with the same seed. The optimizers are created after
    sharding, so they hold and step only the local pieces.

    Args:
        plan: a declarative plan (:mod:`lightning_vescale.plan`): a ``Plan``, its dict form, a YAML file or the
            name of a plan in ``configs/plan/``. Its names are the LightningModule's (``model.layers.0`` for a
            module stored as ``self.model``; ``**.layers.*`` matches with or without the prefix). Its rules decide
            what the other arguments below set; they apply where it sets nothing.
        auto_wrap_policy: which submodules become groups when no ``plan`` is given: ``None`` (every element of an
            ``nn.ModuleList`` of identical blocks), a set of module classes (or their import paths, e.g. for
            Hydra), or a callable ``module -> bool``. Ignored if ``configure_model`` sharded the model.
        reshard_after_forward: free gathered parameters after forward and gather again in backward (ZeRO-3);
            ``False`` keeps them until backward ends (one AllGather less per group, more memory).
        mp_policy: an explicit :class:`~lightning_vescale.MixedPrecisionPolicy`. By default the Trainer's
            ``precision`` decides: ``"32-true"``, ``"bf16-mixed"`` (bf16 compute, fp32 reduction and master
            weights) or ``"bf16-true"`` (everything bf16). Giving both an ``mp_policy`` and a precision other than
            ``"32-true"`` is an error.
        granularity: the cut granularity per parameter, as ``fully_shard`` takes it (``"element"``, ``"row"``,
            a number of rows, ``"matrix"``, ``"tensor"``, or a callable), a mapping of name globs to those (matched
            against the LightningModule's ``named_parameters()`` names; a glob matching none is an error), or
            ``"muon"``: whole matrices for the parameters :func:`~lightning_vescale.optim.build_optimizer` routes
            to Muon.
        replicate_size: ``None`` shards over every rank (1-D mesh ``("shard",)``). An int ``R`` or ``"auto"``
            (the number of nodes) builds a 2-D ``("replicate", "shard")`` mesh for HSDP: parameters are sharded
            within groups of ``world_size // R`` ranks and gradients averaged across the ``R`` replicas.
        expert_parallel_size: ``1`` (default): no expert parallelism. An int ``ep > 1`` builds a 2-D
            ``("dp", "ep")`` mesh of ``world_size // ep`` by ``ep`` ranks and shards the model with
            :func:`~lightning_vescale.parallel.fully_shard_expert_parallel`: the routed experts of every
            ``GroupedExperts`` are split over ``"ep"`` and their pieces sharded over ``"dp"``, everything else is
            sharded over all ranks. It must divide the world size, the model must contain ``GroupedExperts``, and
            it cannot be combined with ``replicate_size`` (HSDP) yet. The model is built with real weights (not on
            the meta device) so every rank splits the same experts. With ``tensor_parallel_size`` too the mesh is
            3-D ``("dp", "ep", "tp")``: attention split over ``"tp"``, each MoE feed-forward run on 1/tp of the
            tokens (the plan's ``tp: split_tokens``, as ``plan="moe"`` has), experts on ``"ep"``.
        tensor_parallel_size: ``1`` (default): no tensor parallelism. An int ``tp > 1`` builds a 2-D
            ``("data_parallel", "tensor_parallel")`` mesh of ``world_size // tp`` by ``tp`` ranks, as Lightning's
            ``ModelParallelStrategy``: the plan's ``tp`` rules split modules over ``"tensor_parallel"`` (e.g.
            ``plan="llama"``), or ``configure_model()`` splits them with ``parallelize_module(...,
            self.device_mesh["tensor_parallel"], ...)``; groups are then sharded over ``"data_parallel"``, and the
            ranks of one tensor-parallel group read the same batches. It must divide the world size and the split
            shapes (heads included), checked before any process group. With ``replicate_size`` (HSDP) the mesh
            is 3-D ``("replicate", "shard", "tensor_parallel")``; with ``expert_parallel_size`` ``("dp", "ep", "tp")``.
        sync_module_states: broadcast rank 0's weights before sharding (as DDP does), so every rank cuts the
            same model even if the ranks were seeded differently. Meta-device weights are initialized with rank
            0's RNG state instead.
        meta_init: build the modules created in ``configure_model()`` on the meta device (each rank then only
            ever allocates its pieces). Set ``False`` if ``configure_model`` loads real weights.
        process_group_backend: defaults to ``"gloo"`` on CPU and ``"nccl"`` on CUDA.
        memory: where optimizer states and activations live (:class:`~lightning_vescale.memory.MemoryPolicy`:
            device, host or disk tiers, activation checkpointing per block); ``None`` keeps everything on the device.
            A plan's ``tier`` settings win for the parameters they cover; a plan putting anything on disk needs
            ``memory=MemoryPolicy(disk_dir=...)`` (checked before any process starts).
        timeout: how long a collective waits for the other ranks before it fails (a stopped or crashed peer),
            in seconds or as a ``timedelta``; the error names the rank and the collective. ``None``: 5 minutes
            on CPU, 30 minutes on accelerators. It applies to the process group the strategy creates and to
            the mesh's groups (a process group created before the strategy keeps its own).
        restore_rng_states: on resume, set every rank's RNG states to the saved ones, so data drawn from the
            global RNG and dropout masks continue exactly as in the uninterrupted run. ``False`` (default) leaves
            them as they are, as Lightning's own strategies do (they save none).

    .. note::
        The strategy saves and loads checkpoints itself, as a directory of shards
        (``lightning_vescale.checkpoint``) holding the model, every optimizer, schedulers, loops and each rank's
        RNG state; it loads on another world size. Lightning's default saving would keep only rank 0's shard.
        ``fit(ckpt_path=...)`` also resumes from a single-file ``.ckpt`` written by another strategy (DDP, one
        device): each rank takes its pieces of the model and optimizer states.
        ``LightningModule.load_from_checkpoint`` reads these directories as Lightning reads a ``.ckpt`` file.
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
        expert_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        sync_module_states: bool = True,
        meta_init: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Union[None, float, timedelta] = None,
        memory: Optional[MemoryPolicy] = None,
        restore_rng_states: bool = False,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        # Every sharding argument is checked now, before any process starts (a plan file: its keys and values).
        self._session = ShardingSession(ShardingConfig(
            who="VeScaleStrategy", plan=plan, auto_wrap_policy=auto_wrap_policy,
            reshard_after_forward=reshard_after_forward, mp_policy=mp_policy, granularity=granularity,
            replicate_size=replicate_size, expert_parallel_size=expert_parallel_size,
            tensor_parallel_size=tensor_parallel_size, sync_module_states=sync_module_states, memory=memory,
            timeout=timeout, restore_rng_states=restore_rng_states,
        ))
        self._plan_checked = False
        self._meta_init = meta_init
        self._process_group_backend = process_group_backend
        self.num_nodes = 1
        check_accelerator(accelerator)
        if cluster_environment is None and ProcessGroupEnvironment.detect():
            # Processes and process group exist already (spawned by the user or a test harness).
            cluster_environment = ProcessGroupEnvironment()
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )

    @property
    def sharding_session(self) -> ShardingSession:
        """The engine object this strategy delegates to (plan, mesh, sharding, memory, checkpoints), as Fabric's
        strategy and the Accelerate adapter do."""
        return self._session

    @property
    def memory_policy(self) -> Optional[MemoryPolicy]:
        """Where optimizer states and activations live; set it before ``Trainer.fit``."""
        return self._session.config.memory

    @memory_policy.setter
    def memory_policy(self, memory: Optional[MemoryPolicy]) -> None:
        # Checked as at construction (without a policy, check_plan says so before the run starts: it may be set later).
        self._session.config = dataclasses.replace(self._session.config, memory=memory)

    # The sharding arguments, read from the session's config (the recipes and tests read them).
    _reshard_after_forward = config_field("reshard_after_forward")
    _granularity = config_field("granularity")
    _replicate_size = config_field("replicate_size")
    _timeout = config_field("timeout")
    _restore_rng_states = config_field("restore_rng_states")
    _expert_parallel_size = config_field("expert_parallel_size")
    _tensor_parallel_size = config_field("tensor_parallel_size")

    # -- registry -----------------------------------------------------------------------------------------
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_vescale_names(cls, strategy_registry)

    # -- plugins ------------------------------------------------------------------------------------------
    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else VeScalePrecision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        if precision_plugin is None:
            self._precision_plugin = None
            return
        precision = precision_with_mp_policy(precision_plugin, self._session.config.mp_policy, "VeScaleStrategy")
        if not isinstance(precision_plugin, VeScalePrecision):
            precision_plugin = VeScalePrecision(precision)
        self._precision_plugin = precision_plugin

    @property
    @override
    def accelerator(self) -> Optional[pl.accelerators.Accelerator]:
        return self._accelerator

    @accelerator.setter
    @override
    def accelerator(self, accelerator: Optional[pl.accelerators.Accelerator]) -> None:
        check_accelerator(accelerator)
        self._accelerator = accelerator

    # -- topology -----------------------------------------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh:
        if self._session.mesh is None:
            raise RuntimeError("the device mesh exists once the processes are set up (setup_environment)")
        return self._session.mesh

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank is a data-parallel rank, HSDP included; with tensor parallelism each tp group is one.
        world = self.num_nodes * self.num_processes
        return tensor_parallel_sampler_kwargs(world, self.global_rank, self._tensor_parallel_size)

    @property
    def is_distributed(self) -> bool:
        # Without it Lightning silently drops the DistributedSampler and sync_dist.
        return True

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @property
    def expert_parallel_size(self) -> int:
        return self._expert_parallel_size

    @property
    def tensor_parallel_size(self) -> int:
        return self._tensor_parallel_size

    @property
    def resolved_plan(self) -> Optional[ResolvedPlan]:
        """The plan the LightningModule was sharded with (after ``setup``): ``.table()``, ``.to_yaml()``."""
        return resolved_plan_of(self.lightning_module) if self.lightning_module is not None else None

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.num_processes > 0:  # before any process is launched: the Trainer's constructor stops with the message
            self._session.config.check_world_size(self.num_nodes * self.num_processes)
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _PlanCheckingLauncher(self, self.cluster_environment, self.num_processes, self.num_nodes)

    def check_plan(self) -> None:
        """Resolve the plan against the LightningModule now, so that a glob typo, a rule that matches nothing or
        a plan written for another model stops the run before any process is launched or any process group is
        created (``Trainer.fit`` calls it first). Skipped where the modules are built later, in
        ``configure_model``, or were sharded by hand: ``setup`` resolves the plan then."""
        config = self._session.config
        config.check_plan_tiers()  # a disk tier needs memory.disk_dir
        module = self.lightning_module
        if self._plan_checked or (config.plan is None and config.tensor_parallel_size == 1) or module is None:
            return
        from lightning.pytorch import LightningModule

        if is_overridden("configure_model", module, parent=LightningModule) or is_sharded(module):
            return
        self._session.check_plan(module, roots=top_level_roots(module), mp_policy=self._precision_mp_policy())
        self._plan_checked = True

    def _precision_mp_policy(self) -> Optional[MixedPrecisionPolicy]:
        precision = self.precision_plugin
        return precision.mp_policy if isinstance(precision, VeScalePrecision) else None

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # the rank is an attribute of the function (Lightning's convention), which its stubs do not declare
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        timeout = self._session.process_group_timeout(self.root_device)
        kwargs: dict[str, Any] = {"timeout": timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        self._session.config.check_world_size(self.world_size)
        self.check_plan()  # launched externally (torchrun, SLURM): still before the process group
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        self._session.build_mesh(self.root_device, self.world_size, num_nodes=self.num_nodes, timeout=timeout)
        assert self.lightning_module is not None
        # configure_model() can shard by hand with self.device_mesh.
        self.lightning_module._device_mesh = self.device_mesh

    # -- model --------------------------------------------------------------------------------------------
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        # Materialization happens in setup(), after sharding.
        with torch.device("meta") if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        # Expert parallelism splits real experts (identical on every rank), so it builds the model for real.
        with torch.device("meta") if self._meta_init and self._expert_parallel_size == 1 else nullcontext():
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        install_deferred_sigterm(trainer)  # before the Trainer registers its handlers: see _signals.py
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        precision = self.precision_plugin
        assert isinstance(precision, VeScalePrecision)
        user_sharded = is_sharded(module)
        session = self._session
        shards = session.needs_sharding(module)
        if shards:
            module = precision.convert_module(module)
        session.shard(module, roots=top_level_roots(module), mp_policy=precision.mp_policy)
        if shards and self._expert_parallel_size > 1:
            mesh = self.device_mesh
            rank_zero_info(
                f"{type(self).__name__}: expert parallel over {mesh.mesh_dim_names} = {tuple(mesh.shape)}: experts "
                f"split over ep={self._expert_parallel_size} ranks"
            )
        if self._tensor_parallel_size > 1:
            mesh = self.device_mesh
            shape = ", ".join(f"{n}={mesh[n].size()}" for n in mesh.mesh_dim_names or ())
            rank_zero_info(f"{type(self).__name__}: tensor parallel over ({shape})")
        if user_sharded:
            warn_if_policy_ignored(module, precision.precision)
        log.debug("%s: %d sharded groups, precision %s", type(self).__name__, len(sharded_groups(module)), precision.precision)
        if precision.precision != "32-true" and session.config.mp_policy is None:
            what = describe_precision(precision.precision)
            rank_zero_info(f"{type(self).__name__}: precision={precision.precision!r} runs as {what}")
        self.model = module
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            session.close()  # an earlier stage's handles
            session.place_memory(module, self.optimizers, rank=self.global_rank)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # Optimizers from an earlier stage may point at stale parameters; build them again on the local pieces.
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)

    @override
    def model_to_device(self) -> None:
        # Sharded parameters already live on the mesh's device; only stray buffers need moving. Module.to()
        # would swap parameter storage away from the DBuffers.
        assert self.model is not None
        for m in self.model.modules():
            for name, buf in list(m._buffers.items()):
                if buf is not None and buf.device != self.root_device:
                    m._buffers[name] = buf.to(self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-final micro-batches of gradient accumulation: no ReduceScatter, gradients stay local."""
        assert self.model is not None
        with no_gradient_sync(self.model):
            yield

    # -- steps and signals --------------------------------------------------------------------------------
    def _run_step(self, step: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        with context():
            if get_state(module) is not None:
                # The LightningModule holds parameters itself (its own group): run the step as its forward, so
                # the group is gathered before the step and its gradients reduced after backward (FSDP2's root).
                return self._forward_redirection(module, module, step, *args, **kwargs)
            return getattr(module, step)(*args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("training_step", self.precision_plugin.train_step_context, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("validation_step", self.precision_plugin.val_step_context, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("test_step", self.precision_plugin.test_step_context, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("predict_step", self.precision_plugin.predict_step_context, *args, **kwargs)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Every rank, same batch: stop after this step if any rank received SIGTERM (no collective in the handler).
        assert self.lightning_module is not None
        agree_on_sigterm(self.lightning_module.trainer)

    # -- collectives --------------------------------------------------------------------------------------
    @override
    def barrier(self, name: Optional[str] = None) -> None:
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

    @override
    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Union[Tensor, Any]:
        if isinstance(tensor, Tensor):
            with named_collective("reduce (Lightning)", group):
                return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # -- checkpoints --------------------------------------------------------------------------------------
    def _optimizers_for_checkpoint(self) -> list[Optimizer]:
        """Every optimizer of the LightningModule (a GAN's two, for example), in ``configure_optimizers`` order."""
        return [opt._optimizer if isinstance(opt, LightningOptimizer) else opt for opt in self.optimizers]

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The sharded model state dict (each rank's pieces); ``save_checkpoint`` writes it as DCP shards."""
        assert self.model is not None
        return self._session.model_state_dict(self.model)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint() already restored the model

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.model is not None
        return self._session.optimizer_state_dict(self.model, optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint() already restored the optimizer

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Write a directory of shards (``lightning_vescale.checkpoint.save``): model and optimizer as DCP
        shards, the rest of Lightning's checkpoint (loops, callbacks, LR schedulers, hyperparameters) as
        ``extra``, and every rank's RNG states."""
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported: the strategy "
                f"writes sharded checkpoints itself instead of through a CheckpointIO plugin"
            )
        path = Path(self.broadcast(filepath))
        if self.is_global_zero and path.is_file():
            path.unlink()  # an older single-file checkpoint of the same name
        self.barrier()
        extra = dict(checkpoint)
        extra.pop("state_dict", None)
        with_optimizer = extra.pop("optimizer_states", None) is not None
        assert self.model is not None
        self._session.save(path, self.model, self._optimizers_for_checkpoint() if with_optimizer else None, extra=extra)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        assert self.model is not None
        if path.is_file():  # a missing directory goes to vckpt.load, which also resolves the ".old" fallback
            return self._load_full_checkpoint_file(path)
        # Nothing is unpickled unless the caller passed weights_only=False (only format-1 checkpoints need it).
        extra = dict(self._session.load(path, self.model, self._optimizers_for_checkpoint(),
                                        weights_only=weights_only is not False))
        # Hooks such as on_load_checkpoint expect the key; the weights are already in the model.
        extra.setdefault("state_dict", self._session.model_state_dict(self.model))
        return extra

    def _load_full_checkpoint_file(self, path: Path) -> dict[str, Any]:
        """Resume from a single-file Lightning checkpoint (DDP's, one device's): every rank reads the file and keeps
        its pieces of the model and of each optimizer's states; Lightning restores the rest from the dict."""
        from lightning_vescale import checkpoint as vckpt

        checkpoint = vckpt.read_state_file(path)
        if "state_dict" not in checkpoint:
            raise ValueError(f"{str(path)!r} is not a Lightning checkpoint (it has no 'state_dict'); load a bare state "
                             f"dict with lightning_vescale.checkpoint.load_full_state_dict in on_fit_start")
        assert self.model is not None
        self._session.load_full_state_dict(self.model, checkpoint["state_dict"])
        optimizers = self._optimizers_for_checkpoint()
        saved = checkpoint.get("optimizer_states", [])
        if optimizers and len(saved) != len(optimizers):
            raise ValueError(f"{str(path)!r} holds {len(saved)} optimizer state(s), the LightningModule configures "
                             f"{len(optimizers)}")
        for optimizer, state in zip(optimizers, saved):
            self._session.load_full_optimizer_state_dict(optimizer, state)
        return checkpoint

    def save_pretrained(self, module: Module, save_directory: _PATH, **kwargs: Any) -> None:
        """Write a Hugging Face directory of ``module`` (a sharded ``transformers`` model inside the
        LightningModule); every rank calls it (``trainer.strategy.save_pretrained(self.model, "hf/")``). See
        :func:`lightning_vescale.checkpoint.save_pretrained`."""
        self._session.save_pretrained(module, save_directory, **kwargs)

    # -- teardown -----------------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        # Unlike Strategy.teardown, don't move the model to CPU: that would swap parameter storage away from
        # the DBuffers on CUDA.
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self._session.close()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()


class _PlanCheckingLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher that checks the strategy's plan before it starts the other processes."""

    def __init__(self, strategy: VeScaleStrategy, *args: Any) -> None:
        super().__init__(*args)
        self._strategy = strategy

    @override
    def launch(self, function: Any, *args: Any, trainer: Optional[pl.Trainer] = None, **kwargs: Any) -> Any:
        self._strategy.check_plan()
        return super().launch(function, *args, trainer=trainer, **kwargs)

"""What the Trainer strategy and the Fabric strategy share, on top of :mod:`lightning_vescale.parallelize`.

* precision plugins: Lightning's precision strings run as the engine's :class:`MixedPrecisionPolicy` (no autocast);
* the accelerator check and the registry names;
* a cluster environment for an already-initialized process group.

The framework-free parts live in :mod:`lightning_vescale.parallel`: the strategies' engine object
(:class:`~lightning_vescale.parallel.session.ShardingSession`: plan, mesh, sharding, optimizers, memory, checkpoints)
and the applier's helpers (precision strings, materialization, gradient-sync control), re-exported here under their
former names; the core engine never imports this package.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from typing import Any, Literal, Optional, TypeVar, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_STR
from lightning.fabric.plugins.precision.utils import (
    _convert_fp_tensor,
    _DtypeContextManager,
)
from lightning_utilities import apply_to_collection
from torch.distributed.device_mesh import DeviceMesh

from lightning_vescale.engine.fully_shard import GranularityArg, get_state, sharded_groups
from lightning_vescale.engine.policies import MixedPrecisionPolicy
from lightning_vescale.parallel.parallelize import (  # noqa: F401 - the strategies' names for them
    CPU_TIMEOUT,
    SUPPORTED_PRECISION,
    AutoWrapPolicy,
    add_output_casts,
    broadcast_module_states,
    build_expert_parallel_mesh,
    build_mesh,
    build_tensor_parallel_mesh,
    check_expert_parallel_ready,
    check_expert_parallel_size,
    check_tensor_parallel_size,
    describe_precision,
    has_experts,
    is_sharded,
    materialize,
    mp_policy_for_precision,
    no_gradient_sync,
    parallelize,
    param_mapping,
    process_group_timeout,
    remap_optimizer,
    select_blocks,
    set_gradient_sync,
    top_level_roots,
    validate_precision,
)
from lightning_vescale.parallel.session import (  # noqa: F401 - the strategies' names for them
    ShardingConfig,
    ShardingSession,
    check_tensor_parallel_applied,
    check_tensor_parallel_plan,
    tensor_parallel_sampler_kwargs,
)

logger = logging.getLogger(__name__)

__all__ = [
    "SUPPORTED_PRECISION",
    "AutoWrapPolicy",
    "ProcessGroupEnvironment",
    "build_mesh",
    "describe_precision",
    "mp_policy_for_precision",
]

# --------------------------------------------------------------------------------------------------------
# Precision

PrecisionStr = Literal["32-true", "bf16-mixed", "bf16-true"]


def _generic_precision_classes() -> tuple[type, ...]:
    from lightning.fabric.plugins.precision import DoublePrecision as FabricDouble
    from lightning.fabric.plugins.precision import HalfPrecision as FabricHalf
    from lightning.fabric.plugins.precision import MixedPrecision as FabricMixed
    from lightning.fabric.plugins.precision import Precision as FabricPrecision
    from lightning.pytorch.plugins.precision import (
        DoublePrecision,
        HalfPrecision,
        MixedPrecision,
        Precision,
    )

    return (FabricPrecision, FabricMixed, FabricHalf, FabricDouble, Precision, MixedPrecision, HalfPrecision,
            DoublePrecision)


def precision_of_plugin(plugin: Any) -> str:
    """The precision string of a Lightning precision plugin the engine can replace, or a clear error."""
    if isinstance(plugin, _VeScalePrecisionMixin):
        return plugin.precision
    if type(plugin) not in _generic_precision_classes():
        raise TypeError(
            f"strategy='vescale' got the precision plugin {type(plugin).__name__}, which it cannot map onto its "
            f"mixed-precision policy: pass precision= one of {', '.join(repr(p) for p in SUPPORTED_PRECISION)} "
            f"instead of a plugin instance"
        )
    return validate_precision(getattr(plugin, "precision", "32-true"))


def precision_with_mp_policy(plugin: Any, mp_policy: Optional[MixedPrecisionPolicy], where: str) -> str:
    """The precision string of ``plugin``; an error when an explicit ``mp_policy`` would contradict it."""
    precision = precision_of_plugin(plugin)
    if mp_policy is not None and precision != "32-true":
        raise ValueError(f"{where} got both mp_policy={mp_policy} and precision={precision!r}: choose one "
                         f"(keep precision='32-true' with an explicit mp_policy)")
    return precision


_ModuleT = TypeVar("_ModuleT", bound=nn.Module)


class _VeScalePrecisionMixin:
    """Lightning precision plugin behaviour for the engine: no autocast; ``bf16-true`` converts the module.

    The casts of ``bf16-mixed`` happen inside the engine (its :class:`MixedPrecisionPolicy`): parameters are
    gathered in bf16, sharded modules cast their floating inputs to bf16, gradients are reduced in fp32 into
    the fp32 local pieces, and the roots' outputs come back in fp32.
    """

    precision: _PRECISION_INPUT_STR  # as Lightning's Precision declares it

    def _setup_precision(self, precision: str) -> None:
        self.precision = cast(_PRECISION_INPUT_STR, validate_precision(precision))  # one of SUPPORTED_PRECISION
        self.mp_policy = mp_policy_for_precision(self.precision)
        self._true_dtype = torch.bfloat16 if self.precision == "bf16-true" else None

    def convert_module(self, module: _ModuleT) -> _ModuleT:
        if self._true_dtype is None:
            return module
        if any(get_state(m) is not None for m in module.modules()):
            # Already sharded (in configure_model): converting would detach the parameters from their buffers.
            wrong = [n for n, p in module.named_parameters() if p.is_floating_point() and p.dtype != self._true_dtype]
            if wrong:
                raise ValueError(
                    f"precision='{self.precision}' but parameters {wrong[:3]} of a module sharded in configure_model "
                    f"are not {self._true_dtype}: create them under the strategy's init context (Lightning does this "
                    f"for configure_model) or convert the module before calling fully_shard"
                )
            return module
        return module.to(dtype=self._true_dtype)

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return _DtypeContextManager(self._true_dtype) if self._true_dtype is not None else contextlib.nullcontext()

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    def forward_context(self) -> contextlib.AbstractContextManager:
        # Tensors created during forward follow the weights' dtype under bf16-true; nothing happens otherwise.
        return self.tensor_init_context()

    def convert_input(self, data: Any) -> Any:
        if self._true_dtype is None:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=self._true_dtype)


# --------------------------------------------------------------------------------------------------------
# Accelerator


def check_accelerator(accelerator: Any) -> None:
    """The engine runs on CPU (gloo) and CUDA (NCCL) meshes; anything else fails here, before training."""
    if accelerator is None:
        return
    from lightning.fabric.accelerators import CPUAccelerator as FabricCPU
    from lightning.fabric.accelerators import CUDAAccelerator as FabricCUDA
    from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator

    if not isinstance(accelerator, (FabricCPU, FabricCUDA, CPUAccelerator, CUDAAccelerator)):
        raise ValueError(
            f"strategy='vescale' runs on accelerator='cpu' (gloo) or accelerator='cuda' (NCCL), got "
            f"{type(accelerator).__name__}: the engine needs a torch.distributed backend with AllGather and "
            f"ReduceScatter on that device. Choose accelerator='cpu' or 'cuda'."
        )


# --------------------------------------------------------------------------------------------------------
# Sharding: everything framework-free lives in lightning_vescale.parallelize


def warn_if_policy_ignored(module: nn.Module, precision: str) -> None:
    """A model sharded by the user keeps its own mp_policy; say so if the Trainer's precision asked for another."""
    if precision != "bf16-mixed":
        return
    groups = sharded_groups(module)
    if groups and all(g.mp_policy.param_dtype is None for g in groups):
        from lightning.fabric.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(
            "precision='bf16-mixed' has no effect on a model you sharded yourself in configure_model() without an "
            "mp_policy: pass mp_policy=lightning_vescale.MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
            "reduce_dtype=torch.float32) to fully_shard there, or let the strategy shard the model."
        )


def config_field(name: str) -> property:
    """A strategy's read-only attribute holding its sharding session's config field ``name``."""
    return property(lambda self: getattr(self._session.config, name), doc=f"The sharding config's ``{name}``.")


def register_vescale_names(cls: type, strategy_registry: Any) -> None:
    """Register ``cls`` as "vescale" and as the "vescale_hsdp" preset (Trainer and Fabric registries alike)."""
    if "vescale" not in strategy_registry:
        strategy_registry.register("vescale", cls, description="ZeRO-3 sharding on RaggedShard placements (lightning_vescale)")
    if "vescale_hsdp" not in strategy_registry:
        strategy_registry.register(
            "vescale_hsdp", cls, description="lightning_vescale HSDP: shard within a node, replicate across nodes",
            replicate_size="auto",
        )


def shard_module(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    roots: Sequence[nn.Module],
    auto_wrap_policy: AutoWrapPolicy = None,
    reshard_after_forward: bool = True,
    mp_policy: Optional[MixedPrecisionPolicy] = None,
    granularity: GranularityArg = None,
) -> None:
    """Shard ``module`` over ``mesh`` with the strategies' former arguments (no weight initialization), through
    the strategies' engine object (:class:`~lightning_vescale.parallel.session.ShardingSession`)."""
    session = ShardingSession(ShardingConfig(
        who="shard_module", auto_wrap_policy=auto_wrap_policy, reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy, granularity=granularity, sync_module_states=False,
    ))
    session.mesh = mesh
    session.shard(module, roots=roots, init_weights=False)


# --------------------------------------------------------------------------------------------------------
# Cluster environment


class ProcessGroupEnvironment(ClusterEnvironment):
    """Ranks taken from an already-initialized default process group.

    Use it (the strategies do automatically) when the processes and the process group exist before the
    Trainer or Fabric is created: a test harness that spawns ranks, or an application that initializes
    ``torch.distributed`` itself. ``LOCAL_RANK`` / ``NODE_RANK`` are read from the environment if set;
    otherwise one node is assumed.
    """

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", 0))

    @staticmethod
    def detect() -> bool:
        return dist.is_available() and dist.is_initialized()

    def world_size(self) -> int:
        return dist.get_world_size()

    def set_world_size(self, size: int) -> None:
        if size != dist.get_world_size():
            raise ValueError(
                f"the process group has {dist.get_world_size()} ranks but devices * num_nodes = {size}: set devices "
                f"(and num_nodes) to match the processes that were started"
            )

    def global_rank(self) -> int:
        return dist.get_rank()

    def set_global_rank(self, rank: int) -> None:
        if rank != dist.get_rank():
            raise ValueError(
                f"this process is rank {dist.get_rank()} of the process group, but node_rank * devices + local_rank "
                f"= {rank}: set LOCAL_RANK / NODE_RANK consistently with the process group"
            )

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", dist.get_rank()))

    def node_rank(self) -> int:
        return int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", 0)))

"""What the Trainer strategy, the Fabric strategy and the Accelerate adapter share.

* precision: Lightning's precision strings mapped onto the engine's :class:`MixedPrecisionPolicy` (no autocast);
* the default sharding policy: which submodules become groups, which modules become roots;
* the device mesh (1-D shard, or 2-D (replicate, shard) for HSDP);
* setup steps around ``fully_shard``: syncing rank 0's weights, materializing meta-device models;
* gradient-sync control for accumulation;
* a cluster environment for an already-initialized process group.

Nothing here is specific to the Trainer or Fabric; the core engine never imports this package.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.fabric.plugins.precision.utils import (
    _convert_fp_tensor,
    _DtypeContextManager,
)
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning_utilities import apply_to_collection
from torch.distributed.device_mesh import DeviceMesh

from lightning_vescale._api import MixedPrecisionPolicy
from lightning_vescale._init import init_sharded_weights
from lightning_vescale.fully_shard import (
    GranularityArg,
    VeScaleModule,
    fully_shard,
    get_state,
    granularity_by_pattern,
    sharded_groups,
)
from lightning_vescale.tensor import is_ragged

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
SUPPORTED_PRECISION: tuple[str, ...] = ("32-true", "bf16-mixed", "bf16-true")

_UNSUPPORTED_HINTS = {
    "16-mixed": "fp16 mixed precision needs a gradient scaler, which the engine does not implement; use 'bf16-mixed'",
    "16-true": "fp16 weights are not supported; use 'bf16-true'",
    "64-true": "float64 training is not supported; use '32-true'",
}


def validate_precision(precision: Any) -> str:
    precision = str(precision)
    # Lightning's short aliases ("bf16" -> "bf16-mixed", "32" -> "32-true") arrive normalized through the
    # connector; accept them here too for strategies built directly.
    precision = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed", "64": "64-true"}.get(precision, precision)
    if precision not in SUPPORTED_PRECISION:
        hint = _UNSUPPORTED_HINTS.get(precision, "")
        raise ValueError(
            f"strategy='vescale' does not support precision={precision!r}; choose one of "
            f"{', '.join(repr(p) for p in SUPPORTED_PRECISION)}" + (f" ({hint})" if hint else "")
        )
    return precision


def mp_policy_for_precision(precision: str) -> Optional[MixedPrecisionPolicy]:
    """The engine policy a Lightning precision string means.

    * ``"32-true"``: no policy (fp32 everywhere);
    * ``"bf16-mixed"``: bf16 gathered parameters and compute, fp32 gradient reduction, fp32 master weights
      (the local pieces), fp32 model outputs — the engine's mixed precision, not autocast;
    * ``"bf16-true"``: the module is converted to bf16 before sharding, so weights, gradients, reductions and
      optimizer states are all bf16.
    """
    precision = validate_precision(precision)
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    if precision == "bf16-true":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    return None


def describe_precision(precision: str) -> str:
    """What a Lightning precision string runs as under the engine, in words (for the start-up log: Lightning
    itself prints "Automatic Mixed Precision (AMP)" for ``"bf16-mixed"``, but no autocast is involved)."""
    precision = validate_precision(precision)
    if precision == "bf16-mixed":
        return ("bf16 parameters gathered and computed in bf16, gradients reduced in fp32 into fp32 master weights "
                "(the engine's MixedPrecisionPolicy; no autocast)")
    if precision == "bf16-true":
        return "bf16 weights, gradients, reductions and optimizer states (no fp32 master copy)"
    return "fp32 weights, compute and reductions"


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


class _VeScalePrecisionMixin:
    """Lightning precision plugin behaviour for the engine: no autocast; ``bf16-true`` converts the module.

    The casts of ``bf16-mixed`` happen inside the engine (its :class:`MixedPrecisionPolicy`): parameters are
    gathered in bf16, sharded modules cast their floating inputs to bf16, gradients are reduced in fp32 into
    the fp32 local pieces, and the roots' outputs come back in fp32.
    """

    precision: str

    def _setup_precision(self, precision: str) -> None:
        self.precision = validate_precision(precision)
        self.mp_policy = mp_policy_for_precision(self.precision)
        self._true_dtype = torch.bfloat16 if self.precision == "bf16-true" else None

    def convert_module(self, module: nn.Module) -> nn.Module:
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
# Sharding policy

AutoWrapPolicy = Union[None, Iterable[type], Callable[[nn.Module], bool]]
"""Which submodules become their own group: ``None`` (default: every element of an ``nn.ModuleList`` whose
elements share one class, e.g. transformer blocks), a set of module classes, or a callable ``module -> bool``."""


def _is_block_list(module: nn.Module) -> bool:
    if not isinstance(module, nn.ModuleList) or len(module) == 0:
        return False
    if len({type(m) for m in module}) != 1:
        return False
    return any(True for _ in module[0].parameters())


def _import_class(path: str) -> type:
    """``"torch.nn.TransformerEncoderLayer"`` -> the class (so Hydra configs can name block classes)."""
    import importlib

    module_name, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        raise ValueError(f"auto_wrap_policy names {path!r}, which is not an importable class path") from None


def select_blocks(root: nn.Module, policy: AutoWrapPolicy = None) -> list[nn.Module]:
    """The submodules of ``root`` that get their own group, descendants before ancestors (the order
    ``fully_shard`` must be applied in)."""
    if policy is None:
        blocks: list[nn.Module] = []

        def visit(module: nn.Module) -> None:
            for child in module.children():
                if _is_block_list(child):
                    blocks.extend(child)  # the blocks' insides stay in the block's group
                else:
                    visit(child)

        visit(root)
        return blocks
    if callable(policy) and not isinstance(policy, type):
        predicate = policy
    else:
        if isinstance(policy, (str, type)):
            policy = [policy]
        classes = tuple(_import_class(c) if isinstance(c, str) else c for c in policy)  # type: ignore[union-attr]
        if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError(
                f"auto_wrap_policy must be a set of nn.Module classes or a callable module -> bool, got {policy!r}"
            )
        predicate = lambda m: isinstance(m, classes)  # noqa: E731
    chosen = [m for m in root.modules() if m is not root and predicate(m)]
    # modules() is pre-order: reversing it puts every descendant before its ancestors.
    return [m for m in reversed(chosen) if any(True for _ in m.parameters())]


def top_level_roots(module: nn.Module) -> list[nn.Module]:
    """The roots for a LightningModule: each child that holds parameters (containers are looked through).

    A LightningModule's ``training_step`` calls its submodules directly (``self.model(x)``), so its
    children — not the LightningModule itself — are the modules whose forward the engine can hook.
    Parameters the LightningModule registers directly (a learned position embedding, a CLS token) belong to
    no child: :func:`shard_module` puts them in the LightningModule's own group, as FSDP2 puts every
    parameter no group claims into the root's.
    """
    roots: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if not any(True for _ in child.parameters()):
                continue
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                visit(child)  # containers are never called; their elements are
            else:
                roots.append(child)

    visit(module)
    return roots


def _check_no_ties_across(roots: Sequence[nn.Module], names: dict[int, str]) -> None:
    seen: dict[int, nn.Module] = {}
    for root in roots:
        for p in root.parameters():
            other = seen.get(id(p))
            if other is not None and other is not root:
                raise ValueError(
                    f"parameter {names.get(id(p), '?')} is shared by two top-level modules "
                    f"({type(other).__name__} and {type(root).__name__}), which would be sharded as separate roots. "
                    f"Put both in one submodule, or apply fully_shard yourself in configure_model()."
                )
            seen[id(p)] = root


def _cast_output_hook(dtype: torch.dtype) -> Callable:
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        return apply_to_collection(output, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=dtype)

    return hook


def register_vescale_names(cls: type, strategy_registry: Any) -> None:
    """Register ``cls`` as "vescale" and as the "vescale_hsdp" preset (Trainer and Fabric registries alike)."""
    if "vescale" not in strategy_registry:
        strategy_registry.register("vescale", cls, description="ZeRO-3 sharding on RaggedShard placements (lightning_vescale)")
    if "vescale_hsdp" not in strategy_registry:
        strategy_registry.register(
            "vescale_hsdp", cls, description="lightning_vescale HSDP: shard within a node, replicate across nodes",
            replicate_size="auto",
        )


def resolve_granularity(module: nn.Module, granularity: GranularityArg) -> GranularityArg:
    """``"muon"``: whole matrices for what Muon steps, so it orthogonalizes them where they live. A mapping of
    globs matches the names ``module.named_parameters()`` gives; a glob matching none is an error now."""
    if granularity == "muon":
        from lightning_vescale.optim.routing import muon_granularity

        return muon_granularity(module)
    if isinstance(granularity, Mapping):
        return granularity_by_pattern(module, granularity)
    return granularity


def is_sharded(module: nn.Module) -> bool:
    return any(get_state(m) is not None for m in module.modules())


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
    """Apply ``fully_shard`` to the blocks ``auto_wrap_policy`` selects, then to each of ``roots``, then to
    ``module`` itself if parameters are left that no group holds.

    If some modules are already sharded (the user called ``fully_shard`` in ``configure_model``), only the
    roots that are not sharded yet are added, so no parameter is left unsharded (and unsynchronized).
    """
    names = {id(p): n for n, p in module.named_parameters()}
    _check_no_ties_across(roots, names)
    granularity = resolve_granularity(module, granularity)
    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy, granularity=granularity)
    if not is_sharded(module):
        for block in select_blocks(module, auto_wrap_policy):
            fully_shard(block, **kwargs)
    for root in roots:
        if get_state(root) is None:
            fully_shard(root, **kwargs)
    if get_state(module) is None and any(not is_ragged(p) for p in module.parameters()):
        # Parameters no group claims (registered on the LightningModule itself, or left outside the modules
        # sharded in configure_model) go into the module's own group, as FSDP2's root takes them. Its steps
        # then run through its forward hooks (VeScaleStrategy.training_step), which gather and reduce them.
        fully_shard(module, **kwargs)


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


def add_output_casts(roots: Sequence[nn.Module], mp_policy: Optional[MixedPrecisionPolicy]) -> None:
    """Cast the floating outputs of each root to ``output_dtype``.

    The engine casts outputs of the module that runs forward first; with several roots (a LightningModule's
    children) each needs its own cast so losses are computed in fp32 as under autocast.
    """
    if mp_policy is None or mp_policy.output_dtype is None:
        return
    for root in roots:
        if not getattr(root, "_vescale_output_cast", False):
            root.register_forward_hook(_cast_output_hook(mp_policy.output_dtype))
            root._vescale_output_cast = True


# --------------------------------------------------------------------------------------------------------
# Mesh


CPU_TIMEOUT = timedelta(minutes=5)
"""Default process-group timeout on CPU: a stopped or crashed peer stops the others within minutes."""


def process_group_timeout(timeout: Union[None, float, timedelta], device: torch.device) -> timedelta:
    """The strategies' ``timeout`` argument as a ``timedelta``: seconds or a ``timedelta``; ``None`` picks
    :data:`CPU_TIMEOUT` on CPU and torch's default (``default_pg_timeout``, 30 minutes) on accelerators,
    where first steps (compilation, NCCL setup, large checkpoints) take longer."""
    if timeout is None:
        return CPU_TIMEOUT if device.type == "cpu" else default_pg_timeout
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be a number of seconds or a datetime.timedelta, got {timeout!r}")
    if not seconds > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return timedelta(seconds=seconds)


# [Note: one mesh per shape]
# Every Trainer.fit builds the mesh again (setup_environment), and a mesh dimension smaller than the world
# is a new process group each time, with its sockets and threads, alive until the default group is
# destroyed. The groups cannot be destroyed in teardown instead: the sharded model keeps using them after
# fit (trainer.test, another Trainer on the same model). So the strategies share one mesh per (device type,
# shape, names, timeout) for as long as the default process group lives.
_MESHES: dict[tuple, tuple[Any, DeviceMesh]] = {}


def _mesh(
    device: torch.device, shape: tuple[int, ...], names: tuple[str, ...], timeout: Optional[timedelta]
) -> DeviceMesh:
    world = dist.group.WORLD
    for key in [k for k, (w, _) in _MESHES.items() if w is not world]:
        del _MESHES[key]  # built on a process group that was destroyed since: release its groups
    key = (device.type, shape, names, timeout)
    if key not in _MESHES:
        _MESHES[key] = (world, _new_mesh(device, shape, names, timeout))
    return _MESHES[key][1]


def _new_mesh(
    device: torch.device, shape: tuple[int, ...], names: tuple[str, ...], timeout: Optional[timedelta]
) -> DeviceMesh:
    """``init_device_mesh`` with ``timeout`` on the groups it creates (a dimension spanning every rank uses the
    default group, whose timeout was set when it was created); ``init_device_mesh`` gives them torch's default."""
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    ranks = torch.arange(world_size).view(shape)
    groups = []
    for dim, size in enumerate(shape):
        if size == world_size:
            groups.append(dist.group.WORLD)
            continue
        mine = None
        # Every rank creates every group of this dimension, in the same order (new_group is collective).
        for members in ranks.movedim(dim, -1).reshape(-1, size).tolist():
            group = dist.new_group(members, timeout=timeout)
            if rank in members:
                mine = group
        groups.append(mine)
    if len(groups) == 1:
        return DeviceMesh.from_group(groups[0], device.type, mesh_dim_names=names)
    return DeviceMesh.from_group(groups, device.type, mesh=ranks, mesh_dim_names=names)


def build_mesh(
    device: torch.device, world_size: int, replicate_size: Optional[int] = None, *, timeout: Optional[timedelta] = None
) -> DeviceMesh:
    """A 1-D ``("shard",)`` mesh over every rank, or, with ``replicate_size``, a 2-D
    ``("replicate", "shard")`` mesh for HSDP (shard within groups of ``world_size // replicate_size`` ranks,
    average across ``replicate_size`` replicas). The same arguments give the same mesh again (no new groups);
    ``timeout`` applies to the groups it creates."""
    if replicate_size is None:
        return _mesh(device, (world_size,), ("shard",), timeout)
    if replicate_size < 1 or world_size % replicate_size != 0:
        raise ValueError(
            f"replicate_size={replicate_size} must be a positive divisor of the world size {world_size} "
            f"(HSDP shards over world_size // replicate_size ranks and replicates over replicate_size)"
        )
    return _mesh(device, (replicate_size, world_size // replicate_size), ("replicate", "shard"), timeout)


def check_expert_parallel_size(expert_parallel_size: int, world_size: int) -> None:
    """``expert_parallel_size`` must divide the world size (the ``("dp", "ep")`` mesh is ``world // ep`` by ``ep``)."""
    if world_size % expert_parallel_size != 0:
        raise ValueError(
            f"expert_parallel_size={expert_parallel_size} does not divide the world size {world_size} "
            f"(devices * num_nodes): the ('dp', 'ep') mesh needs world_size % expert_parallel_size == 0"
        )


def build_expert_parallel_mesh(
    device: torch.device, world_size: int, expert_parallel_size: int, *, timeout: Optional[timedelta] = None
) -> DeviceMesh:
    """A 2-D ``("dp", "ep")`` mesh: experts split over ``"ep"``, their pieces sharded over ``"dp"``."""
    check_expert_parallel_size(expert_parallel_size, world_size)
    return _mesh(device, (world_size // expert_parallel_size, expert_parallel_size), ("dp", "ep"), timeout)


# --------------------------------------------------------------------------------------------------------
# Setup around fully_shard


@torch.no_grad()
def broadcast_module_states(module: nn.Module, device: torch.device, src: int = 0) -> None:
    """Give every rank rank ``src``'s weights and buffers (as DDP does), so sharding cuts one model.

    Meta tensors and parameters that are already sharded (local pieces differ by rank) are skipped.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    seen: set[int] = set()
    for t in [*module.parameters(), *module.buffers()]:
        if t.is_meta or id(t) in seen or is_ragged(t):
            continue
        seen.add(id(t))
        data = t.detach()
        moved = data.device != device
        buf = data.to(device) if moved else data
        dist.broadcast(buf, src)
        if moved:
            data.copy_(buf)


def _rng_fingerprint() -> str:
    h = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        h.update(torch.cuda.get_rng_state().numpy().tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def _rank0_rng() -> Iterator[None]:
    """Run the block with rank 0's RNG state if the ranks' states differ (unseeded runs), then restore."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    prints: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(prints, _rng_fingerprint())
    if all(p == prints[0] for p in prints):
        yield
        return
    own = _collect_rng_states()
    states = [own if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(states, src=0)
    _set_rng_states(states[0])
    try:
        yield
    finally:
        _set_rng_states(own)


def materialize(module: nn.Module) -> None:
    """Fill meta-device parameters of a sharded model with the values an unsharded init would give.

    Every rank replays each module's ``reset_parameters`` with rank 0's RNG state, keeping only its piece.
    """
    needs_init = any(g.needs_init for g in sharded_groups(module))
    meta_buffers = any(b.is_meta for b in module.buffers())
    if not needs_init and not meta_buffers:
        return
    own = get_state(module)
    if own is not None and own.group is not None and not own.group.needs_init:
        # The module's own parameters are real (a LightningModule's direct parameters, created in __init__):
        # initialize what lies below it, child by child in modules() order, and keep those values.
        with _rank0_rng():
            for child in module.children():
                if any(g.needs_init for g in sharded_groups(child)) or any(b.is_meta for b in child.buffers()):
                    init_sharded_weights(child)
        return
    with _rank0_rng():
        init_sharded_weights(module)


def prepare_sharded(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    device: torch.device,
    roots: Sequence[nn.Module],
    auto_wrap_policy: AutoWrapPolicy,
    reshard_after_forward: bool,
    mp_policy: Optional[MixedPrecisionPolicy],
    granularity: GranularityArg,
    sync_module_states: bool,
    expert_parallel: bool = False,
) -> None:
    """Sync (real weights), shard, materialize (meta weights), cast outputs: the whole setup of a model.

    With ``expert_parallel`` the mesh is ``("dp", "ep")`` and the sharding step is :func:`shard_expert_parallel`.
    """
    if expert_parallel:
        check_expert_parallel_ready(module)
    if sync_module_states:
        broadcast_module_states(module, device)
    shard = shard_expert_parallel if expert_parallel else shard_module
    shard(
        module, mesh=mesh, roots=roots, auto_wrap_policy=auto_wrap_policy,
        reshard_after_forward=reshard_after_forward, mp_policy=mp_policy, granularity=granularity,
    )
    materialize(module)
    add_output_casts(roots, mp_policy)


def has_experts(module: nn.Module) -> bool:
    from lightning_vescale.models.moe import GroupedExperts

    return any(isinstance(m, GroupedExperts) for m in module.modules())


def check_expert_parallel_ready(module: nn.Module) -> None:
    """Expert parallelism splits real experts of an unsharded MoE: say what is wrong before anything changes."""
    if is_sharded(module):
        raise ValueError(
            "expert_parallel_size > 1 shards the model itself; a model sharded in configure_model() is not "
            "supported with it. Leave the sharding to the strategy, or call fully_shard_expert_parallel yourself "
            "and keep expert_parallel_size=1."
        )
    if not has_experts(module):
        raise ValueError(
            f"expert_parallel_size > 1 but {type(module).__name__} has no expert modules (GroupedExperts, e.g. "
            f"lightning_vescale.models.MoE): set expert_parallel_size=1 for a model without experts"
        )
    if any(p.is_meta for p in module.parameters()):
        raise ValueError(
            "expert_parallel_size > 1 needs the model's real weights before sharding (experts identical on every "
            "rank, then split): don't build it on the meta device (trainer.init_module(empty_init=True))"
        )


def shard_expert_parallel(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    roots: Sequence[nn.Module],
    auto_wrap_policy: AutoWrapPolicy,
    reshard_after_forward: bool,
    mp_policy: Optional[MixedPrecisionPolicy],
    granularity: GranularityArg,
) -> None:
    """:func:`shard_module` with expert parallelism on a ``("dp", "ep")`` mesh.

    Each root holding ``GroupedExperts`` goes through
    :func:`~lightning_vescale.parallel.fully_shard_expert_parallel` (experts split over ``"ep"`` and sharded
    over ``"dp"``; its blocks and itself over all ranks); the other roots are sharded over all ranks.
    """
    from lightning_vescale.models.moe import GroupedExperts
    from lightning_vescale.parallel.expert_parallel import fully_shard_expert_parallel

    names = {id(p): n for n, p in module.named_parameters()}
    _check_no_ties_across(roots, names)
    granularity = resolve_granularity(module, granularity)
    kwargs = dict(reshard_after_forward=reshard_after_forward, mp_policy=mp_policy, granularity=granularity)
    dense_mesh = mesh._flatten()
    for root in roots:
        if has_experts(root):
            inside_experts = {id(m) for e in root.modules() if isinstance(e, GroupedExperts) for m in e.modules()}
            blocks = [
                b for b in select_blocks(root, auto_wrap_policy)
                if id(b) not in inside_experts and b is not root
            ]
            fully_shard_expert_parallel(root, mesh, dense_mesh=dense_mesh, blocks=blocks, **kwargs)
        else:
            for block in select_blocks(root, auto_wrap_policy):
                fully_shard(block, mesh=dense_mesh, **kwargs)
            fully_shard(root, mesh=dense_mesh, **kwargs)
    unsharded = [n for n, p in module.named_parameters() if not is_ragged(p)]
    if unsharded:
        raise ValueError(f"parameters {unsharded[:3]} are not sharded: put them in a submodule of the LightningModule")


def remap_optimizer(optimizer: torch.optim.Optimizer, mapping: dict[int, nn.Parameter]) -> None:
    """Point an optimizer built on the unsharded parameters at their sharded local pieces."""
    if any(len(s) for s in optimizer.state.values()):
        raise RuntimeError(
            f"{type(optimizer).__name__} already holds state for the unsharded parameters; create it before its "
            f"first step, or create it after sharding from model.parameters()"
        )
    for group in optimizer.param_groups:
        new_params = []
        for p in group["params"]:
            if is_ragged(p):
                new_params.append(p)
                continue
            if id(p) not in mapping:
                raise ValueError(
                    f"{type(optimizer).__name__} holds a parameter of shape {tuple(p.shape)} that is not part of the "
                    f"model being sharded: build the optimizer from this model's parameters"
                )
            new_params.append(mapping[id(p)])
        group["params"] = new_params
    optimizer.state.clear()


def param_mapping(module: nn.Module, before: dict[str, nn.Parameter]) -> dict[int, nn.Parameter]:
    """id(unsharded parameter) -> sharded parameter, by name."""
    after = dict(module.named_parameters())
    return {id(p): after[name] for name, p in before.items() if name in after}


# --------------------------------------------------------------------------------------------------------
# Gradient sync


def set_gradient_sync(module: nn.Module, enabled: bool) -> None:
    for m in module.modules():
        if isinstance(m, VeScaleModule):
            m.set_requires_gradient_sync(enabled, recurse=False)


@contextlib.contextmanager
def no_gradient_sync(module: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Inside, backward accumulates unsharded gradients locally and skips every ReduceScatter."""
    if not enabled:
        yield
        return
    set_gradient_sync(module, False)
    try:
        yield
    finally:
        set_gradient_sync(module, True)


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

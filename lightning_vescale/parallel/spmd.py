"""The SPMD applier: shard a model as a resolved plan says, over one mesh (every rank runs the whole model), and the
helpers the integrations share around it (meshes, precision strings, materialization, optimizer remapping,
gradient-sync control). :func:`lightning_vescale.parallelize` dispatches here, or to the MPMD pipeline.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import weakref
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_map

from lightning_vescale.engine.fully_shard import (
    GranularityArg,
    VeScaleModule,
    _default_mesh,
    fully_shard,
    get_state,
    sharded_groups,
)
from lightning_vescale.engine.meta_init import init_sharded_weights
from lightning_vescale.engine.policies import MixedPrecisionPolicy
from lightning_vescale.engine.tensor import is_ragged, is_sharded_param
from lightning_vescale.parallel.tensor_parallel import (
    TENSOR_PARALLEL_DIM_NAMES,
    apply_tensor_parallel,
    split_tensor_parallel_mesh,
    token_split_modules,
)
from lightning_vescale.plan import (  # noqa: F401 - the integrations' names for them
    AutoWrapPolicy,
    PlanError,
    PlanLike,
    ResolvedPlan,
    check_expert_parallel_ready,
    expert_modules,
    has_experts,
    is_mpmd_plan,
    is_sharded,
    parse_dtype,
    register_policy,
    resolve_for,
    select_blocks,
    top_level_roots,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CPU_TIMEOUT",
    "SUPPORTED_PRECISION",
    "AutoWrapPolicy",
    "PlanLike",
    "build_expert_parallel_mesh",
    "build_mesh",
    "describe_precision",
    "mp_policy_for_precision",
    "no_gradient_sync",
    "parallelize_spmd",
    "param_mapping",
    "remap_optimizer",
    "resolve_for",
    "resolved_plan_of",
    "select_blocks",
    "top_level_roots",
]

# --------------------------------------------------------------------------------------------------------
# Precision (Lightning's precision strings, which Accelerate's "bf16" maps onto too)

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


# --------------------------------------------------------------------------------------------------------
# Meshes

CPU_TIMEOUT = timedelta(minutes=5)
"""Default process-group timeout on CPU: a stopped or crashed peer stops the others within minutes."""


def process_group_timeout(timeout: Union[None, float, timedelta], device: torch.device) -> timedelta:
    """The strategies' ``timeout`` argument as a ``timedelta``: seconds or a ``timedelta``; ``None`` picks
    :data:`CPU_TIMEOUT` on CPU and torch's default (30 minutes) on accelerators, where first steps
    (compilation, NCCL setup, large checkpoints) take longer."""
    if timeout is None:
        from torch.distributed.constants import default_pg_timeout

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
    groups: list[dist.ProcessGroup] = []
    for dim, size in enumerate(shape):
        if size == world_size:
            assert dist.group.WORLD is not None  # initialized
            groups.append(dist.group.WORLD)
            continue
        mine = None
        # Every rank creates every group of this dimension, in the same order (new_group is collective).
        for members in ranks.movedim(dim, -1).reshape(-1, size).tolist():
            group = dist.new_group(members, timeout=timeout)
            if rank in members:
                mine = group
        assert mine is not None  # every rank is in one group of each dimension
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


def check_expert_parallel_size(expert_parallel_size: int, world_size: int, tensor_parallel_size: int = 1) -> None:
    """``expert_parallel_size`` (times ``tensor_parallel_size``) must divide the world size (the ``("dp", "ep")`` mesh
    is ``world // ep`` by ``ep``, the ``("dp", "ep", "tp")`` one ``world // (ep * tp)`` by ``ep`` by ``tp``)."""
    if tensor_parallel_size > 1 and world_size % (expert_parallel_size * tensor_parallel_size) != 0:
        raise ValueError(
            f"expert_parallel_size={expert_parallel_size} times tensor_parallel_size={tensor_parallel_size} does not "
            f"divide the world size {world_size} (devices * num_nodes): the ('dp', 'ep', 'tp') mesh needs "
            f"world_size % (expert_parallel_size * tensor_parallel_size) == 0"
        )
    if world_size % expert_parallel_size != 0:
        raise ValueError(
            f"expert_parallel_size={expert_parallel_size} does not divide the world size {world_size} "
            f"(devices * num_nodes): the ('dp', 'ep') mesh needs world_size % expert_parallel_size == 0"
        )


def build_expert_parallel_mesh(
    device: torch.device, world_size: int, expert_parallel_size: int, tensor_parallel_size: int = 1, *,
    timeout: Optional[timedelta] = None,
) -> DeviceMesh:
    """A 2-D ``("dp", "ep")`` mesh: experts split over ``"ep"``, their pieces sharded over ``"dp"``; with
    ``tensor_parallel_size`` a 3-D ``("dp", "ep", "tp")`` mesh (tp the consecutive ranks; see [Note: experts on ep,
    attention on tp] in :mod:`lightning_vescale.parallel.tensor_parallel`)."""
    check_expert_parallel_size(expert_parallel_size, world_size, tensor_parallel_size)
    if tensor_parallel_size > 1:
        dp = world_size // (expert_parallel_size * tensor_parallel_size)
        return _mesh(device, (dp, expert_parallel_size, tensor_parallel_size), ("dp", "ep", "tp"), timeout)
    return _mesh(device, (world_size // expert_parallel_size, expert_parallel_size), ("dp", "ep"), timeout)


def check_tensor_parallel_size(tensor_parallel_size: int, world_size: int) -> None:
    """``tensor_parallel_size`` must divide the world size (the tp mesh is ``world // tp`` by ``tp``)."""
    if world_size % tensor_parallel_size != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} does not divide the world size {world_size} (devices * "
            f"num_nodes): the ('data_parallel', 'tensor_parallel') mesh is world_size // tp by tp ranks; use one of "
            f"{', '.join(map(str, divisors))}"
        )


def build_tensor_parallel_mesh(
    device: torch.device, world_size: int, tensor_parallel_size: int, replicate_size: Optional[int] = None, *,
    timeout: Optional[timedelta] = None,
) -> DeviceMesh:
    """A 2-D ``("data_parallel", "tensor_parallel")`` mesh, as Lightning's ``ModelParallelStrategy`` builds it:
    modules are split over ``"tensor_parallel"`` (consecutive ranks) and groups sharded over ``"data_parallel"``;
    with ``replicate_size`` (HSDP) a 3-D ``("replicate", "shard", "tensor_parallel")`` mesh."""
    check_tensor_parallel_size(tensor_parallel_size, world_size)
    dp = world_size // tensor_parallel_size
    if replicate_size is None:
        return _mesh(device, (dp, tensor_parallel_size), ("data_parallel", "tensor_parallel"), timeout)
    if replicate_size < 1 or dp % replicate_size != 0:
        raise ValueError(
            f"replicate_size={replicate_size} must divide the data-parallel size world_size // tensor_parallel_size = "
            f"{dp} (HSDP x tp shards each group over dp // replicate_size ranks)"
        )
    return _mesh(device, (replicate_size, dp // replicate_size, tensor_parallel_size),
                 ("replicate", "shard", "tensor_parallel"), timeout)


def _is_expert_parallel(mesh: DeviceMesh) -> bool:
    names = tuple(mesh.mesh_dim_names or ())
    return (mesh.ndim == 2 and set(names) == {"dp", "ep"}) or names == ("dp", "ep", "tp")


_RESOLVED: weakref.WeakKeyDictionary[nn.Module, ResolvedPlan] = weakref.WeakKeyDictionary()


def resolved_plan_of(model: nn.Module) -> Optional[ResolvedPlan]:
    """The resolved plan :func:`parallelize` applied to ``model`` (None if it was not parallelized)."""
    return _RESOLVED.get(model)


# --------------------------------------------------------------------------------------------------------
# The applier


def _group_mp_policy(group_param: Optional[str], group_reduce: Optional[str],
                     base: Optional[MixedPrecisionPolicy]) -> MixedPrecisionPolicy:
    base = base or MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=parse_dtype(group_param, "param_dtype"), reduce_dtype=parse_dtype(group_reduce, "reduce_dtype"),
        output_dtype=base.output_dtype, cast_forward_inputs=base.cast_forward_inputs,
    )


def parallelize_spmd(
    model: nn.Module,
    plan: PlanLike = None,
    mesh: Optional[DeviceMesh] = None,
    *,
    roots: Optional[Sequence[nn.Module]] = None,
    mp_policy: Optional[MixedPrecisionPolicy] = None,
    defaults: Optional[Mapping[str, Any]] = None,
    granularity: GranularityArg = None,
    auto_wrap_policy: AutoWrapPolicy = None,
    sync_module_states: bool = False,
    init_weights: bool = True,
    gradient_divide_factor: Optional[float] = None,
) -> nn.Module:
    """Shard ``model`` in place as ``plan`` says, over ``mesh``.

    Every rank of ``mesh`` runs the whole model (SPMD); :func:`lightning_vescale.parallelize` also takes MPMD plans.

    1. resolve the plan (:func:`~lightning_vescale.plan.resolve_plan`): every error a plan can have (unknown
       keys or values, rules matching nothing, conflicts, uncovered parameters, ties across groups) is raised
       here, before any collective;
    2. with ``sync_module_states``, give every rank of the mesh its first rank's weights (as DDP does);
    3. ``fully_shard`` every group, innermost first, with the group's ``reshard_after_forward``, ``prefetch``,
       mixed precision and its parameters' granularities; on a ``("dp", "ep")`` mesh the experts are split
       over ``"ep"`` and sharded over ``"dp"`` (see :func:`~lightning_vescale.parallel.fully_shard_expert_parallel`);
    4. record each sharded parameter's :class:`~lightning_vescale.plan.ParamPolicy` (read by
       :func:`~lightning_vescale.optim.build_optimizer`'s routing, and by
       :func:`~lightning_vescale.memory.apply_memory_policy` for the plan's ``tier`` settings: with plain torch,
       call it once the optimizer exists, as the strategies do, or nothing moves);
    5. with ``init_weights``, initialize meta-device weights piece by piece (each module's
       ``reset_parameters``, the mesh's first rank's RNG: equal to an unsharded init with the same seed).

    Args:
        model: the model (unsharded, on CPU, the mesh's device or the meta device; parts already sharded by
            ``fully_shard`` are kept).
        plan: see :data:`PlanLike`. ``None``: every element of an ``nn.ModuleList`` of identical blocks is a group.
        mesh: a 1-D mesh, a 2-D ``(replicate, shard)`` mesh (HSDP), a 2-D ``("dp", "ep")`` mesh (expert
            parallel) or a 2-D ``("dp", "tp")`` / ``("data_parallel", "tensor_parallel")`` mesh (the plan's ``tp``
            rules split modules over tp, groups are sharded over dp). Default: every rank of the default process group.
        roots: the outermost groups (default ``[model]``); a LightningModule's are its children with
            parameters (:func:`top_level_roots`). Parameters under no root go to ``model``'s own group.
        mp_policy: mixed precision where the plan sets no dtypes (its ``output_dtype`` and
            ``cast_forward_inputs`` always apply).
        defaults, granularity, auto_wrap_policy: the integrations' older arguments, see :func:`resolve_for`.
        sync_module_states: broadcast the mesh's first rank's weights and buffers first.
        init_weights: initialize meta-device weights after sharding.
        gradient_divide_factor: every group's reduced gradient is the sum over the mesh divided by this
            (default: the mean over the mesh; MPMD stages divide by pipelines x micro-batches).

    Returns:
        ``model``, sharded in place. :func:`resolved_plan_of` gives the plan it was sharded with.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize expects an nn.Module, got {type(model).__name__}")
    if is_mpmd_plan(plan):
        raise PlanError("parallelize_spmd got an MPMD plan (with stages): use lightning_vescale.parallelize")
    expert_parallel = mesh is not None and _is_expert_parallel(mesh)
    tensor_parallel = mesh is not None and tuple(mesh.mesh_dim_names or ()) in TENSOR_PARALLEL_DIM_NAMES
    resolved = resolve_for(
        model, plan, roots=roots, mp_policy=mp_policy, defaults=defaults, granularity=granularity,
        auto_wrap_policy=auto_wrap_policy, expert_parallel=expert_parallel, tensor_parallel=tensor_parallel,
    )
    if mesh is None:
        mesh = _default_mesh()
    names = dict(model.named_modules(remove_duplicate=False))
    token_split = token_split_modules(resolved.tensor_parallel) if tensor_parallel else []
    _check_no_aux_loss(model, token_split)
    if expert_parallel:
        check_expert_parallel_ready(model)
        grouped = {id(names[g.name]) for g in resolved.groups}
        loose = [n for n, m in model.named_modules() if m in expert_modules(model) and id(m) not in grouped]
        if loose:
            raise PlanError(
                f"expert parallelism shards each expert module over the 'dp' ranks in a group of its own, but the plan "
                f"does not make {loose[:3]} groups: add a rule {{match: '**.experts', group: true}}"
            )
        _check_experts_split_tokens(model, token_split, tensor_parallel)
    if sync_module_states:
        broadcast_module_states(model, mesh)
    policies = {}
    for p in resolved.params.values():
        for n in (p.name, *p.aliases):
            policies[n] = p
    _declare_quantization(model, policies)
    shard_kwargs: dict[int, dict[str, Any]] = {}
    dense_mesh = mesh
    every_rank: Optional[DeviceMesh] = None  # all of the mesh's ranks as one 1-D mesh, where something needs it
    tp_split = split_tensor_parallel_mesh(mesh)
    if tp_split is not None:
        # Tensor parallelism first (the plan's tp rules), then the groups are sharded over the dp dimension.
        dense_mesh, tp_mesh = tp_split
        apply_tensor_parallel(model, resolved.tensor_parallel, tp_mesh)
        if token_split:
            if dense_mesh.ndim != 1:
                raise PlanError(f"tp: split_tokens ({token_split[0]}) with HSDP x tp is not supported: its parameters "
                                f"are sharded over every rank in one dimension; use a (dp, tp) mesh")
            every_rank = mesh._flatten()
            replicas = mesh.size() // tp_mesh.size()  # the ranks that see different batches
            # The module's groups, and those inside it (its experts without ep), see 1/tp of the tokens.
            inside = [g.name for g in resolved.groups if any(g.name == t or g.name.startswith(t + ".") for t in token_split)]
            for name in inside:
                shard_kwargs[id(names[name])] = dict(mesh=every_rank, gradient_divide_factor=replicas)
    if expert_parallel:
        from lightning_vescale.models.moe import GroupedExperts
        from lightning_vescale.parallel.expert_parallel import ExpertParallelGroupedExperts, apply_expert_parallel

        ep_mesh = mesh["ep"]
        replicas = mesh["dp"].size() * ep_mesh.size()
        if tp_split is None:
            experts_mesh = mesh["dp"]
            dense_mesh = every_rank = mesh._flatten()
        else:
            # Experts on ep, their pieces over the dp * tp ranks sharing an ep coordinate (each tp rank routes other
            # tokens through them: see [Note: experts on ep, attention on tp]).
            experts_mesh = mesh["dp", "tp"]._flatten()
        if not any(isinstance(m, ExpertParallelGroupedExperts) for m in model.modules()):
            apply_expert_parallel(model, ep_mesh)
        for m in model.modules():
            if isinstance(m, GroupedExperts):
                shard_kwargs[id(m)] = dict(mesh=experts_mesh, gradient_divide_factor=replicas, norm_group=every_rank)
    for g in resolved.groups:
        module = names[g.name]
        if get_state(module) is not None:
            continue  # sharded by the user already
        prefix = g.name + "." if g.name else ""

        def granularity_of(inner: str, p: nn.Parameter, prefix: str = prefix) -> Any:
            return policies[prefix + inner].granularity

        # The plan's groups are the groups (the dry run sizes exactly these): no embedding split off behind it.
        kwargs: dict[str, Any] = dict(mesh=dense_mesh, reshard_after_forward=g.reshard_after_forward, prefetch=g.prefetch,
                      mp_policy=_group_mp_policy(g.param_dtype, g.reduce_dtype, mp_policy), granularity=granularity_of,
                      split_embeddings=False)
        if gradient_divide_factor is not None:
            kwargs["gradient_divide_factor"] = gradient_divide_factor
        kwargs.update(shard_kwargs.get(id(module), {}))
        fully_shard(module, **kwargs)
    unsharded = [n for n, p in model.named_parameters() if not is_sharded_param(p)]
    if unsharded:
        raise ValueError(f"parameters {unsharded[:3]} are not sharded: put them in a submodule of the model")
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in policies:
            register_policy(param, policies[name])
    if init_weights:
        materialize(model, mesh)
    add_output_casts(roots if roots is not None else [model], mp_policy)
    _RESOLVED[model] = resolved
    logger.debug("lightning_vescale: parallelized %s with plan %r: %d groups", type(model).__name__,
                 resolved.plan.name, len(resolved.groups))
    return model


def _check_no_aux_loss(model: nn.Module, token_split: Sequence[str]) -> None:
    """A switch-style auxiliary loss on 1/tp of the tokens would differ per tp rank (and from the whole batch's)."""
    coupled = [n for n in token_split if getattr(model.get_submodule(n), "aux_loss_coef", 0) > 0]
    if coupled:
        raise PlanError(f"{coupled[0]} has aux_loss_coef > 0 and tp: split_tokens: its auxiliary loss would be computed "
                        f"on each tp rank's sequence shard, a different loss on every rank. Use the auxiliary-loss-free "
                        f"balancing (aux_loss_coef=0, expert_bias), or tensor_parallel_size=1")


def _check_experts_split_tokens(model: nn.Module, token_split: Sequence[str], tensor_parallel: bool) -> None:
    """With tp, every expert module must run inside a ``tp: split_tokens`` module: otherwise each tp rank would send
    the same tokens through the experts, whose gradients the dp * tp ReduceScatter would then count tp times."""
    if not tensor_parallel:
        return
    outside = [n for n, m in model.named_modules() if m in expert_modules(model)
               and not any(n.startswith(t + ".") for t in token_split)]
    if outside:
        parent = outside[0].rpartition(".")[0] or "<model>"
        raise PlanError(
            f"experts on ep with tensor parallelism need the MoE feed-forward that holds them to run on 1/tp of the "
            f"tokens, but {outside[:3]} lie in no module with tp: split_tokens: add a rule {{match: '{parent}' (or "
            f"'**.feed_forward'), tp: split_tokens}} (the moe plan has it)")


def _declare_quantization(model: nn.Module, policies: Mapping[str, Any]) -> None:
    """Apply the plan's ``quantization`` to the 2-D weights and 3-D expert stacks it covers (before sharding):
    frozen ones are stored as codes + scales, trained ones gathered as codes + scales."""
    by_format: dict[tuple[str, bool], list[str]] = {}
    for name, p in model.named_parameters():
        policy = policies.get(name)
        if policy is None or policy.quantization == "none" or p.dim() not in (2, 3):
            continue
        by_format.setdefault((policy.quantization, p.requires_grad), []).append(name)
    if not by_format:
        return
    from lightning_vescale.quant import parse_format, quantize_all_gather, quantize_frozen_weights

    for (fmt_name, trained), names in by_format.items():
        apply = quantize_all_gather if trained else quantize_frozen_weights
        apply(model, parse_format(fmt_name), targets=names)


# --------------------------------------------------------------------------------------------------------
# Setup around fully_shard, over the mesh's own ranks


def _mesh_broadcast(mesh: DeviceMesh, send: Callable[[Optional[dist.ProcessGroup]], None]) -> None:
    """Run ``send(group)`` along each mesh dimension, from coordinate 0: then every rank of the mesh holds what
    the mesh's first rank held (see [Note: collectives over the mesh only])."""
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        if dist.get_world_size(group) > 1:
            send(group)


@torch.no_grad()
def broadcast_module_states(module: nn.Module, mesh: Union[DeviceMesh, torch.device, None] = None, src: int = 0) -> None:
    """Give every rank of ``mesh`` the weights and buffers of its first rank (as DDP does), so sharding cuts one
    model. Meta tensors and parameters that are already sharded are skipped.

    ``mesh`` may also be a device (the former signature), meaning every rank of the default group.
    """
    if not dist.is_initialized():
        return
    if mesh is None or isinstance(mesh, torch.device):
        mesh = _default_mesh()
    from lightning_vescale.engine.fully_shard import _mesh_device

    device = _mesh_device(mesh)
    seen: set[int] = set()
    for t in [*module.parameters(), *module.buffers()]:
        if t.is_meta or id(t) in seen or is_ragged(t):
            continue
        seen.add(id(t))
        data = t.detach()
        moved = data.device != device
        buf = data.to(device) if moved else data
        _mesh_broadcast(mesh, lambda group: dist.broadcast(buf, group=group, group_src=src))
        if moved:
            data.copy_(buf)


def _rng_states() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: Mapping[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])


def _rng_fingerprint() -> str:
    h = hashlib.sha256()
    for state in _rng_states().values():
        h.update(state.numpy().tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def _first_rank_rng(mesh: DeviceMesh) -> Iterator[None]:
    """Run the block with the mesh's first rank's torch RNG state if the ranks' states differ (unseeded runs),
    then restore this rank's own; a seeded run (equal states) just runs the block."""
    if not dist.is_initialized() or mesh.size() == 1:
        yield
        return
    mine = _rng_fingerprint()
    same = True
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        prints: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(prints, mine, group=group)
        same = same and all(p == prints[0] for p in prints)
    if same:  # every dimension agrees, so the whole mesh does
        yield
        return
    own = _rng_states()
    box = [own]
    _mesh_broadcast(mesh, lambda group: dist.broadcast_object_list(box, group=group, group_src=0))
    _set_rng_states(box[0])
    try:
        yield
    finally:
        _set_rng_states(own)


def _state_mesh(module: nn.Module) -> Optional[DeviceMesh]:
    for m in module.modules():
        state = get_state(m)
        if state is not None:
            return state.mesh
    return None


def materialize(module: nn.Module, mesh: Optional[DeviceMesh] = None) -> None:
    """Fill meta-device parameters of a sharded model with the values an unsharded init would give.

    Every rank replays each module's ``reset_parameters`` with the mesh's first rank's RNG state, keeping only
    its piece. ``mesh``: the model's (default: the mesh its groups were sharded over).
    """
    needs_init = any(g.needs_init for g in sharded_groups(module))
    meta_buffers = any(b.is_meta for b in module.buffers())
    if not needs_init and not meta_buffers:
        return
    mesh = mesh or _state_mesh(module)
    rng = _first_rank_rng(mesh) if mesh is not None else contextlib.nullcontext()
    own = get_state(module)
    if own is not None and own.group is not None and not own.group.needs_init:
        # The module's own parameters are real (a LightningModule's direct parameters, created in __init__):
        # initialize what lies below it, child by child in modules() order, and keep those values.
        with rng:
            for child in module.children():
                if any(g.needs_init for g in sharded_groups(child)) or any(b.is_meta for b in child.buffers()):
                    init_sharded_weights(child)
        return
    with rng:
        init_sharded_weights(module)


def _cast_output_hook(dtype: torch.dtype) -> Callable:
    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        return tree_map(cast, output)

    return hook


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
            root._vescale_output_cast = True  # type: ignore[assignment]  # nn.Module's stub takes tensors and modules only


# --------------------------------------------------------------------------------------------------------
# Optimizers built before sharding; gradient sync


def remap_optimizer(optimizer: torch.optim.Optimizer, mapping: dict[int, nn.Parameter]) -> None:
    """Point an optimizer built on the unsharded parameters at their sharded local pieces."""
    if any(len(s) for s in optimizer.state.values()):
        raise RuntimeError(
            f"{type(optimizer).__name__} already holds state for the unsharded parameters; create it before its "
            f"first step, or create it after sharding from model.parameters()"
        )
    for group in optimizer.param_groups:
        new_params: list[torch.Tensor] = []
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

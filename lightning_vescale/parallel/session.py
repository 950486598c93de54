"""One sharding engine object for every integration: the Trainer strategy, the Fabric strategy and the Accelerate
adapter each hold a :class:`ShardingSession` and delegate to it.

* :class:`ShardingConfig`: the sharding keyword arguments the integrations take (plan, groups, granularity,
  precision policy, mesh sizes, memory policy, ...), checked once, with one message per mistake;
* :meth:`ShardingSession.resolve`: those arguments -> a resolved plan, through the one function that decides it
  (:func:`lightning_vescale.plan.resolve_for`); :meth:`~ShardingSession.shard` applies exactly that plan;
* the mesh the sizes ask for, optimizer remapping, the memory policy's handles, sharded checkpoints (model,
  optimizers, extra state), full state dicts, ``save_pretrained`` and clipping.

Framework-free (the appliers layer, docs/ARCHITECTURE.md): it imports neither Lightning nor Accelerate; what
those frameworks add (precision plugins, launchers, their state-dict conventions) stays in the integrations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_vescale.engine.clip_grad import clip_grad_norm_
from lightning_vescale.engine.fully_shard import GranularityArg
from lightning_vescale.engine.policies import MixedPrecisionPolicy
from lightning_vescale.engine.tensor import is_sharded_param
from lightning_vescale.memory import (
    MemoryHandles,
    MemoryPolicy,
    apply_memory_policy,
    check_explicit_policy,
    check_plan_tiers,
)
from lightning_vescale.parallel.parallelize import AutoWrapPolicy, PlanLike, parallelize
from lightning_vescale.parallel.spmd import (
    build_expert_parallel_mesh,
    build_mesh,
    build_tensor_parallel_mesh,
    check_expert_parallel_size,
    check_tensor_parallel_size,
    materialize,
    param_mapping,
    process_group_timeout,
    remap_optimizer,
)
from lightning_vescale.plan import ResolvedPlan, load_plan, resolve_for

__all__ = [
    "ShardingConfig",
    "ShardingSession",
    "mesh_size_problem",
    "check_tensor_parallel_applied",
    "check_tensor_parallel_plan",
    "tensor_parallel_sampler_kwargs",
]

ReplicateSize = Union[None, int, Literal["auto"]]


def mesh_size_problem(replicate_size: Any, expert_parallel_size: Any, tensor_parallel_size: Any, *,
                      prefix: str = "", null: str = "None") -> Optional[str]:
    """What is wrong with the mesh sizes every integration and the recipes take, or None: ``replicate_size`` None,
    ``"auto"`` or a positive int; the expert- and tensor-parallel sizes positive ints; no expert parallelism with
    HSDP. ``prefix`` names the keys as the caller's users write them (``"strategy."`` in a recipe), ``null`` None."""
    r, ep, tp = replicate_size, expert_parallel_size, tensor_parallel_size

    def positive_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    if not (r is None or r == "auto" or positive_int(r)):
        return f"{prefix}replicate_size must be {null}, 'auto' or a positive int, got {r!r}"
    if not positive_int(ep):
        return f"{prefix}expert_parallel_size must be a positive int, got {ep!r}"
    if ep > 1 and r is not None:
        return (f"{prefix}expert_parallel_size={ep} with {prefix}replicate_size={r!r} (HSDP) is not supported yet: use "
                f"one of them")
    if not positive_int(tp):
        return f"{prefix}tensor_parallel_size must be a positive int, got {tp!r}"
    return None


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """The sharding arguments of every integration (``VeScaleStrategy``, ``VeScaleFabricStrategy``,
    ``VeScaleConfig``), checked when it is created: a bad value or combination fails here, before any process or
    process group, with the same message whichever integration took it (``who`` names that integration).

    The fields mean what :class:`~lightning_vescale.lightning.VeScaleStrategy` documents for its arguments of the
    same names; an integration that does not take one leaves its default.
    """

    who: str = "ShardingConfig"
    plan: PlanLike = None
    auto_wrap_policy: AutoWrapPolicy = None
    reshard_after_forward: bool = True
    mp_policy: Optional[MixedPrecisionPolicy] = None
    granularity: GranularityArg = None
    replicate_size: ReplicateSize = None
    expert_parallel_size: int = 1
    tensor_parallel_size: int = 1
    sync_module_states: bool = True
    memory: Optional[MemoryPolicy] = None
    timeout: Union[None, float, timedelta] = None
    restore_rng_states: bool = False

    def __post_init__(self) -> None:
        who = self.who
        if self.mp_policy is not None and not isinstance(self.mp_policy, MixedPrecisionPolicy):
            raise TypeError(f"{who}: mp_policy must be a lightning_vescale.MixedPrecisionPolicy, got "
                            f"{type(self.mp_policy).__name__}")
        problem = mesh_size_problem(self.replicate_size, self.expert_parallel_size, self.tensor_parallel_size)
        if problem is not None:
            raise ValueError(f"{who}: {problem}")
        if self.plan is not None and self.auto_wrap_policy is not None:
            raise ValueError(f"{who} got both plan= and auto_wrap_policy=: the plan's group rules decide the groups; "
                             f"drop one of them")
        if self.plan is not None and not isinstance(self.plan, ResolvedPlan):
            object.__setattr__(self, "plan", load_plan(self.plan))  # unknown keys and values fail now
        process_group_timeout(self.timeout, torch.device("cpu"))  # a bad value fails here, not after launching
        check_explicit_policy(self.memory, f"{who}(memory=...)")
        if self.memory is not None:  # without one, check_plan_tiers says so when the integration asks (it may be set later)
            self.check_plan_tiers()

    def check_plan_tiers(self) -> None:
        """A plan putting state on the disk tier needs ``memory=MemoryPolicy(disk_dir=...)`` (a writable one)."""
        check_plan_tiers(self.plan, self.memory, self.who)

    def replicate_for(self, num_nodes: int) -> Optional[int]:
        """The HSDP replica count: ``replicate_size``, with ``"auto"`` meaning one replica per node."""
        return num_nodes if self.replicate_size == "auto" else self.replicate_size

    def check_world_size(self, world_size: int) -> None:
        """The mesh sizes must divide the world size (checked before the process group exists)."""
        if self.expert_parallel_size > 1:
            check_expert_parallel_size(self.expert_parallel_size, world_size, self.tensor_parallel_size)
        if self.tensor_parallel_size > 1:
            check_tensor_parallel_size(self.tensor_parallel_size, world_size)


class ShardingSession:
    """The sharding engine object an integration holds: its :class:`ShardingConfig`, the mesh it built, the modules
    it sharded and their memory-policy handles; it resolves plans, shards modules, remaps optimizers, saves and
    loads sharded checkpoints, writes full state dicts and clips gradients. The integrations only translate their
    framework's calls into these."""

    def __init__(self, config: ShardingConfig) -> None:
        self.config = config
        self.mesh: Optional[DeviceMesh] = None
        self.modules: list[nn.Module] = []  # sharded by this session, in order
        self._memory: dict[int, tuple[nn.Module, MemoryHandles]] = {}

    @property
    def who(self) -> str:
        return self.config.who

    # -- plan -----------------------------------------------------------------------------------------
    def effective_mp_policy(self, mp_policy: Optional[MixedPrecisionPolicy]) -> Optional[MixedPrecisionPolicy]:
        """The explicit ``mp_policy`` of the config, else the integration's (from its precision setting)."""
        return self.config.mp_policy or mp_policy

    def resolve(
        self,
        module: nn.Module,
        *,
        roots: Optional[Sequence[nn.Module]] = None,
        mp_policy: Optional[MixedPrecisionPolicy] = None,
    ) -> ResolvedPlan:
        """The plan the config gives ``module`` (pure: no process group): the one place an integration's keyword
        arguments become a resolved plan, through :func:`~lightning_vescale.plan.resolve_for`.
        ``mp_policy``: the integration's precision, used where the config has no explicit one."""
        cfg = self.config
        return resolve_for(
            module, cfg.plan, roots=roots, mp_policy=self.effective_mp_policy(mp_policy),
            defaults={"reshard_after_forward": cfg.reshard_after_forward}, granularity=cfg.granularity,
            auto_wrap_policy=cfg.auto_wrap_policy, expert_parallel=cfg.expert_parallel_size > 1,
            tensor_parallel=cfg.tensor_parallel_size > 1,
        )

    def check_plan(self, module: nn.Module, *, roots: Optional[Sequence[nn.Module]] = None,
                   mp_policy: Optional[MixedPrecisionPolicy] = None) -> ResolvedPlan:
        """Resolve the plan against ``module`` now and check its tensor-parallel rules, so that a mistake stops the
        run before any process group exists."""
        resolved = self.resolve(module, roots=roots, mp_policy=mp_policy)
        check_tensor_parallel_plan(module, resolved, self.config.tensor_parallel_size, self.who)
        return resolved

    # -- mesh -----------------------------------------------------------------------------------------
    def process_group_timeout(self, device: torch.device) -> timedelta:
        return process_group_timeout(self.config.timeout, device)

    def build_mesh(self, device: torch.device, world_size: int, *, num_nodes: int = 1,
                   timeout: Optional[timedelta] = None) -> DeviceMesh:
        """The mesh the config's sizes ask for (1-D, HSDP, tensor parallel, expert parallel), kept as :attr:`mesh`."""
        cfg = self.config
        replicate = cfg.replicate_for(num_nodes)
        if cfg.expert_parallel_size > 1:
            mesh = build_expert_parallel_mesh(device, world_size, cfg.expert_parallel_size, cfg.tensor_parallel_size,
                                              timeout=timeout)
        elif cfg.tensor_parallel_size > 1:
            mesh = build_tensor_parallel_mesh(device, world_size, cfg.tensor_parallel_size, replicate, timeout=timeout)
        else:
            mesh = build_mesh(device, world_size, replicate, timeout=timeout)
        self.mesh = mesh
        return mesh

    # -- modules and optimizers -----------------------------------------------------------------------
    def needs_sharding(self, module: nn.Module) -> bool:
        """Whether :meth:`shard` applies the plan (False: the user sharded every parameter already; expert
        parallelism always shards, and refuses a model sharded by hand)."""
        return self.config.expert_parallel_size > 1 or not all(is_sharded_param(p) for p in module.parameters())

    def shard(
        self,
        module: nn.Module,
        *,
        roots: Optional[Sequence[nn.Module]] = None,
        mp_policy: Optional[MixedPrecisionPolicy] = None,
        init_weights: bool = True,
    ) -> nn.Module:
        """Shard ``module`` in place over :attr:`mesh` with the plan :meth:`resolve` gives (a module the user
        sharded already is only materialized), then check that tensor parallelism split something."""
        tp = self.config.tensor_parallel_size
        if self.needs_sharding(module):
            if self.mesh is None:
                raise RuntimeError(f"{self.who}: build the mesh (build_mesh) before sharding a module")
            resolved = self.resolve(module, roots=roots, mp_policy=mp_policy)
            if tp > 1 and not any(isinstance(p, DTensor) for p in module.parameters()):
                check_tensor_parallel_plan(module, resolved, tp, self.who)
            parallelize(module, resolved, self.mesh, roots=roots, mp_policy=self.effective_mp_policy(mp_policy),
                        sync_module_states=self.config.sync_module_states, init_weights=init_weights)
        elif init_weights:
            materialize(module)  # sharded on the meta device by the user
        check_tensor_parallel_applied(module, tp, self.who)
        if not any(m is module for m in self.modules):
            self.modules.append(module)
        return module

    @staticmethod
    def remap_optimizers(module: nn.Module, before: Mapping[str, nn.Parameter],
                         optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Point optimizers built on ``module``'s parameters ``before`` sharding (no state yet) at its local pieces."""
        mapping = param_mapping(module, dict(before))
        for optimizer in optimizers:
            remap_optimizer(optimizer, mapping)

    # -- memory policy --------------------------------------------------------------------------------
    def place_memory(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = (), *,
                     rank: int) -> MemoryHandles:
        """Apply the memory policy and the plan's tiers to ``module`` (and ``optimizers``); replaces the handles an
        earlier call gave the same module."""
        previous = self._memory.pop(id(module), None)
        if previous is not None:
            previous[1].close()
        handles = apply_memory_policy(module, list(optimizers), self.config.memory, rank=rank)
        self._memory[id(module)] = (module, handles)
        return handles

    def places_memory_of(self, module: nn.Module) -> bool:
        return id(module) in self._memory

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer of a placed module steps as the memory policy says (bucket by bucket with its states)."""
        params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for module, handles in self._memory.values():
            if any(id(p) in params for p in module.parameters()):
                handles.add_optimizer(optimizer)

    def close(self) -> None:
        """Release the memory policy's handles (teardown)."""
        for _, handles in self._memory.values():
            handles.close()
        self._memory.clear()

    # -- state ----------------------------------------------------------------------------------------
    def save(self, path: Union[str, Path], module: nn.Module, optimizers: Optional[Sequence[torch.optim.Optimizer]] = None,
             *, extra: Optional[Mapping[str, Any]] = None) -> None:
        """A sharded checkpoint directory (:func:`lightning_vescale.checkpoint.save`): model and optimizers as DCP
        shards, ``extra`` as metadata, every rank's RNG states. Collective."""
        from lightning_vescale import checkpoint

        checkpoint.save(path, module, list(optimizers) if optimizers is not None else None, extra=extra)

    def load(self, path: Union[str, Path], module: nn.Module,
             optimizers: Optional[Sequence[torch.optim.Optimizer]] = None, *, weights_only: bool = True) -> dict[str, Any]:
        """Load a sharded checkpoint directory (on any world size) into ``module`` and ``optimizers``; the RNG states
        as the config's ``restore_rng_states`` says. Returns the extra state. Collective."""
        from lightning_vescale import checkpoint

        return checkpoint.load(path, module, list(optimizers) if optimizers is not None else None,
                               weights_only=weights_only, restore_rng=self.config.restore_rng_states)

    @staticmethod
    def model_state_dict(module: nn.Module) -> dict[str, Any]:
        """The sharded state dict (this rank's pieces)."""
        from lightning_vescale import checkpoint

        return checkpoint.get_model_state_dict(module)

    @staticmethod
    def optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from lightning_vescale import checkpoint

        return checkpoint.get_optimizer_state_dict(module, optimizer)

    @staticmethod
    def full_state_dict(module: nn.Module, *, rank0_only: bool = True) -> dict[str, Any]:
        """The full (unsharded) state dict, on the first rank only by default. Collective."""
        from lightning_vescale import checkpoint

        return checkpoint.export_full_state_dict(module, rank0_only=rank0_only)

    @staticmethod
    def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
        """Load a full state dict into the sharded ``module``: each rank keeps its pieces."""
        from lightning_vescale import checkpoint

        checkpoint.load_full_state_dict(module, state_dict, strict=strict)

    @staticmethod
    def load_full_optimizer_state_dict(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
        from lightning_vescale import checkpoint

        checkpoint.load_full_optimizer_state_dict(optimizer, state)

    @staticmethod
    def save_pretrained(module: nn.Module, save_directory: Union[str, Path], **kwargs: Any) -> None:
        """A Hugging Face directory of a sharded ``transformers`` model. Collective."""
        from lightning_vescale import checkpoint

        checkpoint.save_pretrained(module, save_directory, **kwargs)

    @staticmethod
    def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip by the true global norm of the sharded gradients (the same on every rank)."""
        return clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)


# --------------------------------------------------------------------------------------------------------
# Tensor parallelism checks (every integration's)


def tensor_parallel_sampler_kwargs(world_size: int, global_rank: int, tensor_parallel_size: int) -> dict[str, int]:
    """The data-parallel replicas and this rank's index among them: the ranks of one tensor-parallel group
    (consecutive ranks of the ``("data_parallel", "tensor_parallel")`` mesh) read the same batch; with
    ``tensor_parallel_size=1`` every rank is a replica."""
    return {"num_replicas": world_size // tensor_parallel_size, "rank": global_rank // tensor_parallel_size}


def check_tensor_parallel_plan(module: nn.Module, resolved: ResolvedPlan, tensor_parallel_size: int, who: str) -> None:
    """Before any process group: the plan must split something over tp, and tp must divide what it splits."""
    from lightning_vescale.parallel.tensor_parallel import check_tensor_parallel

    if tensor_parallel_size <= 1:
        return
    styles = dict(resolved.tensor_parallel)
    if not any((s if isinstance(s, str) else s["style"]) != "replicate" for s in styles.values()):
        raise ValueError(
            f"{who}: tensor_parallel_size={tensor_parallel_size}, but the plan {resolved.plan.name or ''!r} splits no "
            f"module over tp: give a plan with tp rules (e.g. plan='llama', or rules like {{match: '**.wq', tp: "
            f"colwise}}), or split the model yourself in configure_model() with parallelize_module(..., "
            f"self.device_mesh['tensor_parallel'], ...)"
        )
    check_tensor_parallel(module, styles, tensor_parallel_size)


def check_tensor_parallel_applied(module: nn.Module, tensor_parallel_size: int, who: str) -> None:
    """After sharding: with tp > 1 some parameter must be split over tp (otherwise every tp rank computes the same
    thing: correct, and tp times the work)."""
    if tensor_parallel_size <= 1:
        return
    if any(getattr(m, "_vescale_split_tokens", False) for m in module.modules()):
        return  # a module runs on 1/tp of the tokens (tp: split_tokens), its parameters whole
    if not any((mesh := getattr(p, "device_mesh", None)) is not None and mesh.ndim == 2 for p in module.parameters()):
        raise ValueError(
            f"{who}: tensor_parallel_size={tensor_parallel_size}, but no parameter of {type(module).__name__} is split "
            f"over the 'tensor_parallel' mesh dimension: give a plan with tp rules (e.g. plan='llama'), or call "
            f"parallelize_module(..., self.device_mesh['tensor_parallel'], ...) in configure_model()"
        )

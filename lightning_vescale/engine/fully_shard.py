"""``fully_shard``: apply ZeRO-3 sharding on RaggedShard placements to a module, FSDP2-style.

[Note: hooks and ordering]
Each ``fully_shard`` call makes the module's parameters (those not already taken by a sharded
submodule) one :class:`ParamGroup`. Hooks drive it through a training step:

* pre-forward: wait for the group's AllGather (issued here, or earlier as a prefetch) and issue the
  AllGather of the next group in forward order, so it overlaps this group's compute;
* post-forward: free the unsharded buffer (``reshard_after_forward``; not for the root, whose parameters
  backward needs first, unless ``set_reshard_after_forward(True)`` was called on it, as in FSDP2) and hook the
  outputs so that backward reaching them runs pre-backward;
* pre-backward: finish every ReduceScatter that has completed, gather again (not a group of embeddings, whose
  backward reads no weight), prefetch the next group in backward order (``set_backward_prefetch``); the
  group's first parameter gradient (a tensor hook, before autograd accumulates it) allocates the gradient
  buffer, zeroed in one op, and binds its views as the ``.grad``;
* post-accumulate-grad hooks on the unsharded parameters count arrivals; the last one frees the
  parameters, finishes the previous group's ReduceScatter (freeing its unsharded gradient buffer) and issues
  the group's own asynchronously, so at most one overlaps compute;
* a callback queued on the autograd engine runs when the whole backward ends: it completes groups whose
  gradients never all arrived (unused parameters), waits for every ReduceScatter and points each
  sharded parameter's ``.grad`` at its piece of the reduced gradient.
* ``set_reshard_after_backward(False)`` (with ``set_reshard_after_forward(False)``) keeps a group gathered
  through backward and its end, so the micro-batches of a pipeline step gather once (MPMD's ``gather_once``).

What to prefetch, free and keep is the root's :class:`~lightning_vescale.engine.schedule.StepSchedule` (built
from the groups' settings and the order recorded in the first step, again at each step), which the dry run walks
too (see [Note: one schedule]); the hooks carry it out.

The first group whose forward runs is the root. Its lazy initialization checks that every rank
computed the same plans (invariant 4) before any training happens. Before each forward, and again when
backward starts, the root frees the sharded gradient storage of buffers whose gradients the user set to
None (``zero_grad(set_to_none=True)``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import logging
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils._pytree import tree_flatten, tree_map

from lightning_vescale.engine import (
    collectives,
    optim_states,  # noqa: F401 - loaded optimizer states take their parameter's layout
)
from lightning_vescale.engine.param_group import SHARDED_ORIGINALS, ParamGroup, TrainingState
from lightning_vescale.engine.planner import Granularity
from lightning_vescale.engine.policies import MixedPrecisionPolicy
from lightning_vescale.engine.schedule import GroupSettings, StepSchedule, default_backward_prefetch, root_done_early
from lightning_vescale.engine.tensor import is_ragged

logger = logging.getLogger(__name__)

__all__ = ["GranularityByPattern", "VeScaleModule", "fully_shard", "get_state", "granularity_by_pattern", "sharded_groups"]

GranularityArg = Union[None, Granularity, Mapping[str, Granularity], Callable[[str, nn.Parameter], Granularity]]


# --------------------------------------------------------------------------------------------------------
# Mesh and device


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs an initialized process group: call torch.distributed.init_process_group() "
            "(or launch with torchrun / the Lightning strategy) before sharding, or pass mesh=..."
        )
    backend = dist.get_backend()
    if backend == "gloo" or not torch.accelerator.is_available():
        device_type = "cpu"
    else:
        accelerator = torch.accelerator.current_accelerator()
        assert accelerator is not None  # is_available()
        device_type = accelerator.type
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = torch.get_device_module(mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def _resolve_mesh(mesh: Optional[DeviceMesh]) -> tuple[DeviceMesh, dist.ProcessGroup, Optional[dist.ProcessGroup]]:
    mesh = mesh if mesh is not None else _default_mesh()
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.DeviceMesh, got {type(mesh).__name__}")
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"this rank ({dist.get_rank()}) is not part of the mesh {mesh}: pass a mesh that contains every rank "
            f"that calls fully_shard on this module"
        )
    if mesh.ndim == 1:
        return mesh, mesh.get_group(0), None
    if mesh.ndim == 2:
        # HSDP: (replicate, shard). Shard within the inner dimension, average across the outer one.
        return mesh, mesh.get_group(1), mesh.get_group(0)
    raise ValueError(
        f"fully_shard takes a 1-D mesh (shard) or a 2-D mesh (replicate, shard) for HSDP, got a {mesh.ndim}-D mesh "
        f"with shape {tuple(mesh.shape)}"
    )


# --------------------------------------------------------------------------------------------------------
# Granularity


def _default_granularity(p: nn.Parameter) -> Granularity:
    return getattr(p, "_vescale_granularity", "element")


class ParameterNames:
    """The names ``model.named_parameters()`` gives, looked up by parameter object (every name of a tied one).

    A parameter replaced on its module after this was built (expert parallelism swaps each expert stack for
    this rank's block) is found by the module attribute that holds it now.
    """

    def __init__(self, model: nn.Module) -> None:
        self.by_id: dict[int, tuple[str, ...]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            self.by_id[id(p)] = self.by_id.get(id(p), ()) + (n,)
        self.modules = list(model.named_modules(remove_duplicate=False))

    def all(self, p: nn.Parameter, name: str) -> tuple[str, ...]:
        """Every model-level name of ``p``; ``(name,)`` (its name inside the sharded module) when ``p`` is not there."""
        full = self.by_id.get(id(p))
        if full is None:
            attr = name.rsplit(".", 1)[-1]
            found = tuple(f"{module_name}.{attr}" if module_name else attr for module_name, module in self.modules
                          if module._parameters.get(attr) is p)
            if found:
                self.by_id[id(p)] = full = found
        return (name,) if full is None else full

    def get(self, p: nn.Parameter, name: str) -> str:
        """The model-level name of ``p`` (the first, as ``named_parameters()`` gives it)."""
        return self.all(p, name)[0]

    def values(self) -> list[str]:
        return [n for names in self.by_id.values() for n in names]


class GranularityByPattern:
    """``{name glob: granularity}`` as a ``granularity`` callable, remembering which globs matched a parameter.

    The first glob matching a parameter's name gives its granularity; parameters no glob matches keep their
    ``_vescale_granularity`` attribute, or ``"element"``. Build it with :func:`granularity_by_pattern` to match
    the names ``model.named_parameters()`` gives (checked at once); a plain mapping passed to ``fully_shard``
    matches names relative to the module each call shards, and is checked at the first forward.
    """

    def __init__(self, patterns: Mapping[str, Granularity], names: Optional[ParameterNames] = None) -> None:
        bad = [k for k in patterns if not isinstance(k, str)]
        if bad:
            raise TypeError(f"granularity mapping keys must be name globs (str), got {bad}")
        self.patterns = dict(patterns)
        self.names = names
        self.matched: set[str] = set()

    @property
    def key(self) -> tuple:
        """Equal for equal mappings (a mapping passed anew to each ``fully_shard`` call is still one mapping)."""
        return tuple((k, repr(v)) for k, v in self.patterns.items()), self.names is None

    def __call__(self, name: str, p: nn.Parameter) -> Granularity:
        names = self.names.all(p, name) if self.names is not None else (name,)
        chosen = None
        for pattern, g in self.patterns.items():
            if any(fnmatch.fnmatchcase(n, pattern) for n in names):
                self.matched.add(pattern)
                if chosen is None:
                    chosen = (g,)
        return chosen[0] if chosen is not None else _default_granularity(p)

    def unmatched(self) -> list[str]:
        return [k for k in self.patterns if k not in self.matched]


def granularity_by_pattern(model: nn.Module, patterns: Mapping[str, Granularity]) -> GranularityByPattern:
    """A ``granularity`` for every ``fully_shard`` call on ``model`` that matches ``patterns`` (globs, first match
    wins) against the names ``model.named_parameters()`` gives, e.g. ``{"layers.*.feed_forward.*": 128}``.

    Call it on the model before sharding it. A glob that matches no parameter of ``model`` raises ``ValueError``
    naming it (a typo would otherwise leave the default granularity in place silently).
    """
    names = ParameterNames(model)
    by_pattern = GranularityByPattern(patterns, names)
    for name in names.values():
        by_pattern.matched.update(k for k in by_pattern.patterns if fnmatch.fnmatchcase(name, k))
    missing = by_pattern.unmatched()
    if missing:
        examples = names.values()[:4]
        raise ValueError(
            f"granularity pattern(s) {missing} match no parameter of {type(model).__name__}; patterns match the "
            f"names model.named_parameters() gives (e.g. {examples}). Fix or remove them."
        )
    by_pattern.matched.clear()  # count again what the fully_shard calls match
    return by_pattern


def _granularity_fn(granularity: GranularityArg) -> Callable[[str, nn.Parameter], Granularity]:
    if granularity is None:
        return lambda name, p: _default_granularity(p)
    if isinstance(granularity, GranularityByPattern):
        return granularity
    if callable(granularity):
        return granularity
    if isinstance(granularity, Mapping):
        return GranularityByPattern(granularity)
    return lambda name, p: granularity


def _unapplied_tiers(states: list[_VeScaleState]) -> list[str]:
    """Names of the parameters whose policy (``param._vescale_policy``, set by a plan) puts some state off the
    device (its ``tier`` mapping) but which no memory manager placed (``param._vescale_tiers_applied``)."""
    out = []
    for st in states:
        for mp in st.group.managed if st.group is not None else ():
            tiers = getattr(getattr(mp.sharded, "_vescale_policy", None), "tier", None) or {}
            if any(t != "device" for t in tiers.values()) and not getattr(mp.sharded, "_vescale_tiers_applied", False):
                out.append(mp.fqn)
    return out


def _warn_unapplied_tiers(states: list[_VeScaleState]) -> None:
    names = _unapplied_tiers(states)
    if names:
        warnings.warn(f"the plan places state of {len(names)} parameters ({', '.join(names[:3])}"
                      f"{', ...' if len(names) > 3 else ''}) on host or disk, but nothing applied it, so it all "
                      f"stays on the device: call lightning_vescale.memory.apply_memory_policy(model, [optimizer], "
                      f"MemoryPolicy(disk_dir=...)) once the optimizer exists (the strategies and recipes do)",
                      stacklevel=3)


def _check_patterns_matched(states: list[_VeScaleState]) -> None:
    """Every glob of a granularity mapping must have matched a parameter in some ``fully_shard`` call using it."""
    by_key: dict[tuple, list[GranularityByPattern]] = {}
    for state in states:
        if isinstance(state.granularity_fn, GranularityByPattern):
            by_key.setdefault(state.granularity_fn.key, []).append(state.granularity_fn)
    for fns in by_key.values():
        matched = set().union(*(fn.matched for fn in fns))
        missing = [k for k in fns[0].patterns if k not in matched]
        if missing:
            relative = fns[0].names is None
            raise ValueError(
                f"granularity pattern(s) {missing} matched no parameter in the {len(fns)} fully_shard call(s) given "
                f"the mapping {fns[0].patterns}. "
                + ("A mapping passed to fully_shard matches names relative to the module each call shards (e.g. "
                   "'feed_forward.w1.weight' in a block); lightning_vescale.granularity_by_pattern(model, mapping) "
                   "matches the model's own names. " if relative else "")
                + "Fix or remove the pattern(s)."
            )


# --------------------------------------------------------------------------------------------------------
# State


class _VeScaleState:
    """Per-module state: its group, its hooks, and for the root the whole model's bookkeeping."""

    def __init__(
        self, module: nn.Module, group: Optional[ParamGroup], mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy,
        granularity_fn: Optional[Callable] = None, prefetch: int = 1,
    ):
        self.module = module
        self.granularity_fn = granularity_fn  # checked at the root's lazy init (every glob matched something)
        self.group = group
        self.mesh = mesh
        self.mp_policy = mp_policy
        self.prefetch = prefetch  # how many groups ahead this group's hooks issue AllGathers
        # As FSDP2's _auto_reshard_after_forward: the root keeps its parameters from forward to backward (its
        # backward comes first) unless set_reshard_after_forward was called on it.
        self.auto_reshard_after_forward = True
        self.is_root: Optional[bool] = None
        self.root: Optional[_VeScaleState] = None
        # Gather the next group in backward order during this group's backward (see default_backward_prefetch).
        self.backward_prefetch = default_backward_prefetch(_mesh_device(mesh))
        # Set by set_modules_to_forward_prefetch / set_modules_to_backward_prefetch: these groups instead of the
        # next ones in the recorded order.
        self.forward_prefetch_states: Optional[list[_VeScaleState]] = None
        self.backward_prefetch_states: Optional[list[_VeScaleState]] = None
        # Root only:
        self.states: list[_VeScaleState] = []
        self.forward_order: list[_VeScaleState] = []
        # Backward runs in reverse order of the groups' *post*-forwards (as FSDP2 prefetches): the root's
        # pre-forward comes first, but the head it owns runs last, so its backward comes first.
        self.post_forward_order: list[_VeScaleState] = []
        self.order_recorded = False
        self.reduce_queue: list[ParamGroup] = []  # ReduceScatters in flight, oldest first
        self.callback_queued = False
        # The step's schedule (what the hooks prefetch and free), built from the settings and the recorded order;
        # dropped at each step and when a setting changes, so that it is built again from them.
        self._schedule: Optional[StepSchedule] = None
        self._names: dict[_VeScaleState, str] = {}  # each state's name in the schedule: its path under the root
        self._by_name: dict[str, _VeScaleState] = {}
        self._done_early = False  # the root's parameters all run after every other group's (see root_done_early)

    # -- lazy init ----------------------------------------------------------------------------------------
    def lazy_init(self) -> None:
        if self.is_root is not None:
            return
        self.is_root = True
        self.root = self
        for path, module in self.module.named_modules():
            state = get_state(module)
            if state is None:
                continue
            self._name_of(state, path)
            if state is not self:
                if state.is_root:
                    raise RuntimeError(
                        f"{type(module).__name__} ran forward on its own before its parent "
                        f"{type(self.module).__name__}; run the outermost sharded module's forward first"
                    )
                state.is_root = False
                state.root = self
            if state.group is not None:
                state.group.reduce_queue = self.reduce_queue
            self.states.append(state)
        if self.group is not None:
            self._done_early = root_done_early(
                [n for n, _ in self.module.named_modules(remove_duplicate=False)],
                [self._names[s] for s in self.states if s is not self and s.group is not None],
                [mp.fqn.rpartition(".")[0] for mp in self.group.managed])
        _check_patterns_matched(self.states)
        _verify_plans_agree(self.states, self.mesh)
        _warn_unapplied_tiers(self.states)
        logger.debug("lightning_vescale: root %s with %d groups", type(self.module).__name__, len(self.states))

    # -- the schedule (root only) ---------------------------------------------------------------------------
    def _name_of(self, state: _VeScaleState, path: Optional[str] = None) -> str:
        """``state``'s name in this root's schedule: its module's path (a module outside this root, listed by a
        ``set_modules_to_*_prefetch`` call, gets a name of its own)."""
        name = self._names.get(state)
        if name is None:
            name = path if path is not None else f"<outside {type(state.module).__name__} {len(self._names)}>"
            self._names[state] = name
            self._by_name[name] = state
        return name

    def _settings(self, root: _VeScaleState) -> GroupSettings:
        """This group's part in ``root``'s schedule, from its current settings."""
        group = self.group
        listed = (self.forward_prefetch_states, self.backward_prefetch_states)
        forward, backward = (None if states is None else tuple(root._name_of(s) for s in states) for states in listed)
        return GroupSettings(
            root._name_of(self), is_root=self is root,
            reshard_after_forward=group is None or group.reshard_after_forward,
            root_keeps=self.auto_reshard_after_forward, prefetch=self.prefetch, forward_prefetch=forward,
            backward_prefetch=self.backward_prefetch, backward_prefetch_targets=backward,
            backward_reads_params=group is None or group.backward_reads_params,
            reduces_in_flight=group.reduces_in_flight if group is not None else 0,
            reduces=group is not None and group.requires_grad_sync and any(b.requires_grad for b in group.buffers.values()),
            done_early=self is root and self._done_early,
        )

    @property
    def schedule(self) -> StepSchedule:
        """The root's schedule of the step (see [Note: one schedule]); built from the current settings when
        needed. Before the order is recorded (the first forward) only explicit prefetch lists apply."""
        assert self.root is self, "the schedule is the root's"
        if self._schedule is None:
            states = list(dict.fromkeys([*self.states, *self.forward_order, *self.post_forward_order]))
            for state in list(states):
                states += [s for s in (*(state.forward_prefetch_states or ()), *(state.backward_prefetch_states or ()))
                           if s not in states]
            settings = [state._settings(self) for state in states]
            recorded = self.order_recorded
            self._schedule = StepSchedule(
                settings, forward_order=[self._names[s] for s in self.forward_order] if recorded else [],
                backward_order=[self._names[s] for s in reversed(self.post_forward_order)] if recorded else [])
        return self._schedule

    def _states_named(self, names: list[str]) -> list[_VeScaleState]:
        return [self._by_name[n] for n in names]

    def _settings_changed(self) -> None:
        """Build the root's schedule again before it is next asked."""
        if self.root is not None:
            self.root._schedule = None

    # -- forward --------------------------------------------------------------------------------------------
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if self.is_root is None:
            self.lazy_init()
        root = self.root
        assert root is not None  # set by the root's lazy_init
        if _in_backward():
            # Activation-checkpoint recomputation: the group was gathered by pre-backward.
            if self.group is not None:
                self.group.unshard()
                self.group.wait_for_unshard()
            return args, kwargs
        if self.is_root:
            root._root_pre_forward()
        if self.group is not None:
            self.group.check_not_replaced()
            self.group.sync_requires_grad()
            self.group.training_state = TrainingState.FORWARD
            self.group.unshard()
            self.group.wait_for_unshard()
        if not root.order_recorded:
            root.forward_order.append(self)
        for nxt in root._states_named(root.schedule.forward_prefetch(root._name_of(self))):
            if nxt.group is not None:
                nxt.group.unshard(async_op=True)  # prefetch, overlapped with this group's compute
        if self.mp_policy.param_dtype is not None and self.mp_policy.cast_forward_inputs:
            args, kwargs = _cast_floating((args, kwargs), self.mp_policy.param_dtype)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        if _in_backward():
            return output
        root = self.root
        assert root is not None
        if not root.order_recorded:
            root.post_forward_order.append(self)
        if self.is_root and not root.order_recorded:
            root.order_recorded = True
            root._schedule = None  # from now on in the recorded order
        tensors = []
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward_hook, mode="any")
        if self.group is not None:
            self.group.forward_outputs = [weakref.ref(t) for t in tensors]
        if self.group is not None:
            self.group.training_state = TrainingState.IDLE
            # No output needs a gradient (evaluation, or a frozen module): no backward will come to free the
            # parameters, so free them now; the root otherwise keeps them for backward.
            if not tensors or root.schedule.frees_after_forward(root._name_of(self)):
                self.group.reshard(keep_for_backward=bool(tensors) and self.group.backward_reads_params)
        if self.is_root and self.mp_policy.output_dtype is not None:
            # Only the model's outputs: inner groups feed each other in param_dtype.
            output = _cast_floating(output, self.mp_policy.output_dtype)
        return output

    def _root_pre_forward(self) -> None:
        # A forward without a backward since the last one (e.g. evaluation) leaves no work behind.
        self._finish_backward()
        self._release_unused_grads()
        self._schedule = None  # this step's: from the settings as they are now

    def _release_unused_grads(self) -> None:
        """Free the sharded gradient storage the user released with ``zero_grad(set_to_none=True)``: checked
        before forward and again when backward starts (Lightning zeroes gradients between the two)."""
        for state in self.states:
            if state.group is not None:
                state.group.release_unused_grads()

    # -- backward -------------------------------------------------------------------------------------------
    def _pre_backward_hook(self, *unused: Any) -> None:
        root = self.root
        assert root is not None
        if not root.callback_queued:
            root.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(root._finish_backward)
            root._release_unused_grads()
            root._schedule = None  # settings changed since forward apply to this backward
        if self.group is None:
            return
        self.group.pre_backward()
        # Not from the root's (the schedule's rule): when backward reaches the head, every activation and the loss's
        # gradient over the vocabulary are alive (the step's peak); the next group gathers at its own pre-backward.
        for nxt in root._states_named(root.schedule.backward_prefetch(root._name_of(self))):
            group = nxt.group
            if group is not None and group.training_state is TrainingState.IDLE:
                group.unshard(async_op=True)

    def _finish_backward(self) -> None:
        """End of backward: complete every group, wait for all ReduceScatters, reshard everything."""
        if self.is_root is not True:
            return
        for state in reversed(self.forward_order or self.states):
            group = state.group
            if group is not None and group.training_state is TrainingState.PRE_BACKWARD:
                group.post_backward()
        for state in self.states:
            if state.group is not None:
                state.group.finalize_grads()
                if state.group.reshard_after_backward:
                    state.group.reshard()
                state.group.training_state = TrainingState.IDLE
        self.reduce_queue.clear()
        self.callback_queued = False


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


def _verify_plans_agree(states: list[_VeScaleState], mesh: DeviceMesh) -> None:
    """Invariant 4: every rank must have computed the same plans; fail loudly before training.

    The check runs over the mesh's own groups (each dimension in turn, so a 2-D mesh agrees as a whole), never
    the default group: a model on a sub-mesh must not wait for ranks that do not hold it.
    """
    text = "|".join(
        ",".join(p.fingerprint() for p in state.group.plans) if state.group is not None else "-" for state in states
    )
    digest = int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)
    if not dist.is_initialized():
        return
    device = _mesh_device(mesh)
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        n = dist.get_world_size(group)
        if n == 1:
            continue
        mine = torch.tensor([digest, len(states)], dtype=torch.int64, device=device)
        everyone = torch.empty(n * 2, dtype=torch.int64, device=device)
        collectives.all_gather_into_tensor(everyone, mine, group, kind="setup")
        rows = everyone.view(-1, 2).tolist()
        if any(row != rows[0] for row in rows):
            ranks = dist.get_process_group_ranks(group)
            bad = [ranks[i] for i, row in enumerate(rows) if row != rows[0]]
            raise RuntimeError(
                f"ranks computed different sharding plans (ranks {bad} differ from rank {ranks[0]}; [plan hash, number "
                f"of groups] per rank {ranks}: {rows}). Every rank must build the same model (same shapes, dtypes and "
                f"fully_shard calls in the same order) before the first forward."
            )


# --------------------------------------------------------------------------------------------------------
# Public API


def get_state(module: nn.Module) -> Optional[_VeScaleState]:
    return module.__dict__.get("_vescale_state")


def sharded_groups(module: nn.Module) -> list[ParamGroup]:
    """Every ParamGroup under ``module`` in ``module.modules()`` order."""
    groups = []
    for m in module.modules():
        state = get_state(m)
        if state is not None and state.group is not None:
            groups.append(state.group)
    return groups


if TYPE_CHECKING:
    _MixinBase = nn.Module  # VeScaleModule is mixed into the classes of modules
else:
    _MixinBase = object


class VeScaleModule(_MixinBase):
    """Methods added to every module that ``fully_shard`` was applied to (as FSDP2's ``FSDPModule``)."""

    def _vescale_states(self, recurse: bool) -> list[_VeScaleState]:
        modules = self.modules() if recurse else [self]
        return [s for s in (get_state(m) for m in modules) if s is not None]

    def _own_vescale_state(self) -> _VeScaleState:
        state = get_state(self)
        assert state is not None  # fully_shard set it
        return state

    def unshard(self, async_op: bool = False) -> None:
        """Gather this module's parameters (e.g. to run a submodule outside the usual forward)."""
        group = self._own_vescale_state().group
        if group is not None:
            group.unshard(async_op=async_op)
            if not async_op:
                group.wait_for_unshard()

    def reshard(self) -> None:
        """Free this module's unsharded parameters."""
        group = self._own_vescale_state().group
        if group is not None:
            group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With False, backward accumulates unsharded gradients locally and skips the ReduceScatter."""
        for state in self._vescale_states(recurse):
            if state.group is not None:
                state.group.requires_grad_sync = requires_gradient_sync
            state._settings_changed()

    def set_backward_prefetch(self, enabled: bool, *, recurse: bool = True) -> None:
        """Whether a group's backward starts the AllGather of the next group in backward order (default True on an
        accelerator, False on CPU: :func:`default_backward_prefetch`), so that it overlaps this group's compute.
        False keeps that group's unsharded parameters (and the backend's AllGather staging) out of the backward
        peak, at the cost of the overlap; the bytes sent are the same."""
        for state in self._vescale_states(recurse):
            state.backward_prefetch = enabled
            state._settings_changed()

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """Gather exactly ``modules`` (each sharded with ``fully_shard``) when this module's forward starts, as
        FSDP2's method of the same name: an explicit prefetch plan instead of the next ``prefetch`` groups in
        forward order. ``[]`` prefetches nothing from here."""
        state = self._own_vescale_state()
        state.forward_prefetch_states = _states_of(modules, "set_modules_to_forward_prefetch")
        state._settings_changed()

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """Gather exactly ``modules`` (each sharded with ``fully_shard``) when this module's backward starts, as
        FSDP2's method of the same name (on CPU too, where the default backward prefetch is off). ``[]``
        prefetches nothing from here."""
        state = self._own_vescale_state()
        state.backward_prefetch_states = _states_of(modules, "set_modules_to_backward_prefetch")
        state._settings_changed()

    def set_reduces_in_flight(self, count: int, *, recurse: bool = True) -> None:
        """How many groups' ReduceScatters may run while backward goes on (default 1 on an accelerator, 0 on CPU):
        each holds its unsharded gradient buffer (and the backend's staging copies) until it completes. 0 waits
        for each ReduceScatter where it is issued: no overlap, and no finished group's gradients in the backward
        peak."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"set_reduces_in_flight expects an int >= 0, got {count!r}")
        for state in self._vescale_states(recurse):
            if state.group is not None:
                state.group.reduces_in_flight = count
            state._settings_changed()

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Whether the groups free their gathered parameters after forward and gather them again for backward. As
        FSDP2's method, this applies to the root too (which otherwise keeps them, whatever ``fully_shard`` was given:
        its backward comes first): True there takes the root's gathered weights (the head) out of the loss's backward
        for one more AllGather of the root per step."""
        for state in self._vescale_states(recurse):
            state.auto_reshard_after_forward = False
            if state.group is not None:
                state.group.reshard_after_forward = reshard_after_forward
            state._settings_changed()

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """With False, the gathered parameters stay unsharded after backward (as FSDP2's method of the same name):
        with ``set_reshard_after_forward(False)`` too, several micro-batches (gradient accumulation, pipeline
        schedules) gather once and reuse the parameters, holding them unsharded in between; call
        :meth:`reshard` (or set True before the last backward) to free them."""
        for state in self._vescale_states(recurse):
            if state.group is not None:
                state.group.reshard_after_backward = reshard_after_backward

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context manager form of ``set_requires_gradient_sync(False)`` (what Accelerate expects)."""
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)


def _states_of(modules: Any, method: str) -> list[_VeScaleState]:
    if isinstance(modules, nn.Module) or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(f"{method} expects a list of modules, got {modules!r}")
    states = []
    for m in modules:
        state = get_state(m)
        if state is None:
            raise ValueError(f"{method}: {type(m).__name__} is not sharded; pass modules that fully_shard was applied to")
        states.append(state)
    return states


def _add_vescale_class(module: nn.Module) -> None:
    cls = type(module)
    if issubclass(cls, VeScaleModule):
        return
    # The user's class name stays (repr, Lightning's summary, the "architectures" Hugging Face writes into a
    # config); isinstance(module, VeScaleModule) tells a sharded module.
    new_cls = type(cls.__name__, (VeScaleModule, cls), {"__qualname__": cls.__qualname__})
    new_cls.__module__ = cls.__module__
    module.__class__ = new_cls


def _collect_params(module: nn.Module) -> list[tuple[str, nn.Parameter, list]]:
    """The parameters of ``module`` not taken by a sharded submodule, with every (module, name) using them."""
    owned_elsewhere: dict[int, str] = {}
    for name, sub in module.named_modules():
        state = get_state(sub)
        if state is not None and sub is not module and state.group is not None:
            for mp in state.group.managed:
                owner_fqn = f"{name}.{mp.fqn}" if name else mp.fqn
                owned_elsewhere[id(mp.sharded)] = owner_fqn
                original = mp.original() if mp.original is not None else None
                if original is not None:
                    owned_elsewhere[id(original)] = owner_fqn
    found: dict[int, tuple[str, nn.Parameter, list]] = {}
    for mod_name, sub in module.named_modules(remove_duplicate=False):
        for pname, param in list(sub._parameters.items()):
            if param is None:
                continue
            fqn = f"{mod_name}.{pname}" if mod_name else pname
            if id(param) in owned_elsewhere:
                # The sharded submodule's own references are expected; any other one is a tie across groups.
                owner_fqn = owned_elsewhere[id(param)]
                if fqn != owner_fqn:
                    raise ValueError(
                        f"parameter {fqn} is the same tensor as {owner_fqn}, which a nested fully_shard already "
                        f"sharded. Tied parameters must be sharded by one group that contains every module using "
                        f"them: don't call fully_shard on the submodule that owns {owner_fqn} separately (or untie)."
                    )
                continue
            if is_ragged(param):
                raise ValueError(
                    f"parameter {fqn} of {type(module).__name__} is already sharded (a RaggedTensor): fully_shard was "
                    f"applied to a module above it first. Apply fully_shard bottom-up, like FSDP2: each block first, "
                    f"then the root; a module below a sharded one cannot be sharded afterwards."
                )
            earlier = SHARDED_ORIGINALS.get(param)
            if earlier is not None:
                raise ValueError(
                    f"parameter {fqn} of {type(module).__name__} is the same tensor as {earlier}: a parameter tied "
                    f"across two groups would be untied (each group would train its own copy). Shard every module "
                    f"using it in one group: call fully_shard on their common parent only, not on each of them."
                )
            if id(param) in found:
                found[id(param)][2].append((sub, pname))
            else:
                found[id(param)] = (fqn, param, [(sub, pname)])
    return list(found.values())


# [Note: the embeddings apart]
# The FSDP2 idiom (each block, then the model) leaves the token embedding in the root group with the norm and the
# head. The root is gathered from its pre-forward to the end of backward, and its flat gradient buffer is allocated
# at its first gradient (the head's, when backward starts) while the embedding's part is written only at the very
# end: the embedding's gathered weight sat in the forward and backward peaks and its gradient in the backward peak
# (dense bench, 2 ranks: 1.014x FSDP2's peak RSS). ``nn.Embedding``'s backward reads the indices, not the weight,
# so as a group of its own (as the default plan makes it) it is freed after forward, not gathered for backward
# (``ParamGroup.backward_reads_params``), and its gradient buffer lives only through its own backward; the root
# (norm and head) reduces as soon as the head's backward is done. Measured: benchmarks/results/train_idiom.md.
# A weight the model also reads outside the embedding's forward must be tied by parameter (then it is not split:
# the tie is seen) or the call must pass ``split_embeddings=False``; reading the sharded weight otherwise raises.
def _embeddings_apart(module: nn.Module, params: list[tuple[str, nn.Parameter, list]]) -> list[tuple[str, nn.Module]]:
    """The submodules of ``module`` running ``nn.Embedding``'s own forward whose parameters are all in ``params``
    (not owned by a sharded submodule) and used by them alone, by name; none when nothing else would be left in
    ``module``'s group."""
    uses = {id(p): [m for m, _ in u] for _, p, u in params}
    found = []
    for name, sub in module.named_modules():
        if sub is module or type(sub).forward is not nn.Embedding.forward or get_state(sub) is not None:
            continue
        own = list(sub.parameters())
        if own and all(uses.get(id(p)) == [sub] for p in own):
            found.append((name, sub))
    taken = {id(p) for _, sub in found for p in sub.parameters()}
    return found if any(id(p) not in taken for _, p, _ in params) else []


def _prefixed(fn: Callable[[str, nn.Parameter], Granularity], prefix: str) -> Callable[[str, nn.Parameter], Granularity]:
    """``fn`` for a submodule's parameters: names relative to the module given to ``fully_shard``."""
    return lambda name, p: fn(f"{prefix}.{name}", p)


def fully_shard(
    module: nn.Module,
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: bool = True,
    mp_policy: Optional[MixedPrecisionPolicy] = None,
    granularity: GranularityArg = None,
    gradient_divide_factor: Optional[float] = None,
    norm_group: Optional[Union[dist.ProcessGroup, DeviceMesh]] = None,
    prefetch: int = 1,
    split_embeddings: bool = True,
) -> nn.Module:
    """Shard ``module``'s parameters over ``mesh`` in one group, laid out by the planner into DBuffers.

    Apply it bottom-up, like FSDP2: each transformer block first, then the root. Each call takes the
    parameters of ``module`` that no sharded submodule already owns and makes them one group: one
    AllGather before the group's forward (prefetched one group ahead), one ReduceScatter after its
    backward. The module's parameters become :class:`~lightning_vescale.engine.tensor.RaggedTensor` s: they report
    the full shape, hold this rank's piece (a view into the group's DBuffer, ``p.to_local()``), and run
    elementwise ops on it, so an ordinary ``torch.optim`` optimizer built on ``model.parameters()`` steps only
    what this rank owns while code that reads ``p.shape`` / ``p.dim()`` sees the unsharded model.

    Args:
        module: the module to shard, in place. Its class gains :class:`VeScaleModule`'s methods
            (``set_requires_gradient_sync``, ``no_sync``, ``unshard``, ``reshard``).
        mesh: a 1-D mesh to shard over, or a 2-D (replicate, shard) mesh for HSDP. Defaults to every rank
            of the default process group on the backend's device type.
        reshard_after_forward: free the gathered parameters after forward and gather again for backward
            (ZeRO-3). False keeps them until backward ends (ZeRO-2-like: more memory, one AllGather less).
            The root module's parameters are not freed between its forward and backward unless
            ``set_reshard_after_forward(True)`` is called on it (as FSDP2). A module whose
            parameters are used only by ``nn.Embedding`` s is not gathered again: their backward reads no weight.
        mp_policy: mixed precision; the local pieces keep the original dtype (fp32 master weights).
        granularity: the cut granularity per parameter, a unit no rank boundary may split (see
            :func:`~lightning_vescale.engine.planner.granule`): ``"element"`` (default, least padding); for matrices,
            ``"row"`` (a row), an int ``k`` (blocks of ``k`` rows, the last block of a matrix holding what
            remains: 128 keeps 128x128 quantization blocks whole) or ``"matrix"`` (a whole matrix, as Muon
            wants); ``"tensor"`` (the whole tensor). A 3-D ``(E, rows, cols)`` parameter is a stack of ``E``
            matrices (fused experts): ``"row"``, ``k`` and ``"matrix"`` apply to each expert's matrix. 1-D
            parameters have no rows and stay element-granular unless given ``"tensor"``. Also a mapping of name
            globs to those (names relative to ``module``; every glob must match some parameter, checked at the
            first forward; :func:`granularity_by_pattern` matches model-level names), or a callable
            ``(name, param) -> granularity``. A parameter attribute ``_vescale_granularity`` is the default.
        gradient_divide_factor: the group's reduced gradient is the sum over the mesh's ranks divided by this.
            ``None`` (default) divides by the number of ranks summed over (the mean over data-parallel
            ranks). Expert weights sharded over the dp mesh of a (dp, ep) mesh already sum the tokens of
            their ep group through the all-to-all, so they need ``dp * ep`` (see
            :func:`lightning_vescale.parallel.fully_shard_expert_parallel`).
        norm_group: for parameters that are blocks of a larger tensor (``param._vescale_global_extent = (global
            shape, flat offset)``, as :func:`~lightning_vescale.parallel.apply_expert_parallel` sets on each rank's
            expert stack): a process group or 1-D mesh of every rank holding a piece of such a tensor, each element
            on exactly one of them. The sharded parameter is then laid out as the larger tensor over it (its
            shape, reductions such as :func:`~lightning_vescale.clip_grad_norm_`, ``full_tensor()`` and
            checkpoints see the whole tensor). ``None`` (default): every parameter is its own tensor.
        prefetch: how many groups ahead (in forward order, and in reverse order during backward) this
            module's hooks issue AllGathers, overlapping them with its compute. ``1`` (default) as FSDP2; ``0``
            gathers each group only when it runs (least memory); more hides longer collectives behind short
            groups at the cost of that many more gathered groups in memory.

    Returns:
        ``module``, sharded in place.

    .. note::
        Parameters on the meta device get an uninitialized local piece; call
        :func:`lightning_vescale.init_sharded_weights` (or ``init_weights`` of the model through it) to fill them with
        exactly the values an unsharded init with the same seed gives. Tied parameters must be owned by one
        group containing all their uses. Calling ``fully_shard`` twice on one module raises.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    if get_state(module) is not None:
        raise ValueError(
            f"{type(module).__name__} is already sharded by fully_shard; call fully_shard once per module "
            f"(submodules first, then the root)"
        )
    mp_policy = mp_policy or MixedPrecisionPolicy()
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be a number of groups >= 0 (0: no prefetch), got {prefetch!r}")
    if gradient_divide_factor is not None and not gradient_divide_factor > 0:
        raise ValueError(f"gradient_divide_factor must be > 0, got {gradient_divide_factor}")
    if isinstance(norm_group, DeviceMesh):
        if norm_group.ndim != 1:
            raise ValueError(
                f"norm_group must be a process group or a 1-D mesh, got a {norm_group.ndim}-D mesh; pass its "
                f"flattened mesh (or a 1-D mesh of the same ranks)"
            )
        norm_group = norm_group.get_group()
    mesh, shard_group, replicate_group = _resolve_mesh(mesh)
    device = _mesh_device(mesh)
    params = _collect_params(module)
    granularity_fn = _granularity_fn(granularity)
    if split_embeddings:
        apart = _embeddings_apart(module, params)
        for prefix, sub in apart:
            fully_shard(sub, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                        granularity=_prefixed(granularity_fn, prefix), gradient_divide_factor=gradient_divide_factor,
                        norm_group=norm_group, prefetch=prefetch, split_embeddings=False)
        if apart:
            params = _collect_params(module)
    for fqn, param, _ in params:
        if not param.is_meta and param.device.type not in (device.type, "cpu"):
            raise ValueError(
                f"parameter {fqn} is on {param.device} but the mesh is on {mesh.device_type}: move the module "
                f"to the mesh's device type (or to CPU / meta) before fully_shard"
            )
    group = None
    if params:
        group = ParamGroup(
            module, params, shard_group=shard_group, replicate_group=replicate_group, device=device,
            mp_policy=mp_policy, granularity_fn=granularity_fn,
            reshard_after_forward=reshard_after_forward, gradient_divide_factor=gradient_divide_factor,
            norm_group=norm_group, mesh=mesh,
        )
    # Buffers are replicated: move the ones this module owns directly to the mesh's device.
    for sub in module.modules():
        if sub is not module and get_state(sub) is not None:
            continue
        for name, buf in list(sub._buffers.items()):
            if buf is not None and not buf.is_meta and buf.device != device:
                sub._buffers[name] = buf.to(device)
    state = _VeScaleState(module, group, mesh, mp_policy, granularity_fn, prefetch)
    module.__dict__["_vescale_state"] = state
    if group is not None:
        # load_state_dict(assign=True) replaces parameters: take their values once the load is done (see
        # [Note: parameters replaced on a sharded module]).
        module.register_load_state_dict_post_hook(lambda _module, _keys: group.adopt_assigned())
    module.register_forward_pre_hook(state.pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(state.post_forward, prepend=False, with_kwargs=True, always_call=False)
    _add_vescale_class(module)
    return module

"""ParamGroup: the parameters of one ``fully_shard``-ed module, gathered and reduced together.

A group owns one :class:`DBuffer` per (dtype, requires_grad): usually a single buffer, so one
AllGather and one ReduceScatter per group. Each original parameter becomes

* a *sharded* ``nn.Parameter`` registered on the module(s) that used it — a
  :class:`~lightning_vescale.engine.tensor.RaggedTensor` of the global shape wrapping a view into the DBuffer's
  local piece; this is what ``model.parameters()`` yields and what the optimizer steps. Its ``.grad`` is
  a RaggedTensor of the same layout on the DBuffer's local gradient piece;
* an *unsharded* ``nn.Parameter`` — a view into the DBuffer's unsharded buffer, swapped onto the
  module(s) while the group is gathered, whose ``.grad`` is a view into the unsharded gradient buffer.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_vescale.engine import collectives
from lightning_vescale.engine.dbuffer import BufferState, DBuffer
from lightning_vescale.engine.group_plan import BufferKind, ParamEntry, buffer_kind_of, plan_group_buffers
from lightning_vescale.engine.planner import BufferPlan, Granularity
from lightning_vescale.engine.policies import MixedPrecisionPolicy
from lightning_vescale.engine.schedule import REDUCES_IN_FLIGHT, default_reduces_in_flight  # noqa: F401 - their old home
from lightning_vescale.engine.tensor import OuterShard, RaggedLayout, RaggedTensor, _contiguous_strides, piece_of

logger = logging.getLogger(__name__)

__all__ = ["ParamGroup", "TrainingState"]


class TrainingState(Enum):
    """Where a group is in the training step."""

    IDLE = auto()
    FORWARD = auto()
    """Between pre-forward and post-forward."""
    PRE_BACKWARD = auto()
    """Backward reached the group's outputs; gradients are accumulating into the unsharded buffer."""
    POST_BACKWARD = auto()
    """Every gradient of the group arrived; the ReduceScatter was issued."""


@dataclass
class _ManagedParam:
    fqn: str
    uses: list  # [(module, attr_name)] — more than one for tied parameters
    key: tuple  # (dtype, requires_grad)
    outer: Optional[OuterShard] = None  # tensor parallelism: the parameter was a DTensor on another mesh
    index: int = -1
    layout: Optional[RaggedLayout] = None
    sharded: nn.Parameter = field(init=False)  # set by ParamGroup._build (or the buffer kind) after construction
    grad: Optional[RaggedTensor] = None  # the sharded gradient: a RaggedTensor on the DBuffer's local_grad
    hooked: bool = False  # the post-accumulate-grad hook is registered (once the parameter requires grad)
    requires_grad: bool = False  # the flag both parameter objects had when last synchronized
    unsharded: nn.Parameter = field(init=False)  # likewise
    original: Optional[weakref.ref] = None  # the parameter before sharding, to detect ties across groups


SHARDED_ORIGINALS: weakref.WeakKeyDictionary[torch.Tensor, str] = weakref.WeakKeyDictionary()
"""Every parameter ``fully_shard`` has replaced, with where it went: another group that meets it again (a tie
across groups) is refused by name instead of silently untying the copies."""


def _piece_of_other_mesh(param: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel DTensor's local tensor (what fully_shard shards, see [Note: tensor-parallel parameters]),
    else the parameter itself."""
    return param._local_tensor if isinstance(param, DTensor) else param


def _set_param(module: nn.Module, name: str, param: nn.Parameter) -> None:
    # Bypass nn.Module.__setattr__ checks: swapping parameter objects is the point here.
    module._parameters[name] = param


GranularityFn = Callable[[str, nn.Parameter], Granularity]

def backward_reads_params(modules: list[nn.Module]) -> bool:
    """Whether backward through ``modules`` reads the values of their parameters. False only when every one runs
    ``nn.Embedding``'s own forward: autograd keeps the indices and the weight's size for its backward, not the
    weight, so a group of embeddings need not be gathered for backward (only its gradient buffer is needed)."""
    return not modules or not all(type(m).forward is nn.Embedding.forward for m in modules)


class ParamGroup:
    """The parameters of one sharded module and the DBuffers that hold them."""

    def __init__(
        self,
        module: nn.Module,
        params: list[tuple[str, nn.Parameter, list]],
        *,
        shard_group: Optional[dist.ProcessGroup],
        replicate_group: Optional[dist.ProcessGroup],
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        granularity_fn: GranularityFn,
        reshard_after_forward: bool,
        gradient_divide_factor: Optional[float] = None,
        norm_group: Optional[dist.ProcessGroup] = None,
        mesh: Optional[DeviceMesh] = None,
    ) -> None:
        self.module = module
        self.mesh = mesh  # what the sharded parameters report as their device_mesh (with its shard dim)
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.gradient_divide_factor = gradient_divide_factor
        self.norm_group = norm_group
        self.device = device
        self.mp_policy = mp_policy
        self.reshard_after_forward = reshard_after_forward
        # False keeps the parameters gathered after backward too (pipeline micro-batches: gather once per step)
        self.reshard_after_backward = True
        self.requires_grad_sync = True
        self.training_state = TrainingState.IDLE
        self.world_size = dist.get_world_size(shard_group)
        self.rank = dist.get_rank(shard_group)
        self.needs_init = False
        self.managed: list[_ManagedParam] = []
        self.buffers: dict[tuple, DBuffer] = {}
        self._grad_count = 0
        self._grad_expected = 0
        self._grads_bound = False  # this backward's gradient buffers are allocated and bound as .grad
        # Shared by all groups of a root: ReduceScatters in flight, oldest first (at most REDUCES_IN_FLIGHT
        # while compute runs), so the unsharded gradient buffers of finished groups are freed during backward.
        self.reduce_queue: list[ParamGroup] = []
        self.reduces_in_flight = default_reduces_in_flight(device)
        # Called with the group once its gradients are reduced (the memory manager reads optimizer states ahead).
        self.grads_reduced_hooks: list[Callable[[ParamGroup], None]] = []
        self._build(params, granularity_fn)
        # False (embeddings only): freed after forward (reshard_after_forward) and never gathered for backward.
        self.backward_reads_params = backward_reads_params([m for mp in self.managed for m, _ in mp.uses])
        self._frozen_in_use = False  # frozen buffers stay gathered until backward has used them (see below)
        # The outputs of the last forward that backward may still reach (weak: a discarded output cannot).
        self.forward_outputs: list[weakref.ref] = []
        if any(not mp.requires_grad for mp in self.managed):
            module.register_forward_pre_hook(self._watch_inputs_for_backward, with_kwargs=True)

    # -- construction -----------------------------------------------------------------------------------
    def _build(self, params, granularity_fn: GranularityFn) -> None:
        originals: dict[str, nn.Parameter] = {}
        entries = []
        for fqn, param, _ in params:
            originals[fqn] = param
            entries.append(ParamEntry(fqn, tuple(_piece_of_other_mesh(param).shape), param.dtype, param.requires_grad,
                                      granularity_fn(fqn, param), buffer_kind_of(fqn, param)))
        try:
            planned = plan_group_buffers(entries, self.world_size, self.mp_policy)
        except ValueError as e:
            raise ValueError(f"cannot shard the parameters of {type(self.module).__name__}: {e}") from None
        for entry, (fqn, param, _) in zip(entries, params):
            if entry.kind is not None and isinstance(param, DTensor):
                raise ValueError(f"parameter {fqn} is declared block-quantized and is a tensor-parallel DTensor: "
                                 f"block quantization with tensor parallelism is not supported yet; quantize the "
                                 f"weights of modules without tensor parallelism only")
        key_of = {name: gb.key for gb in planned for name in gb.names}
        for fqn, param, uses in params:
            self.managed.append(_ManagedParam(fqn, uses, key_of[fqn], outer=self._outer_shard(fqn, param)))
        kinds: dict[tuple, Optional[BufferKind]] = {}
        for gb in planned:
            kwargs: dict[str, Any] = dict(
                group=self.shard_group, device=self.device, dtype=gb.dtype, param_dtype=gb.param_dtype,
                reduce_dtype=gb.reduce_dtype, requires_grad=gb.requires_grad, replicate_group=self.replicate_group,
                gradient_divide_factor=self.gradient_divide_factor,
            )
            kinds[gb.key] = gb.kind
            self.buffers[gb.key] = DBuffer(gb.plan, **kwargs) if gb.kind is None else gb.kind.make_buffer(
                gb.plan, gb, world_size=self.world_size, **kwargs)
        for mp in self.managed:
            mp.index = self.buffers[mp.key].plan.index_of(mp.fqn)
        layouts = self._layouts(originals)
        for mp in self.managed:
            buf = self.buffers[mp.key]
            orig = originals[mp.fqn]
            mp.original = weakref.ref(orig)
            SHARDED_ORIGINALS[orig] = f"{mp.fqn} of the {type(self.module).__name__} sharded by an earlier fully_shard"
            if not buf.holds_master_pieces:
                kind = kinds[mp.key]
                assert kind is not None  # only a buffer kind keeps its own storage
                kind.make_parameters(self, mp, buf, orig)  # a kind with its own storage
                self._use_sharded(mp)
                continue
            local = buf.local_view(mp.index)
            if orig.is_meta:
                self.needs_init = True
            else:
                start, end = buf.plan.piece(mp.index, buf.rank)
                source, order = _piece_of_other_mesh(orig).detach(), layouts[mp.fqn].order
                with torch.no_grad():
                    local.view(-1).copy_(source.reshape(-1)[start:end] if order is None else order.take(source, start, end))
            mp.layout = layouts[mp.fqn]
            mp.sharded = nn.Parameter(RaggedTensor(local, mp.layout), requires_grad=orig.requires_grad)
            for attr, value in vars(orig).items():  # user declarations such as _vescale_expert_stack
                if attr.startswith("_vescale_"):
                    setattr(mp.sharded, attr, value)
            mp.unsharded = nn.Parameter(self._on_other_mesh(mp, buf.unsharded_view(mp.index)),
                                        requires_grad=orig.requires_grad)
            mp.requires_grad = orig.requires_grad
            if mp.unsharded.requires_grad:
                self._hook(mp)
            self._use_sharded(mp)
        self._grad_expected = sum(mp.unsharded.requires_grad for mp in self.managed)

    def _layouts(self, originals: dict[str, nn.Parameter]) -> dict[str, RaggedLayout]:
        """Each parameter's :class:`RaggedLayout`: its pieces over the shard group.

        A parameter that is a block of a larger tensor (a :class:`~lightning_vescale.engine.tensor.GlobalExtent` in
        ``_vescale_global_extent``, as expert parallelism sets on each rank's expert stack) is laid out as that
        larger tensor over ``norm_group``, whose ranks then hold every element once: its pieces are gathered there (one
        small all-gather of int64 ranges).
        """
        layouts: dict[str, RaggedLayout] = {}
        blocks = []
        for mp in self.managed:
            buf = self.buffers[mp.key]
            if not buf.holds_master_pieces:
                continue  # a storage of its own (quantized codes and scales) carries its own layouts
            extent = getattr(originals[mp.fqn], "_vescale_global_extent", None)
            if extent is None:
                shape = tuple(_piece_of_other_mesh(originals[mp.fqn]).shape)
                mesh, dim = self._reported_mesh(mp)
                layouts[mp.fqn] = RaggedLayout(shape, tuple(buf.plan.pieces(mp.index)), buf.group, buf.rank, mesh, dim,
                                               mp.outer, buf.element_order(mp.index))
            else:
                blocks.append((mp, extent))
        if not blocks:
            return layouts
        if self.norm_group is None:
            names = [mp.fqn for mp, _ in blocks]
            raise ValueError(
                f"parameters {names} declare a global extent (blocks of a larger tensor, as expert parallelism "
                f"makes them) but fully_shard got no norm_group: pass the group of every rank that holds a block"
            )
        mine = []
        for mp, extent in blocks:
            start, end = self.buffers[mp.key].plan.piece(mp.index, self.rank)
            mine += [extent.offset + start, extent.offset + end] if end > start else [0, 0]
        n = dist.get_world_size(self.norm_group)
        device = self.device
        everyone = torch.empty(n * len(mine), dtype=torch.int64, device=device)
        collectives.all_gather_into_tensor(everyone, torch.tensor(mine, dtype=torch.int64, device=device),
                                           self.norm_group, kind="setup")
        table = everyone.view(n, len(blocks), 2).tolist()
        me = dist.get_rank(self.norm_group)
        for i, (mp, extent) in enumerate(blocks):
            ranges = tuple((a, b) if b > a else (0, 0) for a, b in (table[q][i] for q in range(n)))
            shape = tuple(extent.shape)
            try:
                layouts[mp.fqn] = RaggedLayout(shape, ranges, self.norm_group, me)
            except ValueError as e:
                raise ValueError(
                    f"the blocks of {mp.fqn} over norm_group do not tile its global shape {tuple(shape)} ({e}); every "
                    f"block must be held by exactly one rank of norm_group"
                ) from None
        return layouts

    # [Note: tensor-parallel parameters]
    # A parameter that is a DTensor on another mesh (``parallelize_module`` over ``mesh["tp"]`` before ``fully_shard``
    # over ``mesh["dp"]``, as with FSDP2) is sharded as its local piece: the planner, the DBuffer and the
    # collectives see only that piece, the sharded parameter reports the whole tensor on the 2-D ``(dp, tp)`` mesh
    # with placements ``(RaggedShard, <its tp placement>)`` (an :class:`OuterShard` in its layout), and forward uses
    # a DTensor on the tp mesh whose local tensor is the gathered piece, so tensor parallelism's own hooks and
    # collectives run as they would without sharding. Gradients accumulate into the DBuffer through it.
    def _outer_shard(self, fqn: str, param: torch.Tensor) -> Optional[OuterShard]:
        if not isinstance(param, DTensor):
            return None
        other = param.device_mesh
        if other.ndim != 1 or len(param.placements) != 1:
            raise ValueError(f"parameter {fqn} is a DTensor on a {other.ndim}-D mesh with placements {param.placements}: "
                             f"fully_shard takes DTensors of tensor parallelism on a 1-D mesh (mesh['tp'])")
        placement = param.placements[0]
        if not (placement.is_shard() or placement.is_replicate()):
            raise ValueError(f"parameter {fqn} has placement {placement} on the tensor-parallel mesh; fully_shard takes "
                             f"Shard(dim) or Replicate() there")
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(param.shape, other, param.placements)
        return OuterShard(other, placement, tuple(param.shape), tuple(offset))

    def _reported_mesh(self, mp: _ManagedParam) -> tuple[Optional[DeviceMesh], int]:
        """The mesh a sharded parameter reports and its shard dim: the fully_shard mesh (HSDP: dim 1), or for a
        tensor-parallel parameter the mesh both meshes are slices of: 2-D (dp, tp), 3-D (replicate, shard, tp)
        for HSDP, or the 2-D slice (dp_ep, tp) of a (dp, ep, tp) mesh whose (dp, ep) dims were flattened."""
        if self.mesh is None:
            return None, 0
        if mp.outer is None:
            return self.mesh, self.mesh.ndim - 1
        root = self.mesh._get_root_mesh()
        names = root.mesh_dim_names or ()
        mine, theirs = self.mesh.mesh_dim_names or (), mp.outer.mesh.mesh_dim_names or ()
        reported: Optional[DeviceMesh] = None
        # The tp mesh's ranks must be the root's tp dimension (not the same object: torch hands out one cached slice
        # to two roots whose slices hold the same ranks).
        if (self.mesh.ndim <= 2 and len(mine) == self.mesh.ndim and len(theirs) == 1 and theirs[0] in names
                and torch.equal(root[theirs[0]].mesh, mp.outer.mesh.mesh)):
            if root.ndim == self.mesh.ndim + 1 and set(mine) <= set(names):
                reported = root
            else:
                try:  # a flattened data-parallel dimension: the slice of it and tp
                    reported = root[tuple(mine) + (theirs[0],)]
                except (KeyError, RuntimeError, ValueError):
                    reported = None
        if reported is None:
            raise ValueError(
                f"parameter {mp.fqn} is a DTensor on the mesh {mp.outer.mesh}, which is not the other dimension of the "
                f"mesh fully_shard shards over ({self.mesh}): make both slices of one 2-D mesh, e.g. mesh = "
                f"init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')); parallelize_module(..., mesh['tp']); "
                f"fully_shard(..., mesh=mesh['dp'])")
        if reported is root:
            return root, names.index(mine[-1])
        return reported, len(mine) - 1

    def _on_other_mesh(self, mp: _ManagedParam, view: torch.Tensor) -> torch.Tensor:
        """``view`` (a gathered piece or its gradient) as the DTensor forward uses for a tensor-parallel parameter."""
        if mp.outer is None:
            return view
        with torch.no_grad():
            return DTensor.from_local(view, mp.outer.mesh, [mp.outer.placement], run_check=False,
                                      shape=torch.Size(mp.outer.global_shape),
                                      stride=_contiguous_strides(mp.outer.global_shape))

    @property
    def plans(self) -> list[BufferPlan]:
        return [b.plan for b in self.buffers.values()]

    def sharded_params(self) -> list[nn.Parameter]:
        return [mp.sharded for mp in self.managed]

    # -- parameter swapping ----------------------------------------------------------------------------
    def _use_sharded(self, mp: _ManagedParam) -> None:
        for module, name in mp.uses:
            _set_param(module, name, mp.sharded)

    def _use_unsharded(self, mp: _ManagedParam) -> None:
        for module, name in mp.uses:
            _set_param(module, name, mp.unsharded)

    # [Note: parameters replaced on a sharded module]
    # The module must hold this group's own parameter objects: the optimizer steps them and the hooks swap them with
    # the gathered ones. ``load_state_dict(..., assign=True)`` (the FSDP2 tutorial's loading, torch's
    # ``set_model_state_dict`` on meta parameters) replaces them with the loaded tensors instead: once the load is
    # done, each group takes its pieces of the new values (a collective for a DTensor that is laid out otherwise;
    # every rank loads) and puts its own parameters back. Any other replacement is refused at the next forward,
    # naming the parameter, instead of training on one object while the optimizer holds another.
    def adopt_assigned(self) -> None:
        """Take the values (and ``requires_grad``) of parameters that ``load_state_dict(assign=True)`` put on the
        modules in place of this group's sharded parameters, and put the sharded parameters back."""
        for mp in self.managed:
            if mp.layout is None:
                continue  # block-quantized storage keeps its own loading
            for module, name in mp.uses:
                current = module._parameters.get(name)
                if current is mp.sharded or current is mp.unsharded:
                    continue
                if self.training_state is not TrainingState.IDLE:
                    raise RuntimeError(f"load_state_dict(assign=True) replaced {mp.fqn} during a training step: load "
                                       f"between steps")
                with torch.no_grad():
                    mp.sharded.copy_(current)
                mp.sharded.requires_grad_(current.requires_grad)
                self._use_sharded(mp)
                break

    def awaits_backward(self) -> bool:
        """Whether a backward may still come through this group's last forward (one of its outputs is alive)."""
        self.forward_outputs = [r for r in self.forward_outputs if r() is not None]
        return bool(self.forward_outputs)

    def check_not_replaced(self) -> None:
        """Raise if a module holds, in place of one of this group's parameters, a tensor set after ``fully_shard``."""
        for mp in self.managed:
            for module, name in mp.uses:
                current = module._parameters.get(name)
                if current is not mp.sharded and current is not mp.unsharded:
                    raise RuntimeError(
                        f"parameter {mp.fqn} of {type(self.module).__name__} was replaced after fully_shard (by a "
                        f"{type(current).__name__} of shape {tuple(current.shape) if current is not None else None}): "
                        f"the sharded model trains its own parameter objects. Tie or replace parameters before "
                        f"fully_shard (or the strategy's setup); load values with load_state_dict / copy_ under "
                        f"torch.no_grad()."
                    )

    def sync_requires_grad(self) -> None:
        """Follow ``requires_grad`` changes made on the sharded parameters since the last forward (freezing
        rules, Lightning's ``BackboneFinetuning``): the unsharded parameters used in forward get the same flag,
        and a buffer of parameters frozen at ``fully_shard`` time gets gradient storage when one is unfrozen."""
        changed = False
        for mp in self.managed:
            # The modules hold one of the two parameter objects at a time, so user code may have set either.
            want = mp.sharded.requires_grad
            if want == mp.requires_grad and mp.unsharded.requires_grad != mp.requires_grad:
                want = mp.unsharded.requires_grad
            if (mp.sharded.requires_grad, mp.unsharded.requires_grad) != (want, want):
                mp.sharded.requires_grad_(want)
                mp.unsharded.requires_grad_(want)
                changed = True
                if want:
                    self.buffers[mp.key].enable_grad()
                    self._hook(mp)
            mp.requires_grad = want
        if changed:
            self._grad_expected = sum(mp.unsharded.requires_grad for mp in self.managed)

    def _hook(self, mp: _ManagedParam) -> None:
        if not mp.hooked:
            mp.unsharded.register_hook(self._on_grad)  # runs before the gradient is accumulated into .grad
            mp.unsharded.register_post_accumulate_grad_hook(self._on_grad_accumulated)
            mp.hooked = True

    def _buffers_with_grads(self) -> list[DBuffer]:
        """The buffers with at least one parameter that requires a gradient now."""
        return [b for b in self.buffers.values() if any(
            mp.unsharded.requires_grad for mp in self.managed if self.buffers[mp.key] is b)]

    # -- unshard / reshard ------------------------------------------------------------------------------
    @property
    def is_unsharded(self) -> bool:
        return all(b.state is not BufferState.SHARDED for b in self.buffers.values())

    def unshard(self, async_op: bool = False) -> None:
        """Issue the group's AllGathers (one per buffer); ``wait_for_unshard`` before use."""
        for buf in self.buffers.values():
            buf.unshard(async_op=async_op)

    def wait_for_unshard(self) -> None:
        for buf in self.buffers.values():
            buf.wait_unshard()
        for mp in self.managed:
            self._use_unsharded(mp)

    def reshard(self, keep_for_backward: bool = False) -> None:
        """Free the gathered parameters; ``keep_for_backward``: after a forward whose backward gathers them again
        (a buffer with a gathered-parameters tier saves them there instead)."""
        for mp in self.managed:
            self._use_sharded(mp)
        for buf in self.buffers.values():
            buf.reshard(keep_for_backward)

    # -- backward ---------------------------------------------------------------------------------------
    def pre_backward(self) -> None:
        """Gather for backward and point the unsharded parameters' grads at the gradient buffer."""
        if self.training_state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
            return  # a module called twice in forward reaches backward twice
        self.finish_reductions(keep=self.reduces_in_flight)
        if self.backward_reads_params:
            self.unshard()
            self.wait_for_unshard()
        self._grad_count = 0
        self._grads_bound = False  # the gradient buffer comes with the first gradient (see the note below)
        self.training_state = TrainingState.PRE_BACKWARD
        self.forward_outputs = []

    # [Note: the gradient buffer comes with the first gradient]
    # Backward reaches a group's outputs (pre-backward) some time before it produces the group's first parameter
    # gradient: the loss's backward over the vocabulary before the root's head, an inner group's backward (the
    # experts) before the rest of its block. The unsharded gradient buffer is allocated, zeroed and bound as the
    # parameters' ``.grad`` only when the first gradient arrives (a tensor hook runs before autograd accumulates
    # it), so it is not held through that stretch; autograd then adds every gradient into its view in place, as
    # before. A group none of whose gradients arrived still reduces (zeros) at its post-backward, so every rank
    # issues the same ReduceScatters.
    def _on_grad(self, _grad: torch.Tensor) -> None:
        if self.training_state is TrainingState.PRE_BACKWARD and not self._grads_bound:
            self._bind_grads()

    def _bind_grads(self) -> None:
        """Allocate the gradient buffers (zeroed; kept as they are while accumulating under no-sync) and point the
        unsharded parameters' ``.grad`` at their views."""
        for buf in self._buffers_with_grads():
            buf.alloc_grad()
        for mp in self.managed:
            if mp.unsharded.requires_grad:
                mp.unsharded.grad = self._on_other_mesh(mp, self.buffers[mp.key].unsharded_grad_view(mp.index))
        self._grads_bound = True

    def _on_grad_accumulated(self, _param: torch.Tensor) -> None:
        self._grad_count += 1
        if self._grad_count == self._grad_expected and self.training_state is TrainingState.PRE_BACKWARD:
            self.post_backward()

    # [Note: frozen parameters in backward]
    # The last gradient of a group's trainable parameters can arrive before backward is done with its frozen
    # ones (a LoRA adapter's weight gradient before the input gradient through the frozen base weight, which
    # needs that weight). So a group with frozen parameters watches its forward inputs: once backward has
    # produced their gradients, nothing of the module is left to run, and the frozen buffers are freed then (or
    # at the end of backward when no input needs a gradient). Trainable buffers are freed as before.
    def _watch_inputs_for_backward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return
        inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        if inputs:
            self._frozen_in_use = True
            torch.autograd.graph.register_multi_grad_hook(inputs, self._inputs_done, mode="all")

    def _inputs_done(self, *unused) -> None:
        self._frozen_in_use = False
        if not self.reshard_after_backward:
            return
        if self.training_state is TrainingState.POST_BACKWARD or self._grad_expected == 0:
            for buf in self.buffers.values():
                if not buf.requires_grad:
                    buf.reshard()

    def post_backward(self) -> None:
        """Every gradient arrived: free the parameters and issue the ReduceScatter (unless no-sync)."""
        if self.training_state is not TrainingState.PRE_BACKWARD:
            return
        if not self._grads_bound:
            self._bind_grads()  # no gradient arrived: reduce zeros, as every other rank reduces its gradients
        self.training_state = TrainingState.POST_BACKWARD
        for mp in self.managed:
            mp.unsharded.grad = None  # the buffer stays; only the views are dropped
        # Without reshard_after_backward the parameters stay gathered for the next micro-batch.
        if self.reshard_after_backward and self._frozen_in_use:
            # Frozen buffers are freed once backward has used them (see the note above).
            for mp in self.managed:
                self._use_sharded(mp)
            for buf in self.buffers.values():
                if buf.requires_grad:
                    buf.reshard()
        elif self.reshard_after_backward:
            self.reshard()
        if not self.requires_grad_sync:
            return
        issued = False
        for buf in self.buffers.values():
            if buf.requires_grad and buf.grad_allocated:
                if not issued:
                    self.finish_reductions(keep=max(self.reduces_in_flight - 1, 0))
                buf.reduce_grad(accumulate=self._prepare_accumulation(buf), async_op=True)
                issued = True
        if issued:
            self.reduce_queue.append(self)
            if self.reduces_in_flight == 0:
                self.finish_reductions(keep=0)

    def finish_reductions(self, keep: int) -> None:
        """Finalize, oldest first, the groups in flight beyond the newest ``keep`` and any whose ReduceScatters
        have completed, freeing their unsharded gradient buffers (and the copy gloo keeps inside a
        ReduceScatter's handle until the handle is released)."""
        queue = self.reduce_queue
        while len(queue) > keep or (queue and all(b.reduce_completed for b in queue[0].buffers.values() if b.reducing)):
            queue.pop(0).finalize_grads()

    def release_unused_grads(self) -> None:
        """Free the sharded gradient storage of every buffer whose gradients the user all set to None
        (``zero_grad(set_to_none=True)``), so it does not stay allocated through the next forward and backward;
        the next ReduceScatter allocates it again (FSDP2 likewise allocates sharded gradients at reduction)."""
        for key, buf in self.buffers.items():
            if not buf.holds_master_pieces or buf.local_grad is None or buf.reducing:
                continue  # a storage of its own (frozen quantized weights) has no gradients
            mine = [mp for mp in self.managed if mp.key == key]
            if all(mp.sharded.grad is None for mp in mine):
                for mp in mine:
                    mp.grad = None
                buf.release_grad_piece()

    def _prepare_accumulation(self, buf: DBuffer) -> bool:
        """Whether the reduced gradient adds to existing ``.grad`` (no ``zero_grad`` in between)."""
        mine = [mp for mp in self.managed if self.buffers[mp.key] is buf]
        if all(mp.sharded.grad is None for mp in mine) or buf.local_grad is None:
            return False
        if buf.offload is not None:
            buf.offload.fetch_grad()  # the piece to add to, back from its tier
        with torch.no_grad():
            for mp in mine:
                view = buf.local_grad_view(mp.index)
                g = mp.sharded.grad
                if g is None:
                    view.zero_()
                elif g is not mp.grad:  # the user set .grad: take its piece
                    assert mp.layout is not None  # a buffer holding master pieces
                    view.view(-1).copy_(piece_of(g, mp.layout))
        return True

    def finalize_grads(self) -> None:
        """Wait for the ReduceScatters and point each sharded parameter's ``.grad`` at its piece."""
        reduced = False
        for buf in self.buffers.values():
            if buf.reducing:
                reduced = True
                buf.wait_reduce()
                for mp in self.managed:
                    if self.buffers[mp.key] is buf and mp.sharded.requires_grad:
                        if mp.grad is None:
                            mp.grad = RaggedTensor(buf.local_grad_view(mp.index), mp.layout)
                        mp.sharded.grad = mp.grad
                if buf.offload is not None:
                    buf.offload.after_reduce()  # the reduced piece to its tier (after its views exist)
        if reduced:
            for hook in self.grads_reduced_hooks:
                hook(self)
        if self.training_state is TrainingState.PRE_BACKWARD:
            # Backward ended before every gradient arrived (unused parameters): treat it as complete.
            self.post_backward()
            self.finalize_grads()
        self.training_state = TrainingState.IDLE

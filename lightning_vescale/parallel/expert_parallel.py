"""Expert parallelism: each rank of an EP group holds ``E / ep`` experts of every MoE layer.

:func:`apply_expert_parallel` changes a model built from :mod:`lightning_vescale.models.moe` in place:
every :class:`~lightning_vescale.models.moe.GroupedExperts` keeps only its rank's contiguous block of
experts (``w1_EDF[start:start + E/ep]``, same parameter names, smaller first dimension) and becomes an
:class:`ExpertParallelGroupedExperts`, whose ``run_experts`` sends each routed row to the rank that
owns its expert and brings the results back. The router, attention, shared experts and everything
else stay replicated (shard them with ``fully_shard`` as usual). The model file is untouched: this is
a class swap from outside, the way ``fully_shard`` swaps a module's class.

Shape suffixes: ``R`` routed rows this rank sends (its tokens times top-k), ``Q`` rows it receives,
``D`` model dim, ``E`` global experts, ``L`` local experts (``E / ep``), ``S`` source ranks (``ep``).

[Note: the dispatch]
The rows arrive at ``run_experts`` sorted by global expert id, with the per-expert counts. Experts are
owned in contiguous blocks, so rows bound for rank r are one contiguous slice:

1. exchange counts: an equal-split ``all_to_all_single`` of the ``E`` counts gives, for each source
   rank s and local expert l, how many rows s will send for l (``recv_counts_SL``);
2. dispatch: an uneven ``all_to_all_single`` of the rows (send splits: per-destination sums of this
   rank's counts; receive splits: per-source sums of ``recv_counts_SL``);
3. the received rows are ordered (source, local expert); a stable sort regroups them by local expert
   and the local experts run on them (the unsharded ``GroupedExperts.run_experts``);
4. combine: undo the sort and send every row back with the splits swapped.

Both all-to-alls are differentiable (:func:`all_to_all_single_autograd`: the backward of an
all-to-all is the all-to-all with the splits swapped), so gradients reach the input rows, the
routing weights and the local expert weights. A local expert's gradient sums the contributions of
every rank's tokens, as the full model's gradient on the union of the ranks' tokens would.

[Note: expert parallelism with sharding over dp]
On a 2-D mesh ``("dp", "ep")`` the experts of ep rank e are replicated over the dp ranks that share e,
so :func:`fully_shard_expert_parallel` shards them over ``mesh["dp"]`` only, in a group of their own,
and everything else over all ``dp * ep`` ranks. Two things differ from plain data parallelism:

* averaging: every rank's loss is the mean over its own batch, and the reference is the mean over the
  concatenated global batch, i.e. ``1/(dp*ep)`` times the sum of the per-rank losses. A non-expert
  gradient is summed over all ``dp*ep`` ranks and divided by ``dp*ep`` (the default). A local expert's
  gradient on one rank *already* sums the contributions of the ``ep`` ranks of its ep group (the
  all-to-all brings their tokens); the ReduceScatter over dp adds the other dp rows, so the sum covers
  all ``dp*ep`` ranks once, and the default division by the dp group size (``dp``) would leave it
  ``ep`` times too large. The expert group is therefore sharded with
  ``fully_shard(..., gradient_divide_factor=dp * ep)``.
* the layout: after that ReduceScatter each expert element lives on exactly one of the ``dp*ep`` ranks
  (ep picks the expert slice, dp the piece). ``fully_shard(..., norm_group=<all dp*ep ranks>)`` makes
  each sharded expert stack a RaggedTensor of the *full* expert shape ``(E, ...)`` laid out over all of
  them, so its shape, its reductions (``clip_grad_norm_`` sums each element once), ``full_tensor()``
  and checkpoints see every expert.

.. note::
    Apply it to a materialized full model whose experts are identical on the EP ranks (same seed or
    loaded checkpoint), before ``fully_shard``. If applied to a meta-device model, ``init_weights``
    afterwards draws each rank's local experts from its own RNG stream, which will not equal a
    single-process initialization. Sharded checkpoints (:mod:`lightning_vescale.checkpoint`) of an
    expert-parallel model hold the full expert tensors (all E experts; see its note on expert-parallel
    checkpoints); ``save_pretrained`` still refuses expert-parallel models.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Union, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.hooks import RemovableHandle

from lightning_vescale.engine.tensor import GlobalExtent
from lightning_vescale.models.moe import GroupedExperts, TopKRouter

__all__ = [
    "ExpertParallelGroupedExperts",
    "all_to_all_single_autograd",
    "apply_expert_parallel",
    "fully_shard_expert_parallel",
    "register_expert_bias_update",
]

_EXPERT_PARAMS = ("w1_EDF", "w2_EFD", "w3_EDF")


class _AllToAllSingle(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,  # a FunctionCtx, which carries attributes the stubs do not declare
        x: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: ProcessGroup,
    ) -> torch.Tensor:
        ctx.output_splits = output_splits
        ctx.input_splits = input_splits
        ctx.group = group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        grad_in = grad_out.new_empty((sum(ctx.input_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), ctx.input_splits, ctx.output_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all_single_autograd(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: ProcessGroup
) -> torch.Tensor:
    """Uneven ``all_to_all_single`` along dim 0 that autograd differentiates (backward swaps the splits).

    ``input_splits[r]`` rows of ``x`` go to rank r; ``output_splits[r]`` rows arrive from rank r.
    """
    return _AllToAllSingle.apply(x, output_splits, input_splits, group)


class ExpertParallelGroupedExperts(GroupedExperts):
    """A :class:`GroupedExperts` holding experts ``[expert_start, expert_start + num_experts)`` of
    ``num_global_experts``; its ``run_experts`` dispatches rows over ``ep_group`` (see the module note).

    Made by :func:`apply_expert_parallel`, never constructed directly.
    """

    ep_group: ProcessGroup
    ep_size: int
    expert_start: int
    num_global_experts: int

    def run_experts(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        ep, num_local = self.ep_size, self.num_experts
        # 1. Counts: recv_counts_SL[s, l] rows will come from rank s for local expert l.
        recv_counts_SL = torch.empty_like(num_tokens_per_expert_E)
        dist.all_to_all_single(recv_counts_SL, num_tokens_per_expert_E.contiguous(), group=self.ep_group)
        recv_counts_SL = recv_counts_SL.view(ep, num_local)
        input_splits = num_tokens_per_expert_E.view(ep, num_local).sum(dim=1).tolist()
        output_splits = recv_counts_SL.sum(dim=1).tolist()
        # 2. Dispatch.
        x_QD = all_to_all_single_autograd(x_RD, output_splits, input_splits, self.ep_group)
        # 3. Regroup (source, local expert) -> (local expert, source) and run the local experts.
        segment_Q = torch.repeat_interleave(
            torch.arange(ep * num_local, device=x_QD.device), recv_counts_SL.flatten()
        )
        source_Q, local_expert_Q = segment_Q // num_local, segment_Q % num_local
        by_expert_Q = torch.argsort(local_expert_Q * ep + source_Q, stable=True)
        y_QD = super().run_experts(x_QD[by_expert_Q], recv_counts_SL.sum(dim=0))
        y_QD = y_QD[torch.argsort(by_expert_Q)]
        # 4. Combine: every row goes back to the rank it came from, in its original place.
        return all_to_all_single_autograd(y_QD, input_splits, output_splits, self.ep_group)

    def forward_per_expert_loop(
        self, x_ND: torch.Tensor, selected_NA: torch.Tensor, weights_NA: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError("the per-expert reference needs every expert; run it on an unsharded model")

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, experts=[{self.expert_start}, {self.expert_start + self.num_experts}) "
            f"of {self.num_global_experts}, ep_size={self.ep_size}"
        )


def _resolve_group(ep_group: Union[ProcessGroup, DeviceMesh]) -> ProcessGroup:
    if isinstance(ep_group, DeviceMesh):
        if ep_group.ndim != 1:
            raise ValueError(
                f"expert parallelism needs a 1-D DeviceMesh, got a {ep_group.ndim}-D mesh "
                f"{ep_group.mesh_dim_names}; pass mesh['ep'] (the EP dimension)"
            )
        return ep_group.get_group()
    return ep_group


def apply_expert_parallel(model: nn.Module, ep_group: Union[ProcessGroup, DeviceMesh]) -> nn.Module:
    """Shard the routed experts of every MoE layer of ``model`` over ``ep_group``, in place.

    Rank r of the group keeps experts ``[r * E/ep, (r+1) * E/ep)`` of each
    :class:`~lightning_vescale.models.moe.GroupedExperts` (parameters of the same names, first
    dimension ``E/ep``) and computes them for the tokens of every rank of the group, through
    all-to-all dispatch and combine. Works with any backend that supports uneven
    ``all_to_all_single`` (NCCL, gloo) on the device the model is on.

    Args:
        model: a model containing ``GroupedExperts`` (e.g. :class:`~lightning_vescale.models.moe.MoE`),
            identical on every rank of the group.
        ep_group: the expert-parallel process group, or a 1-D ``DeviceMesh``.

    Returns:
        ``model`` itself.

    .. note::
        Raises ``ValueError`` if the model has no ``GroupedExperts``, if the number of experts is not
        divisible by the group size, or if it was already applied.
    """
    group = _resolve_group(ep_group)
    ep_size = dist.get_world_size(group)
    ep_rank = dist.get_rank(group)
    experts = [(name, m) for name, m in model.named_modules() if isinstance(m, GroupedExperts)]
    if not experts:
        raise ValueError(f"{type(model).__name__} has no GroupedExperts to shard over experts")
    for name, module in experts:
        if isinstance(module, ExpertParallelGroupedExperts):
            raise ValueError(f"{name} is already expert parallel; apply_expert_parallel only once")
        num_experts = module.num_experts
        if num_experts % ep_size != 0:
            raise ValueError(
                f"{name} has {num_experts} experts, which does not divide over an expert-parallel group of "
                f"{ep_size} ranks; use a group size that divides {num_experts}"
            )
        num_local = num_experts // ep_size
        start = ep_rank * num_local
        for param_name in _EXPERT_PARAMS:
            full = getattr(module, param_name)
            local = nn.Parameter(full.detach()[start : start + num_local].clone(), requires_grad=full.requires_grad)
            # A block of the full expert tensor: fully_shard lays the stack out as that tensor over every rank
            # holding a block (its norm_group), so the sharded parameter reports the full shape.
            extent = GlobalExtent(tuple(full.shape), start * math.prod(full.shape[1:]), group)
            local._vescale_global_extent = extent  # type: ignore[attr-defined]  # a declaration, read with getattr
            setattr(module, param_name, local)
        module.__class__ = ExpertParallelGroupedExperts
        ep_module = cast(ExpertParallelGroupedExperts, module)  # its class, from the line above
        ep_module.ep_group = group
        ep_module.ep_size = ep_size
        ep_module.expert_start = start
        ep_module.num_global_experts = num_experts
        ep_module.num_experts = num_local
    return model


def fully_shard_expert_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    dp_dim: str = "dp",
    ep_dim: str = "ep",
    dense_mesh: Optional[DeviceMesh] = None,
    blocks: Optional[Iterable[nn.Module]] = None,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """Expert parallelism over ``mesh[ep_dim]`` composed with ZeRO-3 sharding over ``mesh[dp_dim]``, in place.

    1. :func:`apply_expert_parallel` over ``mesh[ep_dim]`` (skipped if the model already is expert
       parallel over a group of that size);
    2. every expert module: ``fully_shard(experts, mesh=mesh[dp_dim], gradient_divide_factor=dp * ep,
       norm_group=dense_mesh)`` (see the module's note on why these two arguments);
    3. every block (``blocks``, default ``model.layers``), then ``model``: ``fully_shard(.., mesh=dense_mesh)``;
       an untied token embedding beside the blocks gets a group of its own, as the default plan of
       :func:`lightning_vescale.parallelize` gives it: in the root group its gradient buffer would live through
       the whole backward (and its weight, which its backward does not read, would stay gathered).

    On a 3-D ``(dp_dim, ep_dim, "tp")`` mesh, after the attention was split over ``mesh["tp"]`` with torch's
    ``parallelize_module`` (torchtitan's idiom), every module holding experts (a MoE feed-forward) runs on 1/tp of
    the sequence (``PrepareModuleInputOutput``: the plan's ``tp: split_tokens``) and is a group over every rank;
    the experts are sharded over the ``dp * tp`` ranks of their ep coordinate and the blocks over the ``dp * ep``
    ranks of a tp coordinate (see [Note: experts on ep, attention on tp] in
    :mod:`lightning_vescale.parallel.tensor_parallel`).

    Args:
        model: a model containing ``GroupedExperts``, identical on every rank.
        mesh: a 2-D mesh with dimensions ``dp_dim`` and ``ep_dim`` (e.g. ``init_device_mesh("cpu", (2, 2),
            mesh_dim_names=("dp", "ep"))``), or a 3-D one with ``"tp"`` last.
        dense_mesh: a 1-D mesh of all of ``mesh``'s ranks for the non-expert parameters (and the experts'
            gradient norm). Default: ``mesh`` flattened. Not with a tp dimension.
        blocks: the modules to shard as their own groups; default ``model.layers``.
        fully_shard_kwargs: passed to every ``fully_shard`` call (``mp_policy``, ``reshard_after_forward``,
            ``granularity``).

    Returns:
        ``model``.
    """
    from lightning_vescale.engine.fully_shard import fully_shard, get_state
    from lightning_vescale.plan import embedding_groups

    names = mesh.mesh_dim_names or ()
    with_tp = mesh.ndim == 3 and tuple(names) == (dp_dim, ep_dim, "tp")
    if not with_tp and (mesh.ndim != 2 or dp_dim not in names or ep_dim not in names):
        raise ValueError(
            f"fully_shard_expert_parallel needs a 2-D mesh with dimensions {dp_dim!r} and {ep_dim!r} (or a 3-D "
            f"({dp_dim!r}, {ep_dim!r}, 'tp') one), got {mesh.ndim}-D dimensions {names}"
        )
    for key in ("mesh", "gradient_divide_factor", "norm_group"):
        if key in fully_shard_kwargs:
            raise ValueError(f"fully_shard_expert_parallel chooses {key} itself; don't pass it")
    dp_mesh, ep_mesh = mesh[dp_dim], mesh[ep_dim]
    dp, ep = dp_mesh.size(), ep_mesh.size()
    every_rank = mesh._flatten()
    if with_tp:
        if dense_mesh is not None:
            raise ValueError("with a tp dimension the blocks are sharded over mesh[dp, ep] flattened: don't pass dense_mesh")
        dense_mesh, experts_mesh = mesh[dp_dim, ep_dim]._flatten(), mesh[dp_dim, "tp"]._flatten()
    else:
        dense_mesh, experts_mesh = dense_mesh if dense_mesh is not None else every_rank, dp_mesh
    if dense_mesh.ndim != 1 or dense_mesh.size() != dp * ep:
        raise ValueError(f"dense_mesh must be a 1-D mesh of the {dp * ep} ranks of mesh, got {dense_mesh}")
    embeddings = embedding_groups(model)  # before sharding: fully_shard gives each block a class of its own
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    if not any(isinstance(m, ExpertParallelGroupedExperts) for m in experts):
        apply_expert_parallel(model, ep_mesh)
    for module in experts:
        if not isinstance(module, ExpertParallelGroupedExperts) or module.ep_size != ep:
            raise ValueError(f"every GroupedExperts must be expert parallel over {ep} ranks ({ep_dim!r})")
        fully_shard(module, mesh=experts_mesh, gradient_divide_factor=dp * ep,
                    norm_group=every_rank if with_tp else dense_mesh, **fully_shard_kwargs)
    if with_tp:
        from torch.distributed.tensor.parallel import parallelize_module

        from lightning_vescale.parallel.tensor_parallel import tensor_parallel_style

        holders = [m for m in model.modules() if any(isinstance(c, GroupedExperts) for c in m.children())]
        for holder in holders:
            parallelize_module(holder, mesh["tp"], tensor_parallel_style("split_tokens"))
            fully_shard(holder, mesh=every_rank, gradient_divide_factor=dp * ep, **fully_shard_kwargs)
    blocks = list(cast(Iterable[nn.Module], model.layers) if blocks is None else blocks)
    for block in blocks:
        fully_shard(block, mesh=dense_mesh, **fully_shard_kwargs)
    inside_blocks = {id(m) for block in blocks for m in block.modules()}
    for name in embeddings:
        embedding = model.get_submodule(name)
        if id(embedding) not in inside_blocks and get_state(embedding) is None:
            fully_shard(embedding, mesh=dense_mesh, **fully_shard_kwargs)
    return fully_shard(model, mesh=dense_mesh, **fully_shard_kwargs)


def register_expert_bias_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    rate: float,
    group: Optional[Union[ProcessGroup, DeviceMesh]] = None,
) -> RemovableHandle:
    """Run auxiliary-loss-free balancing before every ``optimizer.step()``.

    The hook sums every router's ``tokens_per_expert`` over ``group`` (all ranks that feed the same
    routers different tokens: data- and expert-parallel ranks; ``None`` for one process), then calls
    ``update_expert_bias(rate)`` on each router, so the biases stay identical on every rank.

    Returns:
        The hook's handle (``handle.remove()`` to stop).
    """
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    if not routers:
        raise ValueError(f"{type(model).__name__} has no TopKRouter whose expert_bias could be updated")
    process_group = None if group is None else _resolve_group(group)

    def hook(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if process_group is not None:
            counts_LE = torch.stack([r.tokens_per_expert for r in routers])
            dist.all_reduce(counts_LE, group=process_group)
            for router, counts_E in zip(routers, counts_LE):
                router.tokens_per_expert.copy_(counts_E)
        for router in routers:
            router.update_expert_bias(rate)

    return optimizer.register_step_pre_hook(hook)

"""The dry run under tensor and expert parallelism: one rank's view of the model, and the bytes they send.

A module a plan splits over ``tp`` ranks holds ``1/tp`` of its weight on each (colwise: output features, rowwise:
input features; a rowwise bias stays whole). The dry run sizes the data-parallel sharding of that *local* model
over ``world_size / tp`` ranks exactly as the engine shards it (the engine sees only tp-local pieces), counts its
activations and FLOPs by the local shapes, and adds torch's tensor-parallel collectives, measured on the engine:
a rowwise ``nn.Linear`` AllReduces its output in forward, a colwise one its input's gradient in backward
(``tokens x features`` in the compute dtype each; activation checkpointing runs the forward ones again, but for a
block's last rowwise projection, which torch's checkpoint does not recompute).

With sequence parallelism (``tp: sequence`` on the norms, and the mapping form's ``input`` / ``output`` layouts, as
``configs/plan/llama_sp.yaml`` has them) the activations between the projections are split over tp on the sequence
dimension: what a ``sequence`` module (a norm) saves for backward holds ``1/tp`` of the tokens
(:func:`~lightning_vescale.plan._activations.activation_profile`'s ``sequence``), and torch sends, per module
(counted at dispatch on a dp2 x tp2 run, ``tests/distributed/test_dry_run_sequence_parallel.py``):

=====================================  ======================================  ===================================
module                                 forward                                 backward
=====================================  ======================================  ===================================
colwise, ``input: sequence``           AllGather of the input                  ReduceScatter of the input gradient
colwise, ``output: replicate``         AllGather of the output (the head's     --
                                       logits)
rowwise, ``output: sequence``          ReduceScatter of the output             AllGather of the output gradient
rowwise Embedding, ``output: sequence``  ReduceScatter of the lookups          AllGather of their gradient
``sequence`` (a norm)                  --                                      --
=====================================  ======================================  ===================================

each of ``tokens x features`` in the compute dtype, counted as ``comm_stats`` counts them (``(tp - 1) / tp`` of the
whole for an AllGather or a ReduceScatter), under ``all_gather_tp`` and ``reduce_scatter_tp``. Other layouts
(colwise ``output: sequence``, rowwise ``input: ...``, ``split`` anywhere) are refused: nothing measured them.

Expert parallelism (``ep``, a ``("dp", "ep")`` mesh, :func:`~lightning_vescale.parallel.fully_shard_expert_parallel`):
one ep rank's model keeps ``E / ep`` routed experts of every MoE layer (:func:`expert_parallel_view`); their groups
are sharded over the ``world_size / ep`` dp ranks of the rank's ep coordinate, everything else over all ranks.
Each MoE layer exchanges its tokens-per-expert counts and sends its routed rows in two uneven all-to-alls forward
(dispatch, combine) and two backward (:func:`expert_parallel_bytes`), sized under balanced routing: every expert
gets ``tokens x top_k / E`` rows of each rank, so ``(ep - 1) / ep`` of them leave it. Real routing is uneven: the
bytes of a real run differ by how far its routing is from balanced (``tests/distributed/
test_dry_run_expert_parallel.py`` routes evenly to check the rest exactly).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import torch.nn as nn

from lightning_vescale.plan._activations import SequenceParallel
from lightning_vescale.plan._resolve import ResolvedPlan
from lightning_vescale.plan._spec import PlanError

if TYPE_CHECKING:
    from lightning_vescale.models.moe import GroupedExperts

__all__ = [
    "check_expert_parallel_size",
    "check_tensor_parallel_size",
    "expert_groups",
    "expert_parallel_bytes",
    "expert_parallel_view",
    "sequence_parallel",
    "tensor_parallel_bytes",
    "tensor_parallel_view",
    "token_split_modules",
    "tp_layouts",
]


def check_tensor_parallel_size(world_size: int, replicate: int, tp: int) -> int:
    """``tp`` if it divides ``world_size`` (and is not combined with HSDP yet); else a :class:`PlanError`."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise PlanError(f"tp={tp!r}: give the tensor-parallel size, a positive int dividing the world size")
    if tp > 1 and replicate > 1:
        raise PlanError(f"tp={tp} with replicate={replicate}: HSDP x tensor parallelism is not supported yet; give one")
    if world_size % tp:
        raise PlanError(f"tp={tp} does not divide world_size={world_size}: the mesh is (world_size / tp, tp)")
    return tp


_DEFAULT_LAYOUTS = {"colwise": ("replicate", "split"), "rowwise": ("split", "replicate")}
"""torch's ``ColwiseParallel`` / ``RowwiseParallel`` input and output layouts when a plan gives none."""
_SIZED_LAYOUTS = {"colwise": {("replicate", "split"), ("sequence", "split"), ("replicate", "replicate"),
                              ("sequence", "replicate")},
                  "rowwise": {("split", "replicate"), ("split", "sequence"), ("replicate", "replicate"),
                              ("replicate", "sequence")}}
"""The (input, output) layouts the dry run sizes (those measured): for an ``nn.Linear``; a rowwise ``nn.Embedding``
takes token ids (``replicate``) whatever the plan says."""


def tp_layouts(value: Union[str, Mapping[str, str]]) -> tuple[str, str, str]:
    """``(style, input layout, output layout)`` of a plan's ``tp`` value, torch's defaults filled in."""
    if isinstance(value, str):
        return (value, *_DEFAULT_LAYOUTS.get(value, ("replicate", "replicate")))
    style = value["style"]
    default_in, default_out = _DEFAULT_LAYOUTS.get(style, ("replicate", "replicate"))
    return style, value.get("input", default_in), value.get("output", default_out)


def _local_shapes(model: nn.Module, styles: Mapping[str, Any], tp: int) -> dict[str, tuple[int, ...]]:
    modules = dict(model.named_modules())
    shapes: dict[str, tuple[int, ...]] = {}
    for name, value in styles.items():
        module, style = modules.get(name), tp_layouts(value)[0]
        if style not in ("colwise", "rowwise") or not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        # nn.Linear's weight is (out, in): colwise splits dim 0; nn.Embedding's is (vocab, dim): colwise splits dim 1.
        dim = (0 if style == "colwise" else 1) if isinstance(module, nn.Linear) else (1 if style == "colwise" else 0)
        w = module.weight
        local = list(w.shape)
        local[dim] //= tp
        shapes[f"{name}.weight" if name else "weight"] = tuple(local)
        bias = getattr(module, "bias", None)
        if isinstance(module, nn.Linear) and bias is not None and style == "colwise":
            shapes[f"{name}.bias"] = (bias.shape[0] // tp,)
    return shapes


def _check_layouts(model: nn.Module, styles: Mapping[str, Any]) -> None:
    """A :class:`PlanError` naming the first module whose layouts the dry run does not size."""
    modules = dict(model.named_modules())
    for name, value in styles.items():
        style, inp, out = tp_layouts(value)
        if style not in _SIZED_LAYOUTS or not isinstance(modules.get(name), nn.Linear):
            continue
        if (inp, out) not in _SIZED_LAYOUTS[style]:
            sized = ", ".join(f"input: {i}, output: {o}" for i, o in sorted(_SIZED_LAYOUTS[style]))
            raise PlanError(f"{name}: tp {{style: {style}, input: {inp}, output: {out}}} is a layout the dry run does "
                            f"not size (nothing measured what torch sends for it); a {style} module sizes {sized}")


def sequence_parallel(model: nn.Module) -> Optional[SequenceParallel]:
    """What the activation count needs to know of a :func:`tensor_parallel_view`'s sequence parallelism (None:
    none, or not a view)."""
    return getattr(model, "_vescale_tp_sequence", None)


def token_split_modules(model: nn.Module) -> frozenset[str]:
    """The modules of a :func:`tensor_parallel_view` that run on ``1/tp`` of the tokens with their weights whole
    (``tp: split_tokens``: a MoE feed-forward under ep x tp); each is a group sharded over every rank."""
    return getattr(model, "_vescale_tp_token_split", frozenset())


def _input_features(module: nn.Module) -> int:
    """The width of a feed-forward's input (a MoE's experts' ``dim``, else its first linear's ``in_features``)."""
    experts = getattr(module, "experts", None)
    if experts is not None and hasattr(experts, "w1_EDF"):
        return int(experts.w1_EDF.shape[1])
    return next(m.in_features for m in module.modules() if isinstance(m, nn.Linear))


def tensor_parallel_view(model: nn.Module, resolved: ResolvedPlan, tp: int) -> tuple[nn.Module, ResolvedPlan]:
    """One tp rank's model (a meta-device copy with the split weights' local shapes) and the plan resolved on it.

    Raises ``ValueError`` (from :func:`~lightning_vescale.parallel.check_tensor_parallel`) where ``tp`` does not
    divide a split shape or the heads, and a :class:`PlanError` where the plan splits nothing or gives a layout
    the dry run does not size."""
    from lightning_vescale.plan._tp_rules import check_tensor_parallel

    if tp == 1:
        return model, resolved
    styles = dict(resolved.tensor_parallel)
    if not any(tp_layouts(s)[0] not in ("replicate", "sequence") for s in styles.values()):
        raise PlanError(f"tp={tp}, but the plan {resolved.plan.name or ''!r} splits no module over tp: give a plan with "
                        f"tp rules (e.g. plan=llama)")
    _check_layouts(model, styles)
    check_tensor_parallel(model, styles, tp)
    token_split = frozenset(n for n, s in styles.items() if tp_layouts(s)[0] == "split_tokens")
    loose = [n for n in sorted(token_split) if n not in {g.name for g in resolved.groups}]
    if loose:  # as resolve_for(..., tensor_parallel=True) makes them: groups of their own, sharded over every rank
        import dataclasses

        from lightning_vescale.plan._resolve import plan_from_modules, resolve_plan

        extra = plan_from_modules(model, [model.get_submodule(n) for n in loose], name="split_tokens")
        resolved = resolve_plan(model, dataclasses.replace(resolved.plan, rules=resolved.plan.rules + extra.rules))
    shapes = _local_shapes(model, styles, tp)
    local = copy.deepcopy(model).to("meta")
    for full_name, shape in shapes.items():
        owner, _, attr = full_name.rpartition(".")
        module = local.get_submodule(owner)
        old = getattr(module, attr)
        setattr(module, attr, nn.Parameter(torch.empty(shape, dtype=old.dtype, device="meta"),
                                           requires_grad=old.requires_grad))
    local._vescale_tp_local = tp  # type: ignore[assignment]  # marks the view (dry_run checks it)
    local._vescale_global_numel = sum(p.numel for p in resolved.params.values())  # type: ignore[assignment]
    whole = dict(model.named_parameters())
    local._vescale_tp_split = {  # type: ignore[assignment]  # the parameters split over tp: their whole shapes
        n: tuple(whole[n].shape) for n in shapes}
    layouts = {n: tp_layouts(s) for n, s in styles.items()}
    sequence = SequenceParallel(  # split_tokens modules run on 1/tp of the tokens as the norms do
        tp, sequence=frozenset(n for n, (style, _, _) in layouts.items() if style in ("sequence", "split_tokens")),
        gather_input=frozenset(n for n, (style, inp, _) in layouts.items() if style == "colwise" and inp == "sequence"),
        gather_output=frozenset(n for n, (style, _, out) in layouts.items() if style == "colwise" and out == "replicate"))
    if sequence.sequence or sequence.gather_input or sequence.gather_output:
        local._vescale_tp_sequence = sequence  # type: ignore[assignment]  # read by sequence_parallel()
    local._vescale_tp_token_split = token_split  # type: ignore[assignment]  # read by token_split_modules()
    vocab = next((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), 0)
    local._vescale_vocab = vocab  # type: ignore[assignment]  # the logits' width, whatever the split of the embedding
    params = {}
    for name, policy in resolved.params.items():
        params[name] = policy if name not in shapes else type(policy)(**{**vars(policy), "shape": shapes[name]})
    return local, ResolvedPlan(plan=resolved.plan, model_type=resolved.model_type, groups=resolved.groups,
                               params=params, tensor_parallel=resolved.tensor_parallel)


def _module_collectives(module: nn.Module, value: Union[str, Mapping[str, str]], tp: int) -> list[tuple[str, bool, int]]:
    """``(kind, in forward, features)`` of what torch sends for one split module, ``tokens x features`` each."""
    style, inp, out = tp_layouts(value)
    if style == "split_tokens":  # input cut into tp chunks (no communication), output gathered; backward the reverse
        dim = _input_features(module)
        return [("all_gather_tp", True, dim)] * (out == "replicate") + [("all_gather_tp", False, dim)] * (inp == "replicate")
    if isinstance(module, nn.Embedding):
        if style != "rowwise":  # colwise: the lookups stay split on features, nothing is sent
            return []
        dim = module.weight.shape[1]  # vocabulary split: the partial lookups are summed
        return [("all_reduce_tp", True, dim)] if out == "replicate" else \
            [("reduce_scatter_tp", True, dim), ("all_gather_tp", False, dim)]
    if not isinstance(module, nn.Linear) or style not in ("colwise", "rowwise"):
        return []
    local_out, local_in = module.weight.shape
    sent = []
    if style == "colwise":
        if inp == "replicate":
            sent.append(("all_reduce_tp", False, local_in))  # the input gradient's partial sums
        else:
            sent += [("all_gather_tp", True, local_in), ("reduce_scatter_tp", False, local_in)]
        if out == "replicate":  # the split outputs gathered; their gradient is only cut in backward
            sent.append(("all_gather_tp", True, local_out * tp))
    else:
        sent += [("all_reduce_tp", True, local_out)] if out == "replicate" else \
            [("reduce_scatter_tp", True, local_out), ("all_gather_tp", False, local_out)]
    return sent


def tensor_parallel_bytes(local: nn.Module, styles: Mapping[str, Any], tp: int, tokens: int, itemsize: int,
                          checkpointed: frozenset[str] = frozenset()) -> tuple[dict[str, float], dict[str, int]]:
    """``(bytes, calls)`` by ``comm_stats``-style kind per step of the tp collectives of one rank: ``all_reduce_tp``
    (``2 (tp - 1) / tp`` of the payload: rowwise outputs in forward, colwise input gradients in backward) and, with
    sequence parallelism, ``all_gather_tp`` and ``reduce_scatter_tp`` (``(tp - 1) / tp`` of it; see the module
    doc). The forward ones run twice under ``checkpointed`` groups (the recompute), but for a group's last rowwise
    projection, which torch's non-reentrant checkpoint does not run again (its output only feeds the residual sum)."""
    if tp == 1:
        return {}, {}
    modules = dict(local.named_modules())
    last_rowwise = {}
    for name, value in styles.items():
        owner = next((g for g in checkpointed if name.startswith(g + ".")), None)
        if owner is not None and tp_layouts(value)[0] == "rowwise":
            last_rowwise[owner] = name
    sent: dict[str, float] = {}
    calls: dict[str, int] = {}
    for name, value in styles.items():
        module = modules.get(name)
        if module is None:
            continue
        owner = next((g for g in checkpointed if name.startswith(g + ".")), None)
        # A split_tokens module's output gather, like the last rowwise projection, only feeds the residual sum.
        recomputed = owner is not None and last_rowwise.get(owner) != name and tp_layouts(value)[0] != "split_tokens"
        for kind, forward, features in _module_collectives(module, value, tp):
            times = 2 if forward and recomputed else 1
            share = 2 * (tp - 1) / tp if kind == "all_reduce_tp" else (tp - 1) / tp
            sent[kind] = sent.get(kind, 0.0) + times * share * tokens * features * itemsize
            calls[kind] = calls.get(kind, 0) + times
    return sent, calls


# --------------------------------------------------------------------------------------------------------
# Expert parallelism


def check_expert_parallel_size(world_size: int, replicate: int, tp: int, ep: int) -> int:
    """``ep`` if it divides ``world_size / tp`` (and is not combined with HSDP); else a :class:`PlanError`."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise PlanError(f"ep={ep!r}: give the expert-parallel size, a positive int dividing the world size")
    if ep > 1 and replicate > 1:
        raise PlanError(f"ep={ep} with replicate={replicate}: HSDP x expert parallelism is not supported; give one")
    if (world_size // tp) % ep or world_size % tp:
        raise PlanError(f"ep={ep} does not divide world_size / tp = {world_size} / {tp}: the mesh is "
                        f"(world_size / (ep * tp), ep{', tp' if tp > 1 else ''})")
    return ep


def _grouped_experts(model: nn.Module) -> dict[str, GroupedExperts]:
    from lightning_vescale.models.moe import GroupedExperts

    return {name: m for name, m in model.named_modules() if isinstance(m, GroupedExperts)}


def expert_parallel_view(model: nn.Module, resolved: ResolvedPlan, ep: int, *,
                         copy_model: bool = True) -> tuple[nn.Module, ResolvedPlan]:
    """One ep rank's model: every ``GroupedExperts`` keeps ``E / ep`` experts (its ``w1_EDF`` / ``w2_EFD`` / ``w3_EDF``
    cut on dim 0, as :func:`~lightning_vescale.parallel.apply_expert_parallel` cuts them), and the plan resolved on it.
    The experts' groups are marked (``expert_groups``): the engine shards them over the dp ranks of their ep
    coordinate only. ``copy_model=False`` changes ``model`` itself (a view just made, e.g. by
    :func:`tensor_parallel_view`, that nothing else holds).

    Raises a :class:`PlanError` where the model has no routed experts, ``ep`` does not divide their number, or a
    ``GroupedExperts`` is not a group of its own (expert parallelism shards it over other ranks than the rest)."""
    if ep == 1:
        return model, resolved
    experts = _grouped_experts(model)
    if not experts:
        raise PlanError(f"ep={ep}, but {type(model).__name__} has no routed experts (GroupedExperts) to split")
    groups = {g.name for g in resolved.groups}
    for name, m in experts.items():
        E = m.w1_EDF.shape[0]
        if E % ep:
            raise PlanError(f"ep={ep} does not divide the {E} experts of {name}: choose an ep that divides {E}")
        if name not in groups:
            raise PlanError(f"{name} (GroupedExperts) is not a group of its own, which expert parallelism needs (its "
                            f"experts are sharded over the dp ranks only): give a plan with a group rule for it "
                            f"(plan=moe)")
    local = copy.deepcopy(model).to("meta") if copy_model else model  # a copy keeps a tp view's marks
    shapes: dict[str, tuple[int, ...]] = {}
    for name, module in _grouped_experts(local).items():
        for attr in ("w1_EDF", "w2_EFD", "w3_EDF"):
            old = getattr(module, attr)
            shape = (old.shape[0] // ep, *old.shape[1:])
            setattr(module, attr, nn.Parameter(torch.empty(shape, dtype=old.dtype, device="meta"),
                                               requires_grad=old.requires_grad))
            shapes[f"{name}.{attr}"] = shape
        module.num_experts //= ep  # as apply_expert_parallel sets it
    local._vescale_ep_local = ep  # type: ignore[assignment]  # marks the view (dry_run checks it)
    if not hasattr(local, "_vescale_global_numel"):
        local._vescale_global_numel = sum(p.numel for p in resolved.params.values())  # type: ignore[assignment]
    local._vescale_ep_groups = frozenset(experts)  # type: ignore[assignment]  # read by expert_groups()
    params = {}
    for name, policy in resolved.params.items():
        params[name] = policy if name not in shapes else type(policy)(**{**vars(policy), "shape": shapes[name]})
    return local, ResolvedPlan(plan=resolved.plan, model_type=resolved.model_type, groups=resolved.groups,
                               params=params, tensor_parallel=resolved.tensor_parallel)


def expert_groups(model: nn.Module) -> frozenset[str]:
    """The groups of an :func:`expert_parallel_view` holding routed experts (sharded over the dp ranks only)."""
    return getattr(model, "_vescale_ep_groups", frozenset())


def expert_parallel_bytes(local: nn.Module, ep: int, tokens: int, itemsize: int,
                          checkpointed: frozenset[str] = frozenset(),
                          tp: int = 1) -> tuple[dict[str, float], dict[str, int]]:
    """``(bytes, calls)`` per step of one rank's expert-parallel all-to-alls (see
    :class:`~lightning_vescale.parallel.ExpertParallelGroupedExperts`), assuming balanced routing: each MoE layer
    exchanges its tokens-per-expert counts (``E`` int64, ``all_to_all_ep_counts``) and sends its ``tokens x top_k``
    routed rows of ``dim`` elements in the compute dtype twice forward (dispatch, combine) and twice backward
    (``all_to_all_ep``), of which the ``(ep - 1) / ep`` bound for other ranks' experts leave the rank. Under
    ``checkpointed`` groups the forward ones run again (the recompute). With ``tp``, a MoE layer inside a
    ``split_tokens`` module runs on ``tokens / tp`` (its all-to-alls among the ep ranks of equal (dp, tp)
    coordinate)."""
    from lightning_vescale.models.moe import MoEFeedForward

    if ep == 1:
        return {}, {}
    sent = {"all_to_all_ep": 0.0, "all_to_all_ep_counts": 0.0}
    calls = {"all_to_all_ep": 0, "all_to_all_ep_counts": 0}
    share = (ep - 1) / ep
    for name, m in local.named_modules():
        if not isinstance(m, MoEFeedForward):
            continue
        forwards = 2 if any(name.startswith(g + ".") for g in checkpointed) else 1
        split = any(name == t or name.startswith(t + ".") for t in token_split_modules(local))
        rows = (tokens // tp if split else tokens) * m.router.top_k
        sent["all_to_all_ep"] += (2 * forwards + 2) * share * rows * m.experts.w1_EDF.shape[1] * itemsize
        calls["all_to_all_ep"] += 2 * forwards + 2
        sent["all_to_all_ep_counts"] += forwards * share * m.router.num_experts * 8
        calls["all_to_all_ep_counts"] += forwards
    return sent, calls

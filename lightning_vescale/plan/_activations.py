"""How many bytes a model keeps for backward per token: counted on the meta device, no memory, no data.

The model's forward runs on meta tensors under ``saved_tensors_hooks`` and the distinct storages autograd
saves are summed (parameters and buffers excluded). So every architecture the models implement is counted
from its own code (attention variants, norms in fp32, dense feed-forwards), at any size, in milliseconds.

Two things the meta device cannot do are handled by hand:

* attention: on meta, scaled-dot-product attention takes the math path, which saves ``T x T`` probabilities
  per head; the fused kernels used in training (flash attention, on CPU and GPU) keep the inputs, the output
  and a log-sum-exp per row. During the count ``F.scaled_dot_product_attention`` is a stand-in that saves
  exactly those (so the count is linear in the number of tokens);
* routed experts: routing is data-dependent (``bincount``, ``tolist``) and cannot run on meta. Each
  :class:`~lightning_vescale.models.moe.MoEFeedForward` is replaced during the count by a stand-in that
  saves nothing, and its bytes are added from a formula of the same tensors (router scores and choices,
  ``top_k`` routed rows in and out, SwiGLU intermediates per routed row, shared experts), assuming each token
  goes to ``top_k`` experts. ``tests/unit/test_dry_run.py`` checks formula and count against a real forward.

The loss of the recipes (``cross_entropy`` on fp32 logits) adds its log-probabilities, ``vocab * 4`` bytes,
and the targets.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

if TYPE_CHECKING:
    from lightning_vescale.models.moe import MoEFeedForward

__all__ = ["SequenceParallel", "activation_bytes_per_token", "activation_profile", "moe_bytes_per_token"]


@dataclass(frozen=True)
class SequenceParallel:
    """Sequence parallelism in a tensor-parallel rank's model, as the activation count needs it."""

    split: int
    """The tensor-parallel size: the sequence is split over that many ranks between the projections."""
    sequence: frozenset[str] = frozenset()
    """Modules on ``1 / split`` of the tokens (``tp: sequence``: the norms; ``tp: split_tokens``: a MoE feed-forward)."""
    gather_input: frozenset[str] = frozenset()
    """Modules whose input is gathered over tp (colwise, ``input: sequence``): each saves a whole copy of its own."""
    gather_output: frozenset[str] = frozenset()
    """Modules whose split output is gathered over tp (colwise, ``output: replicate``: the head's logits)."""


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def moe_bytes_per_token(ffn: MoEFeedForward, itemsize: int) -> float:
    """Bytes an :class:`~lightning_vescale.models.moe.MoEFeedForward` saves per token (see the module docstring).

    ``itemsize``: of the compute dtype (the router's scores and choices are fp32 / int64 whatever it is).
    """
    router, experts = ffn.router, ffn.experts
    E, k = router.num_experts, router.top_k
    _, D, Fm = experts.w1_EDF.shape
    b = itemsize
    nbytes = D * b  # the input rows, saved by the router's and the shared experts' linears
    nbytes += 4 * E + 8 * k + 4 * k + 4  # scores (softmax/sigmoid output, fp32), chosen ids, chosen weights, their sum
    nbytes += 8 * k + 8 * k  # the routed rows' token ids and their order
    nbytes += k * D * b  # routed input rows (each expert's matmuls save views of them)
    nbytes += 4 * k * Fm * b  # w1 out (silu input), silu out, w3 out, their product (w2 input), per routed row
    nbytes += k * D * b + k * b  # routed output rows and their weights, saved by the weighting
    nbytes += k * D * b  # the weighted rows, saved by the index_add that sums them per token
    if ffn.shared_experts is not None:
        Fs = ffn.shared_experts.w1.weight.shape[0]
        nbytes += 4 * Fs * b
        if ffn.shared_gate is not None:
            nbytes += D * b + b  # the shared output and its gate, saved by their product
    return float(nbytes)


class _FlashAttention(torch.autograd.Function):
    """What flash attention keeps for backward: q, k, v, the output and a float32 log-sum-exp per query row."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # (B, H, T, K) in (B, T, H, K) memory, as the kernels lay it out: the usual transpose-and-reshape for the
        # output projection is then a view, not a copy.
        *batch, heads, rows, _ = q.shape
        out = q.new_empty((*batch, rows, heads, v.shape[-1])).transpose(-3, -2)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # pragma: no cover - the count never runs backward
        raise RuntimeError("the attention stand-in of the activation count has no backward")


@contextlib.contextmanager
def _flash_attention() -> Iterator[None]:
    original = F.scaled_dot_product_attention

    def stand_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return _FlashAttention.apply(q, k, v)

    F.scaled_dot_product_attention = stand_in  # type: ignore[assignment]  # takes (and drops) the same arguments
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def _experts_by_formula(model: nn.Module, itemsize: int, counter: list, stack: list, charged: dict,
                        share: Sequence[float] = (1.0,)) -> Iterator[None]:
    from lightning_vescale.models.moe import MoEFeedForward

    originals = []
    for m in model.modules():
        if isinstance(m, MoEFeedForward):
            per_token = moe_bytes_per_token(m, itemsize)

            def stand_in(x_BTD: torch.Tensor, _per_token: float = per_token) -> torch.Tensor:
                charged[stack[-1]] += _per_token * x_BTD.shape[0] * x_BTD.shape[1] * share[-1]
                return x_BTD.clone()  # keeps the graph connected, saves nothing

            originals.append(m)
            m.forward = stand_in  # type: ignore[method-assign]  # an instance attribute, deleted below
    try:
        yield
    finally:
        for m in originals:
            del m.forward


def activation_profile(
    model: nn.Module, groups: Sequence[str] = ("",), *, compute_dtype: Optional[torch.dtype] = None,
    tokens: int = 23, loss: bool = True, sequence_parallel: Optional[SequenceParallel] = None,
) -> dict[str, float]:
    """Bytes saved for backward per token of a micro-batch, by group: each saved storage is charged to the
    innermost of ``groups`` (module names; ``""`` the model) whose forward is running when it is saved.

    Args:
        model: the unsharded model (a meta-device one is fine); counted on a meta copy.
        groups: the module names to charge; what runs outside all of them (and the loss) is charged to the
            model's own name ``""`` if it is one of them, else to the first.
        compute_dtype: the dtype forward runs in (mixed precision's ``param_dtype``); None: the parameters'.
        tokens: the sequence length of the counting forward (the count is per token).
        loss: add the recipes' loss (fp32 log-probabilities over the vocabulary, and the targets).
        sequence_parallel: of a tensor-parallel rank's model (:func:`~lightning_vescale.plan._tensor_parallel.
            sequence_parallel`), the modules that run on ``1 / split`` of the tokens (what they save is charged at
            that share) and those that gather their input or output over tp (each gets a tensor of its own, as the
            AllGather's output is, which its matmul saves; a gathered output is ``split`` times wider).
    """
    with torch.device("meta"):
        meta = copy.deepcopy(model).to("meta")
    if compute_dtype is not None:
        meta = meta.to(compute_dtype)
    for p in meta.parameters():
        p.requires_grad_(True)
    itemsize = (compute_dtype or next(meta.parameters()).dtype).itemsize
    skip = {_storage_key(t) for t in [*meta.parameters(), *meta.buffers()]}
    names = dict(meta.named_modules(remove_duplicate=False))
    stand_ins = _count_each_kind_of_block_once(meta, set(groups))
    charged: dict[str, float] = {g: 0.0 for g in groups}
    base = "" if "" in charged else groups[0]
    stack = [base]
    seen: set[int] = set()
    share = [1.0]  # of the tokens the running module holds (sequence parallelism: 1 / sequence_split in a norm)

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in skip and key not in seen:
            seen.add(key)
            charged[stack[-1]] += t.untyped_storage().nbytes() * share[-1]
        return t

    def split_on(module: nn.Module, args: tuple) -> None:
        assert sequence_parallel is not None
        share.append(1.0 / sequence_parallel.split)

    def split_off(module: nn.Module, args: tuple, output: object) -> None:
        share.pop()

    def enter(group: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            stack.append(group)

        return hook

    def leave(module: nn.Module, args: tuple, output: object) -> None:
        stack.pop()

    handles = []
    sp = sequence_parallel
    if sp is not None and sp.split > 1:
        for name in sp.sequence & names.keys():
            handles.append(names[name].register_forward_pre_hook(split_on))
            handles.append(names[name].register_forward_hook(split_off))
        for name in sp.gather_input & names.keys():
            handles.append(names[name].register_forward_pre_hook(lambda m, args: (args[0].clone(), *args[1:])))
        for name in sp.gather_output & names.keys():
            handles.append(names[name].register_forward_hook(
                lambda m, args, out: torch.cat([out] * sp.split, dim=-1)))
    for g in groups:
        if g in names and names[g] is not meta:
            handles.append(names[g].register_forward_pre_hook(enter(g)))
            handles.append(names[g].register_forward_hook(leave))
    counter = [0.0]
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    try:
        with _experts_by_formula(meta, itemsize, counter, stack, charged, share), _flash_attention(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = meta(ids)
    finally:
        for h in handles:
            h.remove()
    if loss:
        charged[base] += (out.shape[-1] * 4 + 16) * tokens
    for g in groups:
        for block, representative in stand_ins.items():
            if g == block or g.startswith(block + "."):
                charged[g] = charged.get(representative + g[len(block):], 0.0)
    return {g: v / tokens for g, v in charged.items()}


def _signature(module: nn.Module) -> tuple:
    return type(module).__name__, tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters())


def _count_each_kind_of_block_once(model: nn.Module, groups: set) -> dict[str, str]:
    """Drop from ``model`` (a meta copy) the blocks of a block list that equal an earlier block (same class and
    parameter shapes): identical blocks save identical tensors, so one of each kind is counted (a 61-layer
    model runs 2 or 3). Returns each dropped block's name -> the name of the block counted for it."""
    stand_ins: dict[str, str] = {}
    for list_name, blocks in list(model.named_modules()):
        if not isinstance(blocks, nn.ModuleList) or len(blocks) < 2:
            continue
        names = [f"{list_name}.{i}" if list_name else str(i) for i in range(len(blocks))]
        if not all(n in groups for n in names):
            continue  # only lists of blocks the plan shards one by one, which forward runs in sequence
        first: dict[tuple, str] = {}
        kept = []
        for name, block in zip(names, blocks):
            representative = first.setdefault(_signature(block), name)
            if representative == name:
                kept.append(block)
            else:
                stand_ins[name] = representative
        blocks._modules = {str(i): b for i, b in enumerate(kept)}
    return stand_ins


def activation_bytes_per_token(
    model: nn.Module, *, compute_dtype: Optional[torch.dtype] = None, tokens: int = 23, loss: bool = True
) -> float:
    """Bytes saved for backward per token of a micro-batch (see :func:`activation_profile`)."""
    return sum(activation_profile(model, compute_dtype=compute_dtype, tokens=tokens, loss=loss).values())

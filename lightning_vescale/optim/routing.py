"""Which parameters Muon takes and which AdamW takes, as one optimizer; and the granularity that keeps
Muon's matrices whole on one rank.

Default routing, by the names ``model.named_parameters()`` gives:

0. a parameter whose plan (:func:`lightning_vescale.parallelize`) sets ``optimizer: muon`` / ``adamw`` goes there;
1. a name matching ``adamw_patterns`` goes to AdamW, one matching ``muon_patterns`` to Muon (matching
   both is an error);
2. weights of ``nn.Embedding`` modules and names matching :data:`DEFAULT_ADAMW_PATTERNS` (the output
   head) go to AdamW;
3. other 2-D tensors (hidden matrices) and 3-D expert stacks (``expert_patterns``, default
   :data:`DEFAULT_EXPERT_PATTERNS`, or ``p._vescale_expert_stack = True``) go to Muon;
4. everything else (norms, biases, other tensors) goes to AdamW, which steps the flat local pieces.

Parameters that do not require gradients are left out.
"""

from __future__ import annotations

import fnmatch
from typing import Callable, Iterable, Literal, Optional, Sequence, Union

import torch
import torch.nn as nn
from torch import Tensor
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS
from torch.optim.adam import Adam, adam

from lightning_vescale.engine.fully_shard import ParameterNames
from lightning_vescale.optim.muon import (
    Mode,
    Muon,
    MuonCostModel,
    global_shape,
    is_expert_stack,
)

__all__ = [
    "DEFAULT_ADAMW_PATTERNS",
    "DEFAULT_EXPERT_PATTERNS",
    "MuonWithAuxAdamW",
    "build_optimizer",
    "muon_granularity",
    "route_parameters",
]

DEFAULT_ADAMW_PATTERNS: tuple[str, ...] = (
    "output.weight", "head.weight", "lm_head.weight", "*.lm_head.weight", "*embed*", "wte.weight", "*.wte.weight",
    "wpe.weight", "*.wpe.weight",
)
"""The output head and embeddings by their usual names (our Llama's ``output``, GPT-2, Hugging Face)."""
DEFAULT_EXPERT_PATTERNS: tuple[str, ...] = ("*experts.*",)
"""3-D parameters under a module named ``experts`` (``lightning_vescale.models.moe.GroupedExperts``)."""

Route = Literal["muon", "adamw"]


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pat) for pat in patterns)


def _embedding_params(model: nn.Module) -> set[int]:
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def _route(
    name: str, p: Tensor, *, embeddings: set[int], muon_patterns: Sequence[str], adamw_patterns: Sequence[str],
    expert_patterns: Sequence[str],
) -> Route:
    policy = getattr(p, "_vescale_policy", None)  # a plan's ParamPolicy, stored on the parameter by parallelize
    if policy is not None and policy.route_is_explicit and policy.optimizer in ("muon", "adamw"):
        return policy.optimizer  # the plan the model was parallelized with decided
    to_adamw, to_muon = _matches(name, adamw_patterns), _matches(name, muon_patterns)
    if to_adamw and to_muon:
        raise ValueError(
            f"parameter {name} matches both adamw_patterns {list(adamw_patterns)} and muon_patterns "
            f"{list(muon_patterns)}; make the patterns disjoint."
        )
    if to_adamw:
        return "adamw"
    if to_muon:
        return "muon"
    if id(p) in embeddings or _matches(name, DEFAULT_ADAMW_PATTERNS):
        return "adamw"
    ndim = len(global_shape(p))
    if ndim == 2 or (ndim == 3 and is_expert_stack(name, p, expert_patterns)):
        return "muon"
    return "adamw"


def route_parameters(
    model: nn.Module,
    *,
    muon_patterns: Sequence[str] = (),
    adamw_patterns: Sequence[str] = (),
    expert_patterns: Sequence[str] = DEFAULT_EXPERT_PATTERNS,
) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """``{"muon": [(name, param)], "adamw": [(name, param)]}`` for the trainable parameters of ``model``."""
    embeddings = _embedding_params(model)
    out: dict[str, list] = {"muon": [], "adamw": []}
    for name, p in model.named_parameters():
        if p.requires_grad:
            route = _route(name, p, embeddings=embeddings, muon_patterns=muon_patterns,
                           adamw_patterns=adamw_patterns, expert_patterns=expert_patterns)
            out[route].append((name, p))
    return out


def muon_granularity(
    model: nn.Module,
    *,
    muon_patterns: Sequence[str] = (),
    adamw_patterns: Sequence[str] = (),
    expert_patterns: Sequence[str] = DEFAULT_EXPERT_PATTERNS,
    other: Union[str, int] = "element",
) -> Callable[[str, nn.Parameter], Union[str, int]]:
    """A ``granularity`` for :func:`lightning_vescale.fully_shard` that puts Muon's matrices whole on one rank.

    Call it on the *unsharded* model, before any ``fully_shard``, and pass the result to every
    ``fully_shard`` call. The parameters Muon steps get ``"matrix"``: a hidden matrix whole, and each expert
    matrix of a 3-D expert stack whole (the stack itself may be cut between experts), so
    :class:`~lightning_vescale.optim.Muon` orthogonalizes them with no communication (its "local" path); the
    AdamW-routed parameters get ``other``. The routing is the one :func:`build_optimizer` uses with the same
    patterns.

    Example::

        gran = muon_granularity(model)
        for block in model.layers:
            fully_shard(block, granularity=gran)
        fully_shard(model, granularity=gran)
        optimizer = build_optimizer(model, lr=3e-4, muon_lr=0.02, weight_decay=0.1)
    """
    embeddings = _embedding_params(model)
    names = ParameterNames(model)

    def granularity(name: str, p: nn.Parameter) -> Union[str, int]:
        full = names.get(p, name)  # fully_shard passes the name inside the sharded module
        route = _route(full, p, embeddings=embeddings, muon_patterns=muon_patterns,
                       adamw_patterns=adamw_patterns, expert_patterns=expert_patterns)
        if route == "adamw" or not p.requires_grad:
            return other
        return "matrix"

    return granularity


class MuonWithAuxAdamW(Muon):
    """One optimizer with two kinds of param groups: ``use_muon=True`` groups step with
    :class:`~lightning_vescale.optim.Muon`, the others with ``torch.optim.AdamW``'s own functional
    (``torch.optim.adam.adam`` with decoupled weight decay) on their flat local pieces.

    ``state_dict`` / ``load_state_dict`` / ``zero_grad`` / LR schedulers see one optimizer (Lightning's
    ``configure_optimizers`` can return it). Every group needs ``use_muon``; AdamW groups take ``lr``,
    ``betas``, ``eps``, ``weight_decay`` and ``amsgrad`` (defaults as ``torch.optim.AdamW``, except the
    shared ``weight_decay``). Muon keyword arguments are as :class:`Muon`.
    """

    def __init__(
        self,
        param_groups: Iterable[dict],
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        amsgrad: bool = False,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: Optional[str] = None,
        mode: Mode = "auto",
        expert_patterns: Sequence[str] = DEFAULT_EXPERT_PATTERNS,
        cost_model: Optional[MuonCostModel] = None,
    ) -> None:
        groups = [dict(g) for g in param_groups]
        for g in groups:
            if not g.get("use_muon", True) and "adamw_eps" in g:
                g["eps"] = g.pop("adamw_eps")
            elif not g.get("use_muon", True):
                g.setdefault("eps", adamw_eps)
        # AdamW's group options, with torch.optim.AdamW's defaults (foreach / fused chosen by torch).
        adamw_defaults = {
            "betas": betas, "amsgrad": amsgrad, "maximize": False, "foreach": None, "capturable": False,
            "differentiable": False, "fused": None, "decoupled_weight_decay": True,
        }
        super().__init__(
            groups, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, mode=mode,
            expert_patterns=expert_patterns, cost_model=cost_model, _extra_defaults=adamw_defaults,
        )

    def _is_muon_group(self, group: dict) -> bool:
        if "use_muon" not in group:
            raise ValueError("every MuonWithAuxAdamW param group needs 'use_muon': True (Muon) or False (AdamW)")
        return bool(group["use_muon"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon_step()
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw_step(group)
        return loss

    def _adamw_step(self, group: dict) -> None:
        # Exactly torch.optim.AdamW.step for one group: its own state initialization and functional.
        params: list[Tensor] = []
        grads: list[Tensor] = []
        exp_avgs: list[Tensor] = []
        exp_avg_sqs: list[Tensor] = []
        max_exp_avg_sqs: list[Tensor] = []
        state_steps: list[Tensor] = []
        # AdamW's own initialization, run on this optimizer (it reads only the group and self.state)
        has_complex = Adam._init_group(
            self,  # type: ignore[arg-type]
            group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps
        )
        beta1, beta2 = group["betas"]
        adam(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
            amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
            foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
            fused=group["fused"], grad_scale=None, found_inf=None,
            decoupled_weight_decay=group["decoupled_weight_decay"],
        )


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    muon_lr: Optional[float] = None,
    weight_decay: float = 0.1,
    adamw_weight_decay: Optional[float] = None,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
    eps: float = EPS,
    ns_steps: int = DEFAULT_NS_STEPS,
    adjust_lr_fn: Optional[str] = None,
    mode: Mode = "auto",
    muon_patterns: Sequence[str] = (),
    adamw_patterns: Sequence[str] = (),
    expert_patterns: Sequence[str] = DEFAULT_EXPERT_PATTERNS,
    cost_model: Optional[MuonCostModel] = None,
) -> MuonWithAuxAdamW:
    """Muon for the hidden matrices of ``model``, AdamW for the rest, as one optimizer.

    Works on a model sharded by :func:`lightning_vescale.fully_shard` (or an unsharded one). Routing is
    described at the top of this module; shard with :func:`muon_granularity` so the matrices are whole on
    one rank and Muon needs no communication.

    Args:
        model: the model; its ``named_parameters()`` names are matched by the patterns.
        lr: AdamW learning rate (and Muon's, unless ``muon_lr`` is given).
        muon_lr: Muon learning rate (before ``adjust_lr_fn`` scaling).
        weight_decay: Muon decoupled weight decay (and AdamW's, unless ``adamw_weight_decay`` is given).
        adamw_betas, adamw_eps: AdamW's ``betas`` and ``eps``.
        momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn, mode, cost_model: Muon's
            (see :class:`~lightning_vescale.optim.Muon`).
        muon_patterns / adamw_patterns: name glob patterns forcing a parameter to Muon / AdamW.
        expert_patterns: name glob patterns of 3-D expert stacks (each ``[e]`` a matrix for Muon).

    Returns:
        A :class:`MuonWithAuxAdamW` with one Muon and one AdamW param group (empty ones left out).
    """
    routes = route_parameters(model, muon_patterns=muon_patterns, adamw_patterns=adamw_patterns,
                              expert_patterns=expert_patterns)
    groups = []
    if routes["muon"]:
        groups.append({"params": routes["muon"], "use_muon": True, "lr": lr if muon_lr is None else muon_lr,
                       "weight_decay": weight_decay})
    if routes["adamw"]:
        groups.append({"params": routes["adamw"], "use_muon": False, "lr": lr, "betas": tuple(adamw_betas),
                       "adamw_eps": adamw_eps,
                       "weight_decay": weight_decay if adamw_weight_decay is None else adamw_weight_decay})
    if not groups:
        raise ValueError(f"{type(model).__name__} has no trainable parameters to optimize")
    return MuonWithAuxAdamW(
        groups, lr=lr, weight_decay=weight_decay, betas=adamw_betas, adamw_eps=adamw_eps, momentum=momentum,
        nesterov=nesterov, ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
        mode=mode, expert_patterns=expert_patterns, cost_model=cost_model,
    )

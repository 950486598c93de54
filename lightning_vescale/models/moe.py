"""Mixture-of-experts decoder in plain PyTorch (DeepSeek-V3 / Mixtral / Qwen-MoE style).

Blocks reuse Llama's attention, norms and RoPE (:mod:`lightning_vescale.models.llama`); the
feed-forward of a block is a :class:`MoEFeedForward` (a router, grouped routed experts, optional
shared experts) or, for the layers in ``MoEConfig.dense_layers``, a dense SwiGLU.

Shape suffixes (legend as in llama.py, plus)::

    N tokens (B*T)   E experts   A top-k slots per token   R routed rows (N*A)   F expert hidden

[Note: how the routed experts run]
The router picks ``A`` experts per token. :meth:`GroupedExperts.forward` sorts the ``N*A`` (token,
slot) pairs by expert (a stable sort), gathers the token rows into ``routed_input_RD`` (expert 0's rows
first, then expert 1's, ...), runs :meth:`GroupedExperts.run_experts` on that and the per-expert row
counts, weights each output row by its routing weight and adds it back to its token. Only
``run_experts`` touches the expert weights, so expert parallelism
(:mod:`lightning_vescale.parallel.expert_parallel`) replaces just that step with an all-to-all
dispatch, the local experts, and an all-to-all combine. No distributed code lives here.

[Note: load balancing]
Two mechanisms, usable together:

* Auxiliary-loss-free balancing (DeepSeek-V3): each router has a buffer ``expert_bias`` added to the
  scores *only to choose* the top-k experts (the weights come from the unbiased scores). The router
  counts tokens per expert in ``tokens_per_expert`` (accumulated over forwards, e.g. micro-batches),
  and :meth:`MoE.update_expert_bias` nudges each bias by ``rate * sign(mean_load - load)`` and resets
  the counts. Run it once per optimizer step, before the step, as an optimizer pre-step hook::

      optimizer.register_step_pre_hook(lambda opt, args, kwargs: model.update_expert_bias(1e-3))

  With data parallelism the counts must first be summed over the ranks that see different data, or
  the biases drift apart: ``lightning_vescale.parallel.register_expert_bias_update`` does both.
* A switch-style auxiliary loss ``aux_loss_coef * E * sum_e f_e * P_e`` (``f_e`` the fraction of routed
  slots that chose expert e, ``P_e`` the mean routing probability of e), computed when
  ``aux_loss_coef > 0`` and exposed as ``MoEFeedForward.aux_loss`` after each forward;
  :meth:`MoE.aux_loss` sums it over the layers. Add it to the training loss.

[Note: expert weights and Hugging Face]
Expert weights are grouped 3-D tensors, ``w1_EDF`` / ``w3_EDF`` (gate / up, ``x @ w1_EDF[e]``) and
``w2_EFD`` (down). Hugging Face's per-expert ``gate_proj.weight`` (``[F, D]``) is ``w1_EDF[e].T``;
``lightning_vescale.models.hf`` stacks and transposes them. The router weight ``router.weight``
(``[E, D]``) is HF's ``mlp.gate.weight``; ``shared_experts.w1/w2/w3`` and ``shared_gate`` are Qwen2-MoE's
``shared_expert.*`` and ``shared_expert_gate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from lightning_vescale.models.llama import (
    Attention,
    Embedding,
    FeedForward,
    Linear,
    RMSNorm,
    RopeScaling,
    RotaryEmbedding,
    TransformerBlock,
    _lookup_preset,
    _output_head,
    _require_positive,
    _validate_attention_fields,
    reset_parameters_in_module_order,
    residual_init_std,
)

__all__ = [
    "MOE_CONFIGS",
    "GroupedExperts",
    "MoE",
    "MoEConfig",
    "MoEFeedForward",
    "RouterOutput",
    "TopKRouter",
    "check_group_routing",
    "moe_config",
    "num_active_params",
]


def check_group_routing(owner: object, num_experts: int, top_k: int, num_groups: int, top_k_groups: int) -> None:
    """Raise ``ValueError`` (naming ``owner``'s type) unless group-limited top-k routing is well defined.

    A group's score is the sum of its two best experts (DeepSeek-V3), so a group needs at least two experts,
    and the chosen groups must hold at least ``top_k`` experts.
    """
    name = owner if isinstance(owner, str) else type(owner).__name__
    if num_groups < 1 or num_experts % num_groups != 0:
        raise ValueError(
            f"{name}: num_expert_groups={num_groups} must be >= 1 and divide num_experts={num_experts}"
        )
    if num_groups == 1:
        return
    per_group = num_experts // num_groups
    if per_group < 2:
        raise ValueError(
            f"{name}: {num_experts} experts in {num_groups} groups leaves {per_group} per group; group-limited "
            "routing scores a group by its two best experts, so use at most num_experts // 2 groups"
        )
    if not 1 <= top_k_groups <= num_groups:
        raise ValueError(f"{name}: top_k_groups={top_k_groups} must be in [1, num_expert_groups={num_groups}]")
    if top_k > top_k_groups * per_group:
        raise ValueError(
            f"{name}: top_k={top_k} experts cannot be chosen from top_k_groups={top_k_groups} groups of "
            f"{per_group} experts; raise top_k_groups"
        )


@dataclass
class MoEConfig:
    """Shapes and hyper-parameters of an MoE decoder. Validated on construction.

    The attention/embedding fields mean the same as in :class:`~lightning_vescale.models.llama.LlamaConfig`.
    """

    vocab_size: int = 256
    """Number of token ids."""
    dim: int = 64
    """Model width ``D``."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads."""
    n_kv_heads: int = 2
    """Key/value heads; must divide ``n_heads``."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: Optional[RopeScaling] = None
    """Llama-3.1 frequency scaling or ``None``."""
    max_seq_len: int = 128
    """Longest sequence the RoPE tables cover."""
    tie_embeddings: bool = False
    """Use ``tok_embeddings.weight`` as the output head's weight."""
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2-MoE has them)."""
    init_std: float = 0.02
    """Standard deviation of the initial linear, embedding, router and expert weights."""
    num_experts: int = 4
    """Routed experts ``E`` per MoE layer."""
    top_k: int = 2
    """Experts chosen per token ``A``."""
    moe_hidden: int = 64
    """Hidden size ``F`` of each routed expert."""
    shared_expert_hidden: int = 0
    """Hidden size of the always-on shared expert FFN; 0 disables it (DeepSeek: n_shared * moe_hidden)."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output by ``sigmoid(shared_gate(x))`` per token (Qwen2-MoE)."""
    score_func: str = "softmax"
    """Router scores: ``"softmax"`` over experts (Mixtral, Qwen) or per-expert ``"sigmoid"`` (DeepSeek-V3).
    (A ``str``, not a ``Literal``, so the config can be a Hydra structured config.)"""
    route_norm: bool = True
    """Renormalize the chosen top-k weights to sum to one."""
    route_scale: float = 1.0
    """Multiply the routing weights by this (DeepSeek-V3's ``routed_scaling_factor``)."""
    num_expert_groups: int = 1
    """Split the experts into this many equal groups for group-limited routing (DeepSeek-V3's ``n_group``);
    1 disables the limit."""
    top_k_groups: int = 1
    """With ``num_expert_groups > 1``: each token chooses its experts only from its best ``top_k_groups``
    groups (DeepSeek-V3's ``topk_group``)."""
    aux_loss_coef: float = 0.0
    """Coefficient of the switch-style auxiliary loss; 0 disables it."""
    dense_layers: tuple[int, ...] = ()
    """Layers that use a dense SwiGLU instead of MoE (DeepSeek's first-k-dense, Qwen's mlp_only_layers)."""
    dense_ffn_hidden: int = 0
    """Hidden size of the dense layers' SwiGLU; required when ``dense_layers`` is not empty."""

    def __post_init__(self) -> None:
        _validate_attention_fields(self)
        _require_positive(self, ("num_experts", "top_k", "moe_hidden", "route_scale"))
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if self.shared_expert_hidden < 0:
            raise ValueError(f"MoEConfig.shared_expert_hidden must be >= 0, got {self.shared_expert_hidden}")
        if self.shared_expert_gate and self.shared_expert_hidden == 0:
            raise ValueError("MoEConfig.shared_expert_gate needs a shared expert: set shared_expert_hidden > 0")
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"MoEConfig.score_func must be 'softmax' or 'sigmoid', got {self.score_func!r}")
        check_group_routing(self, self.num_experts, self.top_k, self.num_expert_groups, self.top_k_groups)
        if self.aux_loss_coef < 0:
            raise ValueError(f"MoEConfig.aux_loss_coef must be >= 0, got {self.aux_loss_coef}")
        self.dense_layers = tuple(sorted(set(self.dense_layers)))
        bad = [i for i in self.dense_layers if not 0 <= i < self.n_layers]
        if bad:
            raise ValueError(f"MoEConfig.dense_layers {bad} are not layers of a {self.n_layers}-layer model")
        if self.dense_layers and not self.dense_ffn_hidden > 0:
            raise ValueError(
                f"MoEConfig.dense_ffn_hidden must be > 0 when dense_layers={self.dense_layers}, "
                f"got {self.dense_ffn_hidden}"
            )

    @property
    def head_dim(self) -> int:
        """Per-head width ``dim // n_heads``."""
        return self.dim // self.n_heads


MOE_CONFIGS: dict[str, MoEConfig] = {
    # Unit tests: Mixtral-like routing with a shared expert.
    "tiny": MoEConfig(
        vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, num_experts=4, top_k=2, moe_hidden=64,
        shared_expert_hidden=64, max_seq_len=128,
    ),
    # DeepSeek-V3-like: sigmoid scores, one shared expert, first layer dense.
    "debug": MoEConfig(
        vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, num_experts=8, top_k=2, moe_hidden=256,
        shared_expert_hidden=256, score_func="sigmoid", route_norm=True, dense_layers=(0,), dense_ffn_hidden=768,
        max_seq_len=512,
    ),
    # ~165M total / ~50M active parameters: a real training run on one GPU.
    "small": MoEConfig(
        vocab_size=32000, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, num_experts=16, top_k=2, moe_hidden=768,
        shared_expert_hidden=768, score_func="sigmoid", route_norm=True, dense_layers=(0,), dense_ffn_hidden=1536,
        max_seq_len=2048, tie_embeddings=True,
    ),
}


def moe_config(name: str) -> MoEConfig:
    """A fresh copy of the preset ``name`` from :data:`MOE_CONFIGS`.

    Raises:
        ValueError: ``name`` is not a preset; the message lists the valid names.
    """
    return _lookup_preset("moe", MOE_CONFIGS, name)


# ----------------------------------------------------------------------------------------------------
# Router
# ----------------------------------------------------------------------------------------------------


class RouterOutput(NamedTuple):
    weights_NA: torch.Tensor
    """Routing weight of each chosen expert (x's dtype; differentiable w.r.t. the router weight)."""
    selected_NA: torch.Tensor
    """Chosen expert ids (int64)."""
    scores_NE: torch.Tensor
    """Unbiased fp32 scores of every expert (softmax or sigmoid)."""
    num_tokens_per_expert_E: torch.Tensor
    """How many (token, slot) pairs chose each expert in this forward (int64)."""


class TopKRouter(nn.Module):
    """Scores every expert, chooses the top-k by ``score + expert_bias``, weights by the unbiased score.

    With ``num_groups > 1`` (DeepSeek-V3's group-limited routing) the experts form ``num_groups`` equal
    contiguous groups; a group's score is the sum of its two best ``score + expert_bias``, and each token
    chooses its top-k experts only inside its ``top_k_groups`` best groups.

    Buffers: ``expert_bias`` (persistent: it is training state) and ``tokens_per_expert`` (counts
    accumulated since the last :meth:`update_expert_bias`, for balancing and logging; not saved).
    """

    expert_bias: torch.Tensor
    tokens_per_expert: torch.Tensor

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: Literal["softmax", "sigmoid"],
        route_norm: bool,
        route_scale: float,
        init_std: float,
        num_groups: int = 1,
        top_k_groups: int = 1,
    ) -> None:
        super().__init__()
        check_group_routing(type(self).__name__, num_experts, top_k, num_groups, top_k_groups)
        self.num_experts = num_experts
        self.top_k = top_k
        self.num_groups = num_groups
        self.top_k_groups = top_k_groups
        self.score_func = score_func
        self.route_norm = route_norm
        self.route_scale = route_scale
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Zero ``expert_bias`` and ``tokens_per_expert``."""
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()

    def forward(self, x_ND: torch.Tensor) -> RouterOutput:
        logits_NE = F.linear(x_ND, self.weight)
        if self.score_func == "softmax":
            scores_NE = torch.softmax(logits_NE.float(), dim=-1)
        else:
            scores_NE = torch.sigmoid(logits_NE.float())
        # The bias only decides which experts are chosen; it never enters the weights.
        choice_NE = scores_NE.detach() + self.expert_bias.float()
        if self.num_groups > 1:
            choice_NE = self._only_top_groups(choice_NE)
        _, selected_NA = torch.topk(choice_NE, self.top_k, dim=-1)
        weights_NA = scores_NE.gather(-1, selected_NA)
        if self.route_norm:
            weights_NA = weights_NA / weights_NA.sum(dim=-1, keepdim=True)
        weights_NA = weights_NA * self.route_scale
        num_tokens_per_expert_E = torch.bincount(selected_NA.flatten(), minlength=self.num_experts)
        with torch.no_grad():
            self.tokens_per_expert += num_tokens_per_expert_E
        return RouterOutput(weights_NA.to(x_ND.dtype), selected_NA, scores_NE, num_tokens_per_expert_E)

    def _only_top_groups(self, choice_NE: torch.Tensor) -> torch.Tensor:
        """``choice_NE`` with the experts outside each token's ``top_k_groups`` best groups set to -inf."""
        N = choice_NE.shape[0]
        choice_NGX = choice_NE.view(N, self.num_groups, -1)  # X: experts per group
        group_score_NG = choice_NGX.topk(2, dim=-1).values.sum(dim=-1)
        top_groups = group_score_NG.topk(self.top_k_groups, dim=-1).indices
        keep_NG = torch.zeros_like(group_score_NG, dtype=torch.bool).scatter_(1, top_groups, True)
        return choice_NGX.masked_fill(~keep_NG[..., None], float("-inf")).view(N, -1)

    @torch.no_grad()
    def update_expert_bias(self, rate: float) -> None:
        """DeepSeek-V3 balancing step: raise the bias of under-loaded experts, lower the over-loaded.

        ``expert_bias += rate * sign(mean_load - load)`` (centred to zero mean), then
        ``tokens_per_expert`` is reset. A no-op when no tokens were counted.
        """
        load_E = self.tokens_per_expert.float()
        delta_E = rate * torch.sign(load_E.mean() - load_E)
        self.expert_bias.add_((delta_E - delta_E.mean()).to(self.expert_bias.dtype))
        self.tokens_per_expert.zero_()

    def extra_repr(self) -> str:
        groups = f", num_groups={self.num_groups}, top_k_groups={self.top_k_groups}" if self.num_groups > 1 else ""
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, score_func={self.score_func}, "
            f"route_norm={self.route_norm}, route_scale={self.route_scale}{groups}"
        )


# ----------------------------------------------------------------------------------------------------
# Experts
# ----------------------------------------------------------------------------------------------------


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts held as grouped 3-D parameters ``w1_EDF``, ``w2_EFD``, ``w3_EDF``.

    Expert e computes ``(silu(x @ w1_EDF[e]) * (x @ w3_EDF[e])) @ w2_EFD[e]``.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, *, init_std: float, out_init_std: float) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.init_std = init_std
        self.out_init_std = out_init_std
        self.w1_EDF = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2_EFD = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3_EDF = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.w1_EDF, mean=0.0, std=self.init_std)
        nn.init.normal_(self.w2_EFD, mean=0.0, std=self.out_init_std)
        nn.init.normal_(self.w3_EDF, mean=0.0, std=self.init_std)

    def forward(
        self,
        x_ND: torch.Tensor,
        selected_NA: torch.Tensor,
        weights_NA: torch.Tensor,
        num_tokens_per_expert_E: torch.Tensor,
    ) -> torch.Tensor:
        """Sort (token, slot) pairs by expert, run the experts, weight and add back per token."""
        top_k = selected_NA.shape[1]
        order_R = torch.argsort(selected_NA.flatten(), stable=True)
        token_R = order_R // top_k
        routed_input_RD = x_ND[token_R]
        routed_output_RD = self.run_experts(routed_input_RD, num_tokens_per_expert_E)
        routed_output_RD = routed_output_RD * weights_NA.flatten()[order_R, None]
        return torch.zeros_like(x_ND).index_add(0, token_R, routed_output_RD)

    def run_experts(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """Rows of ``x_RD`` are grouped by expert: the first ``num_tokens_per_expert_E[0]`` go to expert 0, ...

        A loop over experts (one pair of matmuls per expert on its contiguous rows); expert parallelism
        overrides this method.
        """
        outputs = []
        for e, x_e in enumerate(torch.split(x_RD, num_tokens_per_expert_E.tolist())):
            h_e = F.silu(x_e @ self.w1_EDF[e]) * (x_e @ self.w3_EDF[e])
            outputs.append(h_e @ self.w2_EFD[e])
        return torch.cat(outputs)

    def forward_per_expert_loop(
        self, x_ND: torch.Tensor, selected_NA: torch.Tensor, weights_NA: torch.Tensor
    ) -> torch.Tensor:
        """Reference (Hugging Face's formulation): for each expert, find its tokens and add its output."""
        out_ND = torch.zeros_like(x_ND)
        for e in range(self.num_experts):
            token_idx, slot_idx = torch.where(selected_NA == e)
            x_e = x_ND[token_idx]
            h_e = F.silu(x_e @ self.w1_EDF[e]) * (x_e @ self.w3_EDF[e])
            out_ND = out_ND.index_add(0, token_idx, (h_e @ self.w2_EFD[e]) * weights_NA[token_idx, slot_idx, None])
        return out_ND

    def extra_repr(self) -> str:
        E, D, F_ = self.w1_EDF.shape
        return f"num_experts={E}, dim={D}, hidden={F_}"


class MoEFeedForward(nn.Module):
    """Routed experts plus optional (gated) shared experts: ``forward(x_BTD) -> out_BTD``.

    After each forward, ``aux_loss`` holds the switch-style auxiliary loss (``None`` when
    ``aux_loss_coef == 0``).

    ``config`` is an :class:`MoEConfig` or another family's config with the same routing fields
    (``dim``, ``num_experts``, ``top_k``, ``moe_hidden``, ``score_func``, ``route_norm``, ``route_scale``,
    ``num_expert_groups``, ``top_k_groups``, ``shared_expert_hidden``, ``shared_expert_gate``,
    ``aux_loss_coef``, ``init_std``).
    """

    def __init__(self, config: MoEConfig, *, out_init_std: float) -> None:
        super().__init__()
        self.aux_loss_coef = config.aux_loss_coef
        self.router = TopKRouter(
            config.dim,
            config.num_experts,
            config.top_k,
            score_func=cast(Literal["softmax", "sigmoid"], config.score_func),  # checked by MoEConfig
            route_norm=config.route_norm,
            route_scale=config.route_scale,
            init_std=config.init_std,
            num_groups=config.num_expert_groups,
            top_k_groups=config.top_k_groups,
        )
        self.experts = GroupedExperts(
            config.dim, config.moe_hidden, config.num_experts, init_std=config.init_std, out_init_std=out_init_std
        )
        self.shared_experts: Optional[FeedForward] = None
        self.shared_gate: Optional[Linear] = None
        if config.shared_expert_hidden > 0:
            self.shared_experts = FeedForward(
                config.dim, config.shared_expert_hidden, init_std=config.init_std, out_init_std=out_init_std
            )
        if config.shared_expert_gate:
            self.shared_gate = Linear(config.dim, 1, init_std=config.init_std)
        self.aux_loss: Optional[torch.Tensor] = None

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self._forward(x_BTD, per_expert_loop=False)

    def forward_per_expert_loop(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """Same as :meth:`forward` with the reference per-expert loop for the routed experts (tests)."""
        return self._forward(x_BTD, per_expert_loop=True)

    def _forward(self, x_BTD: torch.Tensor, *, per_expert_loop: bool) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        routing = self.router(x_ND)
        if per_expert_loop:
            out_ND = self.experts.forward_per_expert_loop(x_ND, routing.selected_NA, routing.weights_NA)
        else:
            out_ND = self.experts(x_ND, routing.selected_NA, routing.weights_NA, routing.num_tokens_per_expert_E)
        if self.shared_experts is not None:
            shared_ND = self.shared_experts(x_ND)
            if self.shared_gate is not None:
                shared_ND = torch.sigmoid(self.shared_gate(x_ND)) * shared_ND
            out_ND = out_ND + shared_ND
        self.aux_loss = self._aux_loss(routing) if self.aux_loss_coef > 0 else None
        return out_ND.view(B, T, D)

    def _aux_loss(self, routing: RouterOutput) -> torch.Tensor:
        num_experts = routing.scores_NE.shape[1]
        probs_NE = routing.scores_NE
        if self.router.score_func == "sigmoid":
            probs_NE = probs_NE / probs_NE.sum(dim=-1, keepdim=True)
        fraction_E = routing.num_tokens_per_expert_E.float() / routing.selected_NA.numel()
        return self.aux_loss_coef * num_experts * (fraction_E * probs_NE.mean(dim=0)).sum()


# ----------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------


class MoE(nn.Module):
    """MoE decoder: ``forward(tokens_BT) -> logits_BTV``.

    Same layout as :class:`~lightning_vescale.models.llama.Llama` (``tok_embeddings``, ``rope``,
    ``layers``, ``norm``, ``output``); each block's ``feed_forward`` is a :class:`MoEFeedForward`,
    or a dense :class:`~lightning_vescale.models.llama.FeedForward` for ``config.dense_layers``.

    Other MoE families (:class:`~lightning_vescale.models.qwen3_moe.Qwen3MoE`,
    :class:`~lightning_vescale.models.deepseek_v3.DeepSeekV3`) subclass this and override
    :meth:`_attention` and :meth:`_rotary_embedding`; everything else is shared.
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = Embedding(config.vocab_size, config.dim, init_std=config.init_std)
        self.rope = self._rotary_embedding(config)
        self.layers = nn.ModuleList(self._block(config, layer_id) for layer_id in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = _output_head(config.dim, config.vocab_size, self.tok_embeddings, config.tie_embeddings)

    @staticmethod
    def _rotary_embedding(config: MoEConfig) -> RotaryEmbedding:
        return RotaryEmbedding(config.head_dim, config.max_seq_len, config.rope_theta, config.rope_scaling)

    @staticmethod
    def _attention(config: MoEConfig, out_init_std: float) -> nn.Module:
        return Attention(
            dim=config.dim,
            n_heads=config.n_heads,
            n_kv_heads=config.n_kv_heads,
            qkv_bias=config.qkv_bias,
            init_std=config.init_std,
            out_init_std=out_init_std,
        )

    def _block(self, config: MoEConfig, layer_id: int) -> TransformerBlock:
        out_init_std = residual_init_std(config.init_std, layer_id)
        feed_forward: nn.Module
        if layer_id in config.dense_layers:
            feed_forward = FeedForward(
                config.dim, config.dense_ffn_hidden, init_std=config.init_std, out_init_std=out_init_std
            )
        else:
            feed_forward = MoEFeedForward(config, out_init_std=out_init_std)
        attention = self._attention(config, out_init_std)
        return TransformerBlock(attention, feed_forward, dim=config.dim, norm_eps=config.norm_eps)

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        cos_TK, sin_TK = self.rope(tokens_BT.shape[1])
        h_BTD = self.tok_embeddings(tokens_BT)
        for layer in self.layers:
            h_BTD = layer(h_BTD, cos_TK, sin_TK)
        return self.output(self.norm(h_BTD))

    def moe_layers(self) -> list[MoEFeedForward]:
        """The MoE feed-forwards, in layer order."""
        return [m for m in self.modules() if isinstance(m, MoEFeedForward)]

    def aux_loss(self) -> torch.Tensor:
        """Sum of the layers' auxiliary losses from the last forward (zero when disabled)."""
        losses = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
        if not losses:
            return torch.zeros((), device=self.norm.weight.device)
        return torch.stack(losses).sum()

    def update_expert_bias(self, rate: float) -> None:
        """:meth:`TopKRouter.update_expert_bias` on every layer; run it as an optimizer pre-step hook."""
        for moe in self.moe_layers():
            moe.router.update_expert_bias(rate)

    def init_weights(self) -> None:
        """(Re)initialize every parameter and buffer, in ``modules()`` order (see llama.py's note)."""
        reset_parameters_in_module_order(self)

    def init_buffers(self) -> None:
        """Recompute RoPE tables and zero the routers' buffers (after ``to_empty``, before loading)."""
        self.rope.init_rope()
        for moe in self.moe_layers():
            moe.router.reset_buffers()

    def num_active_params(self) -> int:
        """Parameters touched per token: all but the ``E - top_k`` unchosen routed experts of each MoE layer.

        Works on the meta device; a tied weight counts once.
        """
        total = sum(p.numel() for p in self.parameters())
        for moe in self.moe_layers():
            experts, router = moe.experts, moe.router
            per_expert = sum(p.numel() for p in experts.parameters()) // experts.num_experts
            total -= (router.num_experts - router.top_k) * per_expert
        return total


def num_active_params(config: MoEConfig) -> int:
    """Parameters touched per token of the :class:`MoE` built from ``config`` (see :meth:`MoE.num_active_params`)."""
    with torch.device("meta"):
        return MoE(config).num_active_params()


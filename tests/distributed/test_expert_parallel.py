"""Expert parallelism on gloo ranks equals the full model run on each rank's own tokens.

On 2 and 4 ranks (one class per world size, :class:`tests.dist_pool.DistributedTest`), every rank builds the same full
MoE (fp64, decisive routing) and its ``apply_expert_parallel`` copy, and runs both on its own tokens (other lengths
per rank), for a softmax router without shared expert, a sigmoid router with a gated shared expert, an auxiliary
loss and a dense first layer, and a softmax router whose rank 0 sends nothing to the other ranks (skewed):

* the logits and every parameter's gradient equal the full model's (a local expert's gradient: the full gradients
  summed over the ranks, its slice of the experts);
* one MoE feed-forward with a differentiable input: its output and input gradient equal the full model's;
* the balancing hook sums the counts over the group: every rank gets the same expert bias, the expected one.

All comparisons are ``assert_close`` at atol 1e-10, rtol 1e-9 (fp64: a summation-order difference cannot hide a wrong
gradient), the biases gathered over the ranks bitwise equal. Errors: applying it twice is refused; on 4 ranks, 6
experts that do not divide over them are refused.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

from lightning_vescale.models import MoE, moe_config
from lightning_vescale.parallel import apply_expert_parallel, register_expert_bias_update
from lightning_vescale.parallel.expert_parallel import ExpertParallelGroupedExperts
from tests.dist_pool import DistributedTest

CONFIGS = {
    "softmax": dict(num_experts=8, top_k=2, shared_expert_hidden=0),
    "sigmoid-shared-aux": dict(
        num_experts=8, top_k=3, score_func="sigmoid", shared_expert_hidden=32, shared_expert_gate=True,
        aux_loss_coef=0.01, dense_layers=(0,), dense_ffn_hidden=48, n_layers=3,
    ),
}
# (config, skew): rank 0 routing everything to its own experts (it sends nothing to the other ranks).
CASES = {"softmax": ("softmax", False), "sigmoid-shared-aux": ("sigmoid-shared-aux", False),
         "skewed-softmax": ("softmax", True)}


def _check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    # fp64, so that a summation-order difference cannot hide a wrong gradient.
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-9, msg=lambda m: f"{name}: {m}")


def _setup(rank: int, world_size: int, case: str):
    """The full model, its expert-parallel copy and this rank's inputs (the draws in one fixed order)."""
    config_name, skew = CASES[case]
    torch.manual_seed(0)  # the same full model on every rank
    config = dataclasses.replace(moe_config("tiny"), **CONFIGS[config_name])
    full = MoE(config).double()
    with torch.no_grad():
        for module in full.moe_layers():
            module.router.weight.normal_(0, 1.0)  # decisive routing: no near-ties between experts
    if skew and rank == 0:
        # Rank 0 routes everything to its own experts: it sends nothing to the other ranks.
        for module in full.moe_layers():
            module.router.expert_bias[: config.top_k] = 100.0
    ep_model = apply_expert_parallel(copy.deepcopy(full), dist.group.WORLD)

    # Different tokens (and lengths) on each rank.
    generator = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, config.vocab_size, (2, 6 + 3 * rank), generator=generator)
    upstream = torch.randn(*tokens.shape, config.vocab_size, generator=generator, dtype=torch.float64)
    x = torch.randn(3, 5 + rank, config.dim, generator=generator, dtype=torch.float64)
    return config, full, ep_model, tokens, upstream, x


def _logits_and_gradients(rank: int, world_size: int, case: str) -> None:
    config, full, ep_model, tokens, upstream, _ = _setup(rank, world_size, case)
    num_local = config.num_experts // world_size
    start = rank * num_local
    want = full(tokens)
    got = ep_model(tokens)
    _check("logits", got, want)
    ((want * upstream).sum() + full.aux_loss()).backward()
    ((got * upstream).sum() + ep_model.aux_loss()).backward()

    for name, param in ep_model.named_parameters():
        ref_grad = full.get_parameter(name).grad
        if ".experts." in name:
            # A local expert's gradient sums every rank's tokens: compare with the summed full gradients.
            summed = ref_grad.clone()
            dist.all_reduce(summed)
            assert param.shape[0] == num_local
            _check(name, param.grad, summed[start : start + num_local])
        else:
            _check(name, param.grad, ref_grad)


def _feed_forward_input_gradients(rank: int, world_size: int, case: str) -> None:
    """One MoE feed-forward with a differentiable input: input gradients match too."""
    _, full, ep_model, _, _, x = _setup(rank, world_size, case)
    layer = next(i for i, block in enumerate(full.layers) if hasattr(block.feed_forward, "router"))
    ffn_ref, ffn_ep = full.layers[layer].feed_forward, ep_model.layers[layer].feed_forward
    assert isinstance(ffn_ep.experts, ExpertParallelGroupedExperts)
    x_ref, x_ep = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_ref, out_ep = ffn_ref(x_ref), ffn_ep(x_ep)
    _check("ffn out", out_ep, out_ref)
    out_ref.pow(2).sum().backward()
    out_ep.pow(2).sum().backward()
    _check("input grad", x_ep.grad, x_ref.grad)


def _bias_balancing(rank: int, world_size: int, case: str) -> None:
    """The balancing hook sums the counts over the group, so every rank gets the same bias."""
    _, full, ep_model, tokens, upstream, x = _setup(rank, world_size, case)
    # The routers count the tokens of the model's forward and of one feed-forward's.
    ((ep_model(tokens) * upstream).sum() + ep_model.aux_loss()).backward()
    layer = next(i for i, block in enumerate(full.layers) if hasattr(block.feed_forward, "router"))
    ep_model.layers[layer].feed_forward(x.clone().requires_grad_(True)).pow(2).sum().backward()

    counts = torch.stack([m.router.tokens_per_expert for m in ep_model.moe_layers()]).clone()
    dist.all_reduce(counts)
    assert counts.sum() > 0, "the routers must have counted tokens for the check to mean anything"
    expected = []
    for m, c in zip(ep_model.moe_layers(), counts):
        delta = 1e-3 * torch.sign(c.float().mean() - c.float())
        expected.append(m.router.expert_bias + delta - delta.mean())
    optimizer = torch.optim.SGD(ep_model.parameters(), lr=0.0)
    register_expert_bias_update(ep_model, optimizer, rate=1e-3, group=dist.group.WORLD)
    optimizer.step()
    for m, want_bias in zip(ep_model.moe_layers(), expected):
        _check("expert_bias", m.router.expert_bias, want_bias)
        gathered = [torch.empty_like(want_bias) for _ in range(world_size)]
        dist.all_gather(gathered, m.router.expert_bias)
        assert all(torch.equal(g, gathered[0]) for g in gathered)
        assert m.router.tokens_per_expert.sum() == 0


def _applying_twice_is_refused(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match="already expert parallel"):
        apply_expert_parallel(apply_expert_parallel(MoE(moe_config("tiny")), dist.group.WORLD), dist.group.WORLD)


def _experts_that_do_not_divide_are_refused(rank: int, world_size: int) -> None:
    odd = dataclasses.replace(moe_config("tiny"), num_experts=6)
    with pytest.raises(ValueError, match="has 6 experts, which does not divide over .* 4 ranks"):
        apply_expert_parallel(MoE(odd), dist.group.WORLD)


class _ExpertParallelTests(DistributedTest):
    @pytest.mark.parametrize("case", list(CASES))
    def test_logits_and_gradients_match_the_full_model(self, case: str) -> None:
        self.run_ranks(_logits_and_gradients, case)

    @pytest.mark.parametrize("case", list(CASES))
    def test_feed_forward_input_gradients_match_the_full_model(self, case: str) -> None:
        self.run_ranks(_feed_forward_input_gradients, case)

    @pytest.mark.parametrize("case", ["softmax", "sigmoid-shared-aux"])
    def test_bias_balancing_gives_every_rank_the_same_bias(self, case: str) -> None:
        self.run_ranks(_bias_balancing, case)

    def test_applying_expert_parallel_twice_is_refused(self) -> None:
        self.run_ranks(_applying_twice_is_refused)


class TestExpertParallelOn2Ranks(_ExpertParallelTests):
    world_size = 2


class TestExpertParallelOn4Ranks(_ExpertParallelTests):
    world_size = 4

    def test_experts_that_do_not_divide_over_the_ranks_are_refused(self) -> None:
        self.run_ranks(_experts_that_do_not_divide_are_refused)

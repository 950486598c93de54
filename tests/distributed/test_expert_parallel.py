"""Expert parallelism on gloo ranks equals the full model run on each rank's own tokens."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

from lightning_vescale.models import MoE, moe_config
from lightning_vescale.parallel import apply_expert_parallel, register_expert_bias_update
from lightning_vescale.parallel.expert_parallel import ExpertParallelGroupedExperts
from tests.dist_utils import run_distributed

CONFIGS = {
    "softmax": dict(num_experts=8, top_k=2, shared_expert_hidden=0),
    "sigmoid-shared-aux": dict(
        num_experts=8, top_k=3, score_func="sigmoid", shared_expert_hidden=32, shared_expert_gate=True,
        aux_loss_coef=0.01, dense_layers=(0,), dense_ffn_hidden=48, n_layers=3,
    ),
}


def _check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    # fp64, so that a summation-order difference cannot hide a wrong gradient.
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-9, msg=lambda m: f"{name}: {m}")


def _run_case(rank: int, world_size: int, overrides: dict, skew: bool) -> None:
    torch.manual_seed(0)  # the same full model on every rank
    config = dataclasses.replace(moe_config("tiny"), **overrides)
    full = MoE(config).double()
    with torch.no_grad():
        for module in full.moe_layers():
            module.router.weight.normal_(0, 1.0)  # decisive routing: no near-ties between experts
    if skew and rank == 0:
        # Rank 0 routes everything to its own experts: it sends nothing to the other ranks.
        for module in full.moe_layers():
            module.router.expert_bias[: config.top_k] = 100.0
    ep_model = apply_expert_parallel(copy.deepcopy(full), dist.group.WORLD)
    num_local = config.num_experts // world_size
    start = rank * num_local

    # Different tokens (and lengths) on each rank.
    generator = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, config.vocab_size, (2, 6 + 3 * rank), generator=generator)
    upstream = torch.randn(*tokens.shape, config.vocab_size, generator=generator, dtype=torch.float64)

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

    # One MoE feed-forward with a differentiable input: input gradients match too.
    layer = next(i for i, block in enumerate(full.layers) if hasattr(block.feed_forward, "router"))
    ffn_ref, ffn_ep = full.layers[layer].feed_forward, ep_model.layers[layer].feed_forward
    assert isinstance(ffn_ep.experts, ExpertParallelGroupedExperts)
    x = torch.randn(3, 5 + rank, config.dim, generator=generator, dtype=torch.float64)
    x_ref, x_ep = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_ref, out_ep = ffn_ref(x_ref), ffn_ep(x_ep)
    _check("ffn out", out_ep, out_ref)
    out_ref.pow(2).sum().backward()
    out_ep.pow(2).sum().backward()
    _check("input grad", x_ep.grad, x_ref.grad)

    if skew:
        return
    # The balancing hook sums the counts over the group, so every rank gets the same bias.
    counts = torch.stack([m.router.tokens_per_expert for m in ep_model.moe_layers()]).clone()
    dist.all_reduce(counts)
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


def _worker(rank: int, world_size: int) -> None:
    for overrides in CONFIGS.values():
        _run_case(rank, world_size, overrides, skew=False)
    _run_case(rank, world_size, CONFIGS["softmax"], skew=True)
    # Errors are clear.
    with pytest.raises(ValueError, match="already expert parallel"):
        apply_expert_parallel(apply_expert_parallel(MoE(moe_config("tiny")), dist.group.WORLD), dist.group.WORLD)
    if world_size == 4:
        odd = dataclasses.replace(moe_config("tiny"), num_experts=6)
        with pytest.raises(ValueError, match="has 6 experts, which does not divide over .* 4 ranks"):
            apply_expert_parallel(MoE(odd), dist.group.WORLD)


@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel_matches_full_model(world_size):
    run_distributed(_worker, world_size, timeout=120)

"""Qwen3-MoE and DeepSeek-V3 models: real-size presets, configs, group-limited routing, YaRN, initialization."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lightning_vescale.models import (
    DEEPSEEK_V3_CONFIGS,
    QWEN3_MOE_CONFIGS,
    DeepSeekV3,
    DeepSeekV3Config,
    Qwen3MoE,
    Qwen3MoEConfig,
    YarnScaling,
    deepseek_v3_config,
    num_params,
    qwen3_moe_config,
)
from lightning_vescale.models.moe import TopKRouter
from lightning_vescale.models.yarn import yarn_inv_freq


def _floor(x: float, digits: int) -> float:
    return math.floor(x * 10**digits) / 10**digits


def test_real_size_presets_match_the_published_parameter_counts():
    """Built on the meta device (no memory). Model cards state totals truncated: 30.5B / 3.3B active, ..."""
    counts = {}
    for build, lookup, name in [(Qwen3MoE, qwen3_moe_config, "30b_a3b"), (Qwen3MoE, qwen3_moe_config, "235b_a22b"),
                                (DeepSeekV3, deepseek_v3_config, "671b")]:
        with torch.device("meta"):
            model = build(lookup(name))
        buffers = sum(b.numel() for n, b in model.named_buffers() if n.endswith("expert_bias"))
        counts[name] = (num_params(model), model.num_active_params(), buffers)
        assert all(p.is_meta for p in model.parameters())
    # Qwen/Qwen3-30B-A3B: "30.5B in total and 3.3B activated"; the exact count of the released tensors.
    total, active, _ = counts["30b_a3b"]
    assert (_floor(total / 1e9, 1), _floor(active / 1e9, 1)) == (30.5, 3.3)
    assert total == 30_532_122_624
    # Qwen/Qwen3-235B-A22B: "235B in total and 22B activated".
    total, active, _ = counts["235b_a22b"]
    assert (math.floor(total / 1e9), math.floor(active / 1e9)) == (235, 22)
    assert total == 235_093_634_560
    # DeepSeek-V3: "671B total parameters with 37B activated for each token" (main model, without MTP); the
    # routers' e_score_correction_bias (58 MoE layers x 256) is stored with the weights.
    total, active, biases = counts["671b"]
    assert (math.floor(total / 1e9), math.floor(active / 1e9)) == (671, 37)
    assert biases == 58 * 256 and total + biases == 671_026_419_200


def test_tiny_presets_have_the_family_features():
    qwen3 = qwen3_moe_config("tiny")
    assert qwen3.head_dim * qwen3.n_heads != qwen3.dim
    deepseek = deepseek_v3_config("tiny")
    assert deepseek.q_lora_rank and deepseek.num_expert_groups > 1
    assert deepseek.n_shared_experts and deepseek.n_dense_layers
    assert set(QWEN3_MOE_CONFIGS) == {"tiny", "30b_a3b", "235b_a22b"} and set(DEEPSEEK_V3_CONFIGS) == {"tiny", "671b"}
    with pytest.raises(ValueError, match=r"unknown deepseek_v3 config 'v2'; valid names are: 671b, tiny"):
        deepseek_v3_config("v2")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(n_heads=4, n_kv_heads=3), r"Qwen3MoEConfig.n_kv_heads \(3\) must divide n_heads \(4\)"),
        (dict(head_dim=15), r"head_dim \(15\) must be even"),
        (dict(top_k=9), r"top_k \(9\) must be <= num_experts \(8\)"),
        (dict(dense_layers=(2,)), r"dense_layers \[2\] are not layers of a 2-layer model"),
        (dict(dense_layers=(1,)), r"dense_ffn_hidden must be > 0"),
        (dict(rope_scaling=dict(factor=0.5)), r"rope_scaling.factor must be >= 1"),
        (dict(moe_hidden=0), r"Qwen3MoEConfig.moe_hidden must be > 0"),
    ],
)
def test_qwen3_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Qwen3MoEConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_expert_groups=3), r"num_expert_groups=3 must be >= 1 and divide num_experts=8"),
        (dict(num_expert_groups=8), r"8 experts in 8 groups leaves 1 per group"),
        (dict(top_k_groups=5), r"top_k_groups=5 must be in \[1, num_expert_groups=4\]"),
        (dict(top_k=5, top_k_groups=2), r"top_k=5 experts cannot be chosen from top_k_groups=2 groups of 2"),
        (dict(q_lora_rank=-1), r"q_lora_rank must be >= 0 \(0: no bottleneck\)"),
        (dict(qk_rope_head_dim=7), r"qk_rope_head_dim \(7\) must be even"),
        (dict(n_dense_layers=4), r"n_dense_layers must be in \[0, n_layers=3\]"),
        (dict(rope_scaling=[1]), r"rope_scaling must be None, a YarnScaling or a dict"),
    ],
)
def test_deepseek_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DeepSeekV3Config(**kwargs)


def test_group_limited_routing_matches_reference():
    """DeepSeek-V3's rule, written out per token: best groups by the sum of their two best biased scores."""
    torch.manual_seed(0)
    E, G, top_groups, k = 16, 4, 2, 4
    router = TopKRouter(32, E, k, score_func="sigmoid", route_norm=True, route_scale=2.5, init_std=1.0,
                        num_groups=G, top_k_groups=top_groups)
    ungrouped = TopKRouter(32, E, k, score_func="sigmoid", route_norm=True, route_scale=2.5, init_std=1.0)
    with torch.no_grad():
        router.expert_bias.normal_(0, 0.3)
        ungrouped.load_state_dict(router.state_dict())
        ungrouped.weight.copy_(router.weight)
    x = torch.randn(64, 32)
    out = router(x)
    scores = torch.sigmoid(x @ router.weight.T)
    biased = scores + router.expert_bias
    for n in range(64):
        group_scores = [biased[n, g * 4 : (g + 1) * 4].topk(2).values.sum() for g in range(G)]
        groups = sorted(range(G), key=lambda g: -group_scores[g])[:top_groups]
        allowed = [e for g in groups for e in range(g * 4, (g + 1) * 4)]
        want = sorted(allowed, key=lambda e: -biased[n, e])[:k]
        assert sorted(out.selected_NA[n].tolist()) == sorted(want), n
        weights = scores[n, out.selected_NA[n]]
        torch.testing.assert_close(out.weights_NA[n], 2.5 * weights / weights.sum())
    # Negative control: without the limit, some tokens choose differently.
    plain = ungrouped(x)
    assert not torch.equal(plain.selected_NA.sort().values, out.selected_NA.sort().values)


def test_yarn_tables_equal_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for params in [dict(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0),
                   dict(factor=4.0, original_max_position_embeddings=32768),
                   dict(factor=8.0, original_max_position_embeddings=64, beta_fast=16.0, beta_slow=2.0, mscale=0.7,
                        mscale_all_dim=1.0)]:
        hf_config = transformers.Qwen3MoeConfig(
            hidden_size=64, num_attention_heads=4, head_dim=64, max_position_embeddings=16384,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **params},
        )
        want_inv_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
        inv_freq, factor = yarn_inv_freq(64, 10000.0, YarnScaling(**params))
        assert torch.equal(inv_freq, want_inv_freq), params
        assert factor == want_factor, params


def _materialize_by_modules(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


@pytest.mark.parametrize(
    "build,config",
    [
        (Qwen3MoE, qwen3_moe_config("tiny")),
        (Qwen3MoE, dataclasses.replace(qwen3_moe_config("tiny"), dense_layers=(0,), dense_ffn_hidden=48,
                                       tie_embeddings=True, rope_scaling=YarnScaling(factor=4.0))),
        (DeepSeekV3, deepseek_v3_config("tiny")),
        (DeepSeekV3, dataclasses.replace(deepseek_v3_config("tiny"), q_lora_rank=0, rope_interleave=False,
                                         rope_scaling=YarnScaling(factor=8.0, mscale=1.0, mscale_all_dim=1.0))),
    ],
    ids=["qwen3", "qwen3-dense-tied-yarn", "deepseek", "deepseek-full-q-yarn"],
)
def test_meta_init_module_order_equals_init_weights(build, config):
    """What the sharding engine relies on: reset_parameters() module by module equals init_weights()."""
    cpu = build(config)
    torch.manual_seed(1)
    cpu.init_weights()
    with torch.device("meta"):
        meta = build(config)
    meta.to_empty(device="cpu")
    _materialize_by_modules(meta, seed=1)
    want = {**dict(cpu.named_parameters()), **dict(cpu.named_buffers())}
    got = {**dict(meta.named_parameters()), **dict(meta.named_buffers())}
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    tokens = torch.randint(0, config.vocab_size, (2, 16))
    logits = cpu(tokens)
    assert logits.shape == (2, 16, config.vocab_size) and torch.isfinite(logits).all()
    assert torch.equal(meta(tokens), logits)
    # Causal: changing later tokens leaves earlier logits alone (routing is per token).
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % config.vocab_size
    torch.testing.assert_close(cpu(changed)[:, :10], logits[:, :10])

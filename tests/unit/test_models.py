"""Llama and MoE models: attention, RoPE, experts, initialization, configs, load balancing."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from lightning_vescale.models import (
    LLAMA_CONFIGS,
    Llama,
    LlamaConfig,
    MoE,
    MoEConfig,
    RopeScaling,
    llama_config,
    moe_config,
    num_active_params,
    num_params,
)
from lightning_vescale.models.llama import Attention, RotaryEmbedding, apply_rope, ffn_hidden_size, rope_inv_freq
from lightning_vescale.models.moe import MoEFeedForward


def _moe_config(**overrides) -> MoEConfig:
    return dataclasses.replace(moe_config("tiny"), **overrides)


# ---------------------------------------------------------------------------------------------------
# Attention and RoPE
# ---------------------------------------------------------------------------------------------------


def test_gqa_equals_mha_with_repeated_kv_heads():
    torch.manual_seed(0)
    dim, n_heads, n_kv_heads = 32, 8, 2
    head_dim, n_rep = dim // n_heads, n_heads // n_kv_heads
    gqa = Attention(dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, qkv_bias=True)
    mha = Attention(dim=dim, n_heads=n_heads, n_kv_heads=n_heads, qkv_bias=True)
    with torch.no_grad():
        for p in gqa.parameters():
            p.normal_()  # non-zero biases too
        for name in ("wk", "wv"):
            src, dst = getattr(gqa, name), getattr(mha, name)
            # Query head h reads key/value head h // n_rep: repeat each kv head's rows n_rep times.
            dst.weight.copy_(src.weight.view(n_kv_heads, head_dim, dim).repeat_interleave(n_rep, 0).reshape(-1, dim))
            dst.bias.copy_(src.bias.view(n_kv_heads, head_dim).repeat_interleave(n_rep, 0).reshape(-1))
        mha.wq.load_state_dict(gqa.wq.state_dict())
        mha.wo.load_state_dict(gqa.wo.state_dict())
    rope = RotaryEmbedding(head_dim, 16, 10000.0, None).double()
    x = torch.randn(2, 16, dim, dtype=torch.float64)
    cos, sin = rope(16)
    torch.testing.assert_close(gqa.double()(x, cos, sin), mha.double()(x, cos, sin), atol=1e-10, rtol=1e-10)


def test_rope_matches_reference_rotation():
    torch.manual_seed(0)
    T, H, K, theta = 12, 3, 8, 10000.0
    rope = RotaryEmbedding(K, T, theta, None)
    x = torch.randn(2, T, H, K, dtype=torch.float64)
    got = apply_rope(x, *rope(T))
    # Straightforward reference: rotate the pair (x[i], x[i + K/2]) by angle t * theta^(-2i/K).
    want = torch.empty_like(x)
    for t in range(T):
        for i in range(K // 2):
            angle = t * theta ** (-2 * i / K)
            a, b = x[:, t, :, i], x[:, t, :, i + K // 2]
            want[:, t, :, i] = a * math.cos(angle) - b * math.sin(angle)
            want[:, t, :, i + K // 2] = a * math.sin(angle) + b * math.cos(angle)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rope_equals_meta_interleaved_rope_after_row_permutation():
    """The weight map in llama.py's note: Meta rotates pairs (2i, 2i+1); permuted rows match ours."""
    torch.manual_seed(0)
    T, H, K, D = 10, 2, 8, 16
    w_meta = torch.randn(H * K, D)
    x = torch.randn(1, T, D)
    # Meta: complex rotation of interleaved pairs.
    q = (x @ w_meta.T).view(1, T, H, K // 2, 2)
    freqs_cis = torch.polar(torch.ones(T, K // 2), torch.outer(torch.arange(T).float(), rope_inv_freq(K, 10000.0)))
    q_meta = torch.view_as_real(torch.view_as_complex(q) * freqs_cis[None, :, None]).reshape(1, T, H, K)
    # Ours: permuted weights, rotate-half RoPE; then undo the permutation of the output dims.
    w_ours = w_meta.view(H, K // 2, 2, D).transpose(1, 2).reshape(H * K, D)
    rope = RotaryEmbedding(K, T, 10000.0, None)
    q_ours = apply_rope((x @ w_ours.T).view(1, T, H, K), *rope(T))
    q_ours_interleaved = q_ours.view(1, T, H, 2, K // 2).transpose(3, 4).reshape(1, T, H, K)
    torch.testing.assert_close(q_ours_interleaved, q_meta, atol=1e-5, rtol=1e-5)


def _meta_apply_scaling(freqs: list[float], factor, low, high, old_context_len) -> list[float]:
    """Meta's reference (llama-models ``apply_scaling``), in Python floats."""
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


@pytest.mark.parametrize(
    "head_dim,theta,scaling",
    [(128, 500000.0, RopeScaling(8.0, 1.0, 4.0, 8192)), (64, 500000.0, RopeScaling(32.0, 1.0, 4.0, 8192)),
     (16, 10000.0, RopeScaling(4.0, 1.0, 4.0, 64))],
)
def test_llama31_rope_scaling_matches_reference_formula(head_dim, theta, scaling):
    plain = [theta ** (-2 * i / head_dim) for i in range(head_dim // 2)]
    want = _meta_apply_scaling(
        plain, scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor,
        scaling.original_max_position_embeddings,
    )
    got = rope_inv_freq(head_dim, theta, scaling)
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)
    # All three regimes are exercised: kept, divided, interpolated.
    ratio = torch.tensor(plain) / torch.tensor(want)
    assert (ratio - 1).abs().min() < 1e-6 and (ratio - scaling.factor).abs().min() < 1e-3
    assert ((ratio > 1 + 1e-3) & (ratio < scaling.factor - 1e-3)).any()


# ---------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "moe"])
def test_forward_shape_and_causality(kind):
    torch.manual_seed(0)
    model = Llama(llama_config("tiny")) if kind == "llama" else MoE(_moe_config(dense_layers=(0,), dense_ffn_hidden=96))
    tokens = torch.randint(0, 256, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 256)
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    # Routing is per token, so an MoE is causal too.
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])
    with pytest.raises(ValueError, match="exceeds max_seq_len=128"):
        model(torch.zeros(1, 129, dtype=torch.long))


def test_tied_embeddings_share_one_parameter():
    config = dataclasses.replace(llama_config("tiny"), tie_embeddings=True)
    model = Llama(config)
    assert model.output.weight is model.tok_embeddings.weight
    assert "output.weight" not in model.state_dict()
    untied = Llama(llama_config("tiny"))
    assert num_params(untied) - num_params(model) == config.vocab_size * config.dim


def _materialize_by_modules(model: torch.nn.Module, seed: int) -> None:
    """What the sharding engine does: reset_parameters() module by module in modules() order."""
    torch.manual_seed(seed)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def _all_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize(
    "config",
    [
        llama_config("tiny"),
        dataclasses.replace(llama_config("tiny"), tie_embeddings=True, qkv_bias=True,
                            rope_scaling=RopeScaling(8.0, 1.0, 4.0, 32)),
        _moe_config(),
        _moe_config(shared_expert_gate=True, score_func="sigmoid", dense_layers=(1,), dense_ffn_hidden=96,
                    tie_embeddings=True),
    ],
    ids=["llama", "llama-tied-bias-scaled", "moe", "moe-gated-sigmoid-dense-tied"],
)
def test_meta_init_module_order_equals_init_weights(config):
    build = Llama if isinstance(config, LlamaConfig) else MoE
    cpu = build(config)
    torch.manual_seed(1)
    cpu.init_weights()

    with torch.device("meta"):
        by_modules, by_init = build(config), build(config)
    for model in (by_modules, by_init):
        model.to_empty(device="cpu")
    _materialize_by_modules(by_modules, seed=1)
    torch.manual_seed(1)
    by_init.init_weights()

    want = _all_tensors(cpu)
    for model in (by_modules, by_init):
        got = _all_tensors(model)
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=0, rtol=0, msg=name)
        if config.tie_embeddings:
            assert model.output.weight is model.tok_embeddings.weight
    tokens = torch.randint(0, config.vocab_size, (1, 8))
    torch.testing.assert_close(by_modules(tokens), cpu(tokens), atol=0, rtol=0)
    # Initialization is meaningful: norms are ones, residual projections are depth scaled.
    assert torch.equal(cpu.norm.weight, torch.ones_like(cpu.norm.weight))
    std_wq = cpu.layers[-1].attention.wq.weight.std().item()
    std_wo = cpu.layers[-1].attention.wo.weight.std().item()
    assert std_wo < std_wq


def test_preset_parameter_counts():
    counts = {}
    for name in LLAMA_CONFIGS:
        with torch.device("meta"):
            counts[name] = num_params(Llama(llama_config(name)))
    assert counts["1b"] == 1_235_814_400  # Llama-3.2-1B
    assert counts["8b"] == 8_030_261_248  # Llama-3-8B
    assert counts["70b"] == 70_553_706_496  # Llama-3-70B
    assert 40e6 < counts["small"] < 60e6
    assert llama_config("8b").ffn_hidden == 14336 and llama_config("70b").ffn_hidden == 28672
    assert ffn_hidden_size(2048, 256, 1.5) == 8192
    with torch.device("meta"):
        moe_small = MoE(moe_config("small"))
    assert 150e6 < num_params(moe_small) < 180e6 and 40e6 < num_active_params(moe_config("small")) < 60e6


# ---------------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(dim=60, n_heads=8), r"dim \(60\) must be divisible by n_heads \(8\)"),
        (dict(n_heads=4, n_kv_heads=3), r"n_kv_heads \(3\) must divide n_heads \(4\)"),
        (dict(dim=12, n_heads=4, n_kv_heads=4), r"head dim .* must be even"),
        (dict(vocab_size=0), r"LlamaConfig.vocab_size must be > 0"),
        (dict(norm_eps=0.0), r"LlamaConfig.norm_eps must be > 0"),
        (dict(ffn_hidden=-1), r"LlamaConfig.ffn_hidden must be > 0"),
        (dict(rope_scaling=dict(factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0)),
         r"rope_scaling.high_freq_factor \(1.0\) must be greater than"),
        (dict(rope_scaling=dict(factor=0.5)), r"rope_scaling.factor must be >= 1"),
    ],
)
def test_llama_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(top_k=5, num_experts=4), r"top_k \(5\) must be <= num_experts \(4\)"),
        (dict(num_experts=0), r"MoEConfig.num_experts must be > 0"),
        (dict(score_func="relu"), r"score_func must be 'softmax' or 'sigmoid'"),
        (dict(shared_expert_gate=True, shared_expert_hidden=0), r"shared_expert_gate needs a shared expert"),
        (dict(dense_layers=(5,)), r"dense_layers \[5\] are not layers of a 2-layer model"),
        (dict(dense_layers=(0,)), r"dense_ffn_hidden must be > 0"),
        (dict(aux_loss_coef=-1.0), r"aux_loss_coef must be >= 0"),
        (dict(n_heads=4, n_kv_heads=3), r"MoEConfig.n_kv_heads \(3\) must divide"),
    ],
)
def test_moe_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**kwargs)


def test_preset_lookup():
    config = llama_config("tiny")
    config.dim = 128
    assert llama_config("tiny").dim == 64  # a fresh copy each time
    assert isinstance(llama_config("1b").rope_scaling, RopeScaling)
    with pytest.raises(ValueError, match=r"unknown llama config 'huge'; valid names are: 1b, 70b, 8b, debug"):
        llama_config("huge")
    with pytest.raises(ValueError, match=r"unknown moe config '8b'; valid names are: debug, small, tiny"):
        moe_config("8b")


# ---------------------------------------------------------------------------------------------------
# Experts and routing
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(score_func="sigmoid", route_scale=2.5, shared_expert_gate=True, aux_loss_coef=0.01),
     dict(route_norm=False, shared_expert_hidden=0, top_k=1)],
    ids=["softmax-shared", "sigmoid-gated-aux", "top1-unnormalized"],
)
def test_grouped_experts_equal_per_expert_loop(overrides):
    torch.manual_seed(0)
    config = _moe_config(num_experts=6, **overrides)
    grouped = MoEFeedForward(config, out_init_std=0.02)
    with torch.no_grad():
        grouped.router.weight.normal_(0, 1.0)  # decisive, varied routing
        grouped.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, -10.0, 0.0]))  # expert 4: no tokens
    looped = copy.deepcopy(grouped)
    x = torch.randn(3, 10, config.dim, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = grouped(x)
    out_ref = looped.forward_per_expert_loop(x_ref)
    torch.testing.assert_close(out, out_ref, atol=1e-6, rtol=1e-5)
    assert grouped.router.tokens_per_expert[4] == 0 and grouped.router.tokens_per_expert.sum() == 30 * config.top_k
    upstream = torch.randn_like(out)
    loss = (out * upstream).sum() + (grouped.aux_loss if grouped.aux_loss is not None else 0)
    loss_ref = (out_ref * upstream).sum() + (looped.aux_loss if looped.aux_loss is not None else 0)
    loss.backward()
    loss_ref.backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-6, rtol=1e-5)
    for (name, p), p_ref in zip(grouped.named_parameters(), looped.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-6, rtol=1e-5, msg=name)
    assert grouped.router.weight.grad.abs().sum() > 0
    assert torch.all(grouped.experts.w1_EDF.grad[4] == 0)


def test_aux_loss_matches_switch_formula():
    torch.manual_seed(0)
    config = _moe_config(aux_loss_coef=0.1, num_experts=4, top_k=2)
    moe = MoEFeedForward(config, out_init_std=0.02)
    x = torch.randn(2, 8, config.dim)
    moe(x)
    probs = torch.softmax(x.reshape(16, -1) @ moe.router.weight.T, dim=-1)
    chosen = probs.topk(2, dim=-1).indices
    fraction = torch.bincount(chosen.flatten(), minlength=4).float() / chosen.numel()
    torch.testing.assert_close(moe.aux_loss, 0.1 * 4 * (fraction * probs.mean(0)).sum())
    model = MoE(dataclasses.replace(config, n_layers=2))
    model(torch.randint(0, 256, (2, 8)))
    total = model.aux_loss()
    total.backward()
    assert total > 0 and model.layers[0].feed_forward.router.weight.grad is not None
    assert MoE(_moe_config()).aux_loss().item() == 0.0


def test_expert_bias_update_rebalances_selection():
    torch.manual_seed(0)
    config = _moe_config(num_experts=4, top_k=1, score_func="sigmoid", route_norm=False, shared_expert_hidden=0)
    moe = MoEFeedForward(config, out_init_std=0.02)
    router = moe.router
    with torch.no_grad():
        router.weight.normal_(0, 0.1)  # experts prefer different features ...
        router.weight[0, 0] = 3.0  # ... but every token prefers expert 0 by far
    x = torch.randn(4, 64, config.dim)
    x[..., 0] = x[..., 0].abs() + 1
    moe(x)
    load_before = router.tokens_per_expert.clone()
    assert load_before.tolist() == [256, 0, 0, 0]
    scores_before = torch.sigmoid(x.reshape(-1, config.dim) @ router.weight.T)

    moe.router.update_expert_bias(rate=0.02)
    assert router.tokens_per_expert.sum() == 0  # counts restart after an update
    bias = router.expert_bias
    torch.testing.assert_close(bias, torch.tensor([-0.03, 0.01, 0.01, 0.01]))  # centred sign step
    for _ in range(50):
        moe(x)
        load = router.tokens_per_expert.clone()
        moe.router.update_expert_bias(rate=0.02)
    assert load.max() < 100 and load.min() > 30, load  # near the balanced 64 each
    # The bias changes only the choice, never the weights: weights are the unbiased scores.
    routing = router(x.reshape(-1, config.dim))
    torch.testing.assert_close(routing.weights_NA, scores_before.gather(-1, routing.selected_NA))
    assert not torch.equal(routing.selected_NA.flatten(), torch.zeros(256, dtype=torch.long))
    # The model-level hook updates every layer.
    model = MoE(config)
    model(torch.randint(0, 256, (2, 16)))
    model.update_expert_bias(1e-3)
    assert all(m.router.expert_bias.abs().sum() > 0 for m in model.moe_layers())
    assert "layers.0.feed_forward.router.expert_bias" in model.state_dict()
    assert "layers.0.feed_forward.router.tokens_per_expert" not in model.state_dict()

"""Qwen3-MoE and DeepSeek-V3 against transformers' implementations, with the same weights.

Each case is a small random config that exercises the family's features: Qwen3's head_dim != dim / heads,
q/k norms, 16 experts top-4, norm_topk_prob on and off, mlp_only_layers and decoder_sparse_step, YaRN;
DeepSeek-V3's low-rank q (and the full q projection), decoupled RoPE interleaved and not, YaRN with
mscale_all_dim, group-limited sigmoid routing with a non-zero e_score_correction_bias, shared experts and
dense first layers.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="Hugging Face interop tests need `transformers`")

from safetensors.torch import load_file, save_file  # noqa: E402

from lightning_vescale.models import (  # noqa: E402
    DeepSeekV3,
    DeepSeekV3Config,
    MoE,
    MoEConfig,
    Qwen3MoE,
    Qwen3MoEConfig,
    deepseek_v3_config,
    from_pretrained,
    qwen3_moe_config,
    save_pretrained,
)
from lightning_vescale.models.hf_deepseek_v3 import DEEPSEEK_V3_ADAPTER  # noqa: E402
from lightning_vescale.models.hf_qwen3_moe import QWEN3_MOE_ADAPTER  # noqa: E402
from lightning_vescale.models.moe import MoEFeedForward  # noqa: E402

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0}


def _hf_configs() -> dict[str, transformers.PretrainedConfig]:
    qwen3 = dict(COMMON, num_key_value_heads=2, head_dim=24, intermediate_size=80, moe_intermediate_size=32,
                 num_experts=16, num_experts_per_tok=4)
    deepseek = dict(COMMON, num_key_value_heads=4, intermediate_size=80, moe_intermediate_size=32, n_routed_experts=16,
                    num_experts_per_tok=4, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10)
    return {
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **qwen3, num_hidden_layers=3, norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False
        ),
        "qwen3_moe-sparse-step-tied-yarn": transformers.Qwen3MoeConfig(
            **qwen3, num_hidden_layers=4, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[3],
            tie_word_embeddings=True, rope_parameters=YARN,
        ),
        "deepseek_v3": transformers.DeepseekV3Config(
            **deepseek, num_hidden_layers=3, q_lora_rank=24, n_shared_experts=2, n_group=4, topk_group=2,
            first_k_dense_replace=1, routed_scaling_factor=2.5, rope_interleave=True, tie_word_embeddings=False,
            rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.8},
        ),
        "deepseek_v3-full-q-no-interleave-tied": transformers.DeepseekV3Config(
            **deepseek, num_hidden_layers=2, q_lora_rank=None, n_shared_experts=1, n_group=1, topk_group=1,
            first_k_dense_replace=0, routed_scaling_factor=1.5, norm_topk_prob=False, rope_interleave=False,
            tie_word_embeddings=True,
        ),
    }


CASES = list(_hf_configs())
ADAPTERS = {"qwen3_moe": QWEN3_MOE_ADAPTER, "deepseek_v3": DEEPSEEK_V3_ADAPTER}


def _hf_model(name: str):
    """A small random HF model in eval mode, every weight perturbed (no trivial norms, a non-zero bias)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_configs()[name], attn_implementation="eager").eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif param_name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)  # decisive routing: no near-ties between experts
            else:
                p.normal_(0, 0.05)
        for buffer_name, b in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def _quiet_transformers():
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


@pytest.mark.parametrize("name", CASES)
def test_logits_match_transformers(name, tmp_path):
    hf = _hf_model(name)
    hf.save_pretrained(tmp_path)
    ours, config = from_pretrained(tmp_path)
    assert isinstance(ours, Qwen3MoE if name.startswith("qwen3") else DeepSeekV3)
    # The sparse/dense layer pattern is transformers' (mlp_only_layers, decoder_sparse_step, first_k_dense).
    hf_sparse = [not hasattr(layer.mlp, "gate_proj") for layer in hf.model.layers]
    assert [isinstance(block.feed_forward, MoEFeedForward) for block in ours.layers] == hf_sparse
    assert False in hf_sparse or name.startswith("deepseek_v3-full")
    tokens = _tokens()
    with torch.no_grad():
        want = hf(tokens).logits
        got = ours.eval()(tokens)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", CASES)
def test_gradients_match_transformers(name, tmp_path):
    """Every parameter's gradient, experts and routers included, through the same loss."""
    hf = _hf_model(name)
    hf.save_pretrained(tmp_path)
    ours, _ = from_pretrained(tmp_path)
    tokens = _tokens()
    upstream = torch.randn(2, 40, VOCAB, generator=torch.Generator().manual_seed(2))
    (hf(tokens).logits * upstream).sum().backward()
    (ours(tokens) * upstream).sum().backward()
    # HF's in-memory names (fused experts) through our loader's renaming give our names.
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    want, _, unexpected = ADAPTERS[hf.config.model_type].state_from_hf(hf_grads, ours.config)
    assert not unexpected
    got = {n: p.grad for n, p in ours.named_parameters()}
    assert got.keys() == want.keys()
    for key in got:
        scale = want[key].abs().max()
        torch.testing.assert_close(got[key], want[key], atol=1e-5 * scale, rtol=1e-4, msg=key)
    checked = [k for k in got if k.endswith(("experts.w1_EDF", "experts.w2_EFD", "router.weight"))]
    assert checked and all(got[k].abs().sum() > 0 for k in checked)


def _our_model(name: str):
    """Our model of the case's config, randomly initialized, norms and expert_bias perturbed."""
    torch.manual_seed(3)
    config = ADAPTERS[_hf_configs()[name].model_type].config_from_hf(_hf_configs()[name].to_dict())
    model = (Qwen3MoE if isinstance(config, Qwen3MoEConfig) else DeepSeekV3)(config)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif param_name.endswith("router.weight"):
                p.normal_(0, 0.5)
        if isinstance(config, DeepSeekV3Config):
            for layer in model.moe_layers():
                layer.router.expert_bias.normal_(0, 0.1)
    return model.eval(), config


@pytest.mark.parametrize("name", CASES)
def test_export_round_trips_bitwise_through_transformers(name, tmp_path):
    """Ours -> save_pretrained -> transformers loads (same logits) and saves -> ours again: identical tensors."""
    ours, config = _our_model(name)
    save_pretrained(ours, config, tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == config_type(config)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), atol=1e-4, rtol=1e-4)
    hf.save_pretrained(tmp_path / "hf")
    again, again_config = from_pretrained(tmp_path / "hf")
    assert again_config == config
    want = ours.state_dict()
    got = again.state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    if isinstance(config, DeepSeekV3Config):
        assert all(layer.router.expert_bias.abs().sum() > 0 for layer in again.moe_layers())


def config_type(config) -> str:
    return "qwen3_moe" if isinstance(config, Qwen3MoEConfig) else "deepseek_v3"


def test_bf16_export_keeps_the_correction_bias_in_fp32(tmp_path):
    ours, config = _our_model("deepseek_v3")
    save_pretrained(ours, config, tmp_path, dtype=torch.bfloat16)
    saved = load_file(tmp_path / "model.safetensors")
    assert saved["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert saved["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert torch.equal(
        saved["model.layers.1.mlp.gate.e_score_correction_bias"], ours.layers[1].feed_forward.router.expert_bias
    )


def test_qwen3_expert_bias_is_dropped_with_a_warning(tmp_path):
    ours, config = _our_model("qwen3_moe")
    ours.layers[0].feed_forward.router.expert_bias.fill_(0.5)
    with pytest.warns(UserWarning, match="expert_bias .* is dropped"):
        save_pretrained(ours, config, tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert saved and not any("bias" in name for name in saved), sorted(saved)


def test_deepseek_multi_token_prediction_layers_are_skipped(tmp_path):
    """The released checkpoint carries layer 61 (MTP) beyond num_hidden_layers; transformers ignores it too."""
    hf = _hf_model("deepseek_v3")
    hf.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in state.items() if "layers.2." in k}
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**state, **mtp}, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    ours, _ = from_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(_tokens()), hf(_tokens()).logits, atol=1e-4, rtol=1e-4)


def test_qwen3_extra_layers_are_refused(tmp_path):
    hf = _hf_model("qwen3_moe")
    hf.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    save_file({**state, "model.layers.9.input_layernorm.weight": torch.ones(64)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected in the checkpoint, not in the model \(1\): model\.layers\.9\.input_layernorm\.weight"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "edit,match",
    [
        (dict(quantization_config={"quant_method": "fp8", "fmt": "e4m3"}), r"quantization_config \(fp8, e4m3\).*bf16"),
        (dict(num_key_value_heads=2), r"num_key_value_heads=2 differs from num_attention_heads=4"),
        (dict(scoring_func="softmax"), r"scoring_func='softmax' is not supported"),
        (dict(moe_layer_freq=2), r"moe_layer_freq=2 is not supported"),
        (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
        (dict(n_group=3), r"num_expert_groups=3 must be >= 1 and divide num_experts=16"),
        (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
         r"rope_type 'dynamic' is not supported \(supported: 'default', 'yarn'\)"),
    ],
)
def test_deepseek_config_errors(edit, match, tmp_path):
    hf = _hf_model("deepseek_v3")
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match=match):
        from_pretrained(tmp_path)


def test_qwen3_config_errors(tmp_path):
    hf = _hf_model("qwen3_moe")
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    with pytest.raises(ValueError, match="attention_bias=true is not supported for qwen3_moe"):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "use_sliding_window": True, "sliding_window": 8}))
    with pytest.warns(UserWarning, match="use_sliding_window is ignored"):
        from_pretrained(tmp_path)


def test_save_refuses_what_the_architecture_cannot_express(tmp_path):
    config = deepseek_v3_config("tiny")
    config.n_shared_experts = 0
    with pytest.raises(ValueError, match=r"cannot save as 'deepseek_v3': n_shared_experts=0"):
        save_pretrained(DeepSeekV3(config), config, tmp_path)
    grouped = MoEConfig(num_experts=8, num_expert_groups=2, top_k_groups=1)
    with pytest.raises(ValueError, match=r"cannot save as 'mixtral': num_expert_groups=2 \(group-limited routing"):
        save_pretrained(MoE(grouped), grouped, tmp_path, model_type="mixtral")
    config = qwen3_moe_config("tiny")
    with pytest.raises(ValueError, match=r"Qwen3MoEConfig can be saved as \('qwen3_moe',\), not model_type='mixtral'"):
        save_pretrained(Qwen3MoE(config), config, tmp_path, model_type="mixtral")


def test_presets_round_trip_through_config_json():
    """The real-size presets survive config.json both ways (what a user's checkpoint directory holds)."""
    for adapter, config in [(QWEN3_MOE_ADAPTER, qwen3_moe_config("235b_a22b")),
                            (QWEN3_MOE_ADAPTER, qwen3_moe_config("30b_a3b")),
                            (DEEPSEEK_V3_ADAPTER, deepseek_v3_config("671b"))]:
        hf_dict = adapter.config_to_hf(config, torch.bfloat16)
        assert adapter.config_from_hf(json.loads(json.dumps(hf_dict))) == config
        # transformers reads the same architecture from it.
        hf_config = transformers.AutoConfig.for_model(**hf_dict)
        assert hf_config.num_hidden_layers == config.n_layers and hf_config.hidden_size == config.dim

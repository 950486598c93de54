"""Our models against Hugging Face transformers' implementations, with the same weights."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="Hugging Face interop tests need `transformers`")

from safetensors.torch import save_file  # noqa: E402

from lightning_vescale.models import Llama, LlamaConfig, MoE, MoEConfig, from_pretrained, save_pretrained  # noqa: E402

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, rms_norm_eps=1e-5,
)
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
# transformers 5 takes rope_parameters (theta inside); 4.x takes rope_theta and rope_scaling.
LLAMA31_ROPE_KWARGS = (
    dict(rope_parameters={**LLAMA31_ROPE, "rope_theta": 10000.0}) if TRANSFORMERS_5
    else dict(rope_theta=10000.0, rope_scaling=LLAMA31_ROPE)
)


def _hf_configs() -> dict[str, transformers.PretrainedConfig]:
    return {
        "llama": transformers.LlamaConfig(**COMMON, intermediate_size=96, tie_word_embeddings=False),
        "llama-tied-llama31-rope": transformers.LlamaConfig(
            **COMMON, intermediate_size=96, tie_word_embeddings=True, **LLAMA31_ROPE_KWARGS
        ),
        "mixtral": transformers.MixtralConfig(
            **COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False
        ),
        "qwen2_moe": transformers.Qwen2MoeConfig(
            **{**COMMON, "num_hidden_layers": 3}, intermediate_size=96, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
            norm_topk_prob=False, qkv_bias=True, tie_word_embeddings=False,
        ),
        "qwen2_moe-tied-normtopk": transformers.Qwen2MoeConfig(
            **COMMON, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, tie_word_embeddings=True,
        ),
    }


CASES = list(_hf_configs())


def _hf_model(name: str):
    """A tiny random HF model in eval mode, with every weight perturbed (no trivial norms or biases)."""
    torch.manual_seed(0)
    config = _hf_configs()[name]
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif param_name.endswith("mlp.gate.weight") or "block_sparse_moe.gate" in param_name:
                p.normal_(0, 0.5)  # decisive routing: no near-ties between experts
            else:
                p.normal_(0, 0.05)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def _quiet_transformers():
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


@pytest.mark.parametrize("name", CASES)
def test_from_pretrained_matches_hf_and_round_trips(name, tmp_path):
    hf = _hf_model(name)
    hf.save_pretrained(tmp_path / "hf")
    ours, config = from_pretrained(tmp_path / "hf")
    assert isinstance(ours, Llama if name.startswith("llama") else MoE)
    assert config.tie_embeddings == hf.config.tie_word_embeddings
    if config.tie_embeddings:
        assert ours.output.weight is ours.tok_embeddings.weight
    tokens = _tokens()
    with torch.no_grad():
        want = hf(tokens).logits
        got = ours.eval()(tokens)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    # Ours -> HF format -> transformers: the same logits again.
    save_pretrained(ours, config, tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == hf.config.model_type
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, want, atol=1e-5, rtol=1e-5)
    # ... and back into ours, bitwise.
    again, again_config = from_pretrained(tmp_path / "ours")
    assert again_config == config
    for key, value in ours.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


def test_sharded_checkpoint(tmp_path):
    hf = _hf_model("mixtral")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours, _ = from_pretrained(tmp_path)
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(tokens), hf(tokens).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not TRANSFORMERS_5, reason="the fused expert layout is transformers 5's")
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_fused_expert_layout(name, tmp_path):
    """transformers 5 holds experts fused in memory (gate_up_proj [E, 2F, D], down_proj [E, D, F])."""
    hf = _hf_model(name)
    fused = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in fused)
    save_file(fused, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(hf.config.to_json_string())
    ours, _ = from_pretrained(tmp_path)
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(tokens), hf(tokens).logits, atol=1e-5, rtol=1e-5)


def test_dtype_and_expert_bias_warning(tmp_path):
    hf = _hf_model("mixtral")
    hf.save_pretrained(tmp_path / "hf")
    ours, config = from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    ours.layers[0].feed_forward.router.expert_bias.fill_(0.5)
    with pytest.warns(UserWarning, match="expert_bias .* is dropped"):
        save_pretrained(ours, config, tmp_path / "out", dtype=torch.float32)


def test_errors(tmp_path):
    hf = _hf_model("llama")
    hf.save_pretrained(tmp_path / "good")
    config = json.loads((tmp_path / "good" / "config.json").read_text())

    with pytest.raises(FileNotFoundError, match="does not exist"):
        from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_pretrained(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        from_pretrained(tmp_path / "empty")

    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'; supported: llama, mixtral, qwen2_moe"):
        from_pretrained(tmp_path / "good", model_type="gpt2")
    ours, _ = from_pretrained(tmp_path / "good", model_type="LlamaForCausalLM")
    assert isinstance(ours, Llama)

    # The config says a wider FFN than the weights have: every mismatched tensor is listed with both shapes.
    (tmp_path / "good" / "config.json").write_text(json.dumps({**config, "intermediate_size": 100}))
    with pytest.raises(ValueError, match=r"shape mismatch \(6\)") as error:
        from_pretrained(tmp_path / "good")
    for layer in range(2):
        for hf_name, ours, shape in [("gate_proj", "w1", "(96, 64), model (100, 64)"),
                                     ("up_proj", "w3", "(96, 64), model (100, 64)"),
                                     ("down_proj", "w2", "(64, 96), model (64, 100)")]:
            hf_key, our_key = f"model.layers.{layer}.mlp.{hf_name}.weight", f"layers.{layer}.feed_forward.{ours}.weight"
            assert f"{hf_key} -> {our_key}: checkpoint {shape}" in str(error.value)
    (tmp_path / "good" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"missing from the checkpoint \(\d+\): layers\.2\.attention_norm\.weight"):
        from_pretrained(tmp_path / "good")
    (tmp_path / "good" / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported"):
        from_pretrained(tmp_path / "good")

    with pytest.raises(ValueError, match=r"cannot save as 'mixtral': score_func='sigmoid'"):
        save_pretrained(MoE(MoEConfig(score_func="sigmoid")), MoEConfig(score_func="sigmoid"), tmp_path / "x",
                        model_type="mixtral")
    with pytest.raises(ValueError, match="Qwen2-MoE needs a gated shared expert"):
        save_pretrained(MoE(MoEConfig()), MoEConfig(), tmp_path / "x", model_type="qwen2_moe")
    with pytest.raises(ValueError, match="qwen2_moe"):
        save_pretrained(Llama(LlamaConfig()), LlamaConfig(), tmp_path / "x", model_type="qwen2_moe")



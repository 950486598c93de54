"""FP8 block checkpoints (DeepSeek-V3 / Qwen3-FP8 style) through from_pretrained: dequantized or kept quantized."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_vescale.models import (
    DeepSeekV3,
    Llama,
    LlamaConfig,
    deepseek_v3_config,
    from_pretrained,
    save_pretrained,
)
from lightning_vescale.quant import BlockFormat, dequantize_rowmajor, quantize_rowmajor
from lightning_vescale.quant.tensor import QuantizedTensor, rowmajor_codes

BLOCK = 32  # tiny models: several blocks per matrix, and partial edge blocks (dims 48, 80, ...)
FMT = BlockFormat("fp8_e4m3", BLOCK)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


def _is_quantized_in_checkpoint(name: str, t: torch.Tensor) -> bool:
    # DeepSeek-V3 keeps embeddings, the head, norms, the router and its bias unquantized.
    return t.dim() == 2 and "embed" not in name and "lm_head" not in name and "mlp.gate.weight" not in name


def _write_fp8(model, config, path, *, scale_factor: float = 1.0) -> dict[str, torch.Tensor]:
    """Save ``model`` as an FP8 block checkpoint; returns the stored tensors."""
    save_pretrained(model, config, path)
    state = load_file(path / "model.safetensors")
    out = {}
    for name, t in state.items():
        if _is_quantized_in_checkpoint(name, t):
            codes, scales = quantize_rowmajor(t, FMT)
            out[name], out[name + "_scale_inv"] = codes, scales * scale_factor
        else:
            out[name] = t
    save_file(out, path / "model.safetensors")
    hf = json.loads((path / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                 "weight_block_size": [BLOCK, BLOCK]}
    (path / "config.json").write_text(json.dumps(hf))
    return out


def _llama(tmp_path, **kw):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, dim=80, n_layers=2, n_heads=5, n_kv_heads=1, ffn_hidden=144, max_seq_len=64)
    model = Llama(config)
    return model, config, _write_fp8(model, config, tmp_path, **kw)


def test_llama_fp8_dequantized_on_request(tmp_path):
    _, _, stored = _llama(tmp_path)
    model, _ = from_pretrained(tmp_path, quantized_weights="dequantize")
    wq = model.layers[0].attention.wq.weight
    assert type(wq) is torch.nn.Parameter and wq.dtype == torch.float32
    codes = stored["model.layers.0.self_attn.q_proj.weight"]
    scales = stored["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert torch.equal(wq.detach(), dequantize_rowmajor(codes, scales, FMT))
    assert torch.equal(model.tok_embeddings.weight.detach(), stored["model.embed_tokens.weight"])


def test_llama_fp8_kept_quantized_without_requantizing(tmp_path):
    # Scales twice what quantization would give: re-quantizing the dequantized weight would halve them back.
    _, _, stored = _llama(tmp_path, scale_factor=2.0)
    kept, _ = from_pretrained(tmp_path, quantized_weights="keep")
    plain, _ = from_pretrained(tmp_path, quantized_weights="dequantize")
    for ours, hf in (("layers.0.attention.wq.weight", "model.layers.0.self_attn.q_proj.weight"),
                     ("layers.1.feed_forward.w2.weight", "model.layers.1.mlp.down_proj.weight")):
        p = kept.get_parameter(ours)
        assert isinstance(p, QuantizedTensor) and not p.requires_grad and p.fmt == FMT
        codes, scales = rowmajor_codes(p)
        assert torch.equal(codes.view(torch.uint8), stored[hf].view(torch.uint8))
        assert torch.equal(scales, stored[hf + "_scale_inv"])
    assert not isinstance(kept.tok_embeddings.weight, QuantizedTensor)
    # The kept model computes with the dequantized weights: the same logits as the dequantized load.
    with torch.no_grad():
        assert torch.equal(kept(_tokens()), plain(_tokens()))
    # A state dict holds each quantized weight as codes + scales.
    sd = kept.state_dict()
    assert sd["layers.0.attention.wq.weight"].dtype == torch.float8_e4m3fn
    assert sd["layers.0.attention.wq.weight_scale_inv"].shape == (3, 3)  # 80 x 80 in 32-blocks


def test_deepseek_v3_fp8_experts_stack_quantized(tmp_path):
    torch.manual_seed(0)
    config = deepseek_v3_config("tiny")
    model = DeepSeekV3(config)
    stored = _write_fp8(model, config, tmp_path)
    kept, _ = from_pretrained(tmp_path, quantized_weights="keep")
    plain, _ = from_pretrained(tmp_path, quantized_weights="dequantize")
    layer = config.n_dense_layers  # the first MoE layer
    w1 = kept.layers[layer].feed_forward.experts.w1_EDF
    assert isinstance(w1, QuantizedTensor) and w1.shape == (config.num_experts, config.dim, config.moe_hidden)
    # Hugging Face stores each expert's (out, in) weight; ours is the (in, out) stack: the tiles were transposed.
    for e in (0, config.num_experts - 1):
        hf = f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight"
        assert torch.equal(w1.dequantize()[e], dequantize_rowmajor(stored[hf], stored[hf + "_scale_inv"], FMT).t())
    assert isinstance(kept.layers[0].attention.wq_b.weight, QuantizedTensor)
    with torch.no_grad():
        torch.testing.assert_close(kept(_tokens()), plain(_tokens()), rtol=0, atol=0)


def test_quantized_checkpoint_needs_a_choice(tmp_path):
    _llama(tmp_path)
    with pytest.raises(ValueError, match=r"quantization_config \(fp8, e4m3\): pass quantized_weights='dequantize'"):
        from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="quantized_weights='int4'"):
        from_pretrained(tmp_path, quantized_weights="int4")


@pytest.mark.parametrize(
    "damage,match",
    [
        ("wrong_scale_shape", r"self_attn\.q_proj\.weight: the scales have shape \(2, 3\) but a weight of shape "
                              r"\(80, 80\) in 32x32 blocks has \(3, 3\)"),
        ("missing_scales", r"q_proj\.weight: float8_e4m3fn codes without .*q_proj\.weight_scale_inv"),
        ("orphan_scales", r"x_proj\.weight_scale_inv: scales of a weight the checkpoint does not have"),
        ("scales_on_plain", r"model\.norm\.weight: has model\.norm\.weight_scale_inv but is torch\.float32"),
        ("block_size", r"weight_block_size=\[32, 64\]; only square blocks"),
    ],
)
def test_scales_that_do_not_fit_are_refused(tmp_path, damage, match):
    _, _, stored = _llama(tmp_path)
    key = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    if damage == "wrong_scale_shape":
        stored[key] = stored[key][:2].contiguous()
    elif damage == "missing_scales":
        del stored[key]
    elif damage == "orphan_scales":
        stored["model.layers.0.self_attn.x_proj.weight_scale_inv"] = torch.ones(3, 3)
    elif damage == "scales_on_plain":
        stored["model.norm.weight_scale_inv"] = torch.ones(3)
    elif damage == "block_size":
        hf = json.loads((tmp_path / "config.json").read_text())
        hf["quantization_config"]["weight_block_size"] = [32, 64]
        (tmp_path / "config.json").write_text(json.dumps(hf))
    save_file(stored, tmp_path / "model.safetensors")
    for mode in ("dequantize", "keep"):
        with pytest.raises(ValueError, match=match):
            from_pretrained(tmp_path, quantized_weights=mode)


def test_quantized_weight_is_frozen():
    w = QuantizedTensor.quantize(torch.randn(64, 64), FMT)
    with pytest.raises(RuntimeError, match="frozen block-quantized weight"):
        w.add_(1.0)
    # compute dequantizes (weight-only quantization)
    x = torch.randn(3, 64)
    got, want = torch.nn.functional.linear(x, w), torch.nn.functional.linear(x, w.dequantize())
    # The same dot products; the kernel may sum them in another order for another operand layout (AMD's does), so
    # the bound is fp32 rounding of 64-term sums, not bitwise.
    bound = 64 * torch.finfo(torch.float32).eps * x.abs().max() * w.dequantize().abs().max()
    assert (got - want).abs().max() <= bound, ((got - want).abs().max(), bound)
    assert not torch.allclose(got, torch.nn.functional.linear(x, torch.randn(64, 64)), atol=1.0)

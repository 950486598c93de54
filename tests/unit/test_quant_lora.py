"""LoRA wrapping, quantization declarations and base-weight loading on one process (no sharding)."""

from __future__ import annotations

import pytest
import torch

from lightning_vescale.engine.group_plan import buffer_kind_of
from lightning_vescale.models import Llama, LlamaConfig
from lightning_vescale.quant import BlockFormat, QuantizedTensor, quantize_all_gather, quantize_frozen_weights
from lightning_vescale.quant._kinds import quantization_of
from lightning_vescale.quant._sharding import declare_quantized
from lightning_vescale.quant.lora import LoRAConfig, LoRALinear, apply_lora, load_base_state_dict

CONFIG = LlamaConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=96, max_seq_len=16)
FMT = BlockFormat("int8", 32)


def test_lora_starts_as_the_base_model_and_freezes_the_rest():
    torch.manual_seed(0)
    model = Llama(CONFIG)
    tokens = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        before = model(tokens)
    wrapped = apply_lora(model, LoRAConfig(rank=4, alpha=8.0))
    assert wrapped == ["layers.0.attention.wq", "layers.0.attention.wk", "layers.0.attention.wv",
                       "layers.0.attention.wo", "layers.0.feed_forward.w1", "layers.0.feed_forward.w2",
                       "layers.0.feed_forward.w3"]
    assert isinstance(model.layers[0].attention.wq, LoRALinear)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), before, rtol=0, atol=0)  # B starts at zero


def test_lora_targets_must_match():
    with pytest.raises(ValueError, match=r"LoRA target pattern\(s\) \['\*q_proj'\] match no nn.Linear"):
        apply_lora(Llama(CONFIG), LoRAConfig(targets=("*attention.wq", "*q_proj")))
    with pytest.raises(ValueError, match="LoRA rank must be a positive int"):
        LoRAConfig(rank=0)


def test_quantize_frozen_weights_real_and_meta():
    torch.manual_seed(0)
    model = Llama(CONFIG)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0))
    names = quantize_frozen_weights(model, FMT, exclude=("tok_embeddings.*", "output.*"))
    assert "layers.0.attention.wq.base_layer.weight" in names and "output.weight" not in names
    assert not any("lora_" in n for n in names)  # trainable adapters are never quantized as storage
    assert isinstance(model.layers[0].attention.wq.base_layer.weight, QuantizedTensor)
    with torch.device("meta"):
        meta = Llama(CONFIG)
    apply_lora(meta, LoRAConfig(rank=4, alpha=8.0))
    quantize_frozen_weights(meta, FMT, targets=("*feed_forward*",))
    w1 = meta.layers[0].feed_forward.w1.base_layer.weight
    assert quantization_of(w1) == FMT and buffer_kind_of("w1", w1).key == ("quantized_storage", FMT)
    with pytest.raises(ValueError, match=r"target pattern\(s\) \['\*nothing\*'\] match no frozen 2-D/3-D weight"):
        quantize_frozen_weights(meta, FMT, targets=("*nothing*",))


def test_quantize_all_gather_declares_trained_weights_only():
    model = Llama(CONFIG)
    model.norm.weight.requires_grad_(False)
    names = quantize_all_gather(model, FMT, exclude=("output.*",))
    assert "layers.0.attention.wq.weight" in names and "output.weight" not in names and "norm.weight" not in names
    assert buffer_kind_of("wq", model.layers[0].attention.wq.weight).key == ("quantized_gather", FMT, "auto")
    bad = torch.nn.Parameter(torch.ones(8))
    declare_quantized(bad, FMT)
    with pytest.raises(ValueError, match="only 2-D weights and 3-D expert stacks"):
        buffer_kind_of("bias", bad)


def test_load_base_state_dict_quantizes_and_reports_mismatches():
    torch.manual_seed(0)
    base = Llama(CONFIG)
    state = base.state_dict()
    torch.manual_seed(1)
    model = Llama(CONFIG)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0))
    quantize_frozen_weights(model, FMT, exclude=("tok_embeddings.*", "output.*"))
    load_base_state_dict(model, state)
    wq = model.layers[0].attention.wq.base_layer.weight
    assert torch.equal(wq.dequantize(), QuantizedTensor.quantize(state["layers.0.attention.wq.weight"], FMT).dequantize())
    assert torch.equal(model.output.weight, state["output.weight"])
    del state["layers.0.feed_forward.w2.weight"]
    with pytest.raises(ValueError, match=r"missing .*layers\.0\.feed_forward\.w2\.base_layer\.weight"):
        load_base_state_dict(model, state)

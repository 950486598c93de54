"""LoRA over a quantized base: PEFT adapter files and merged exports load in transformers / peft and match us."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lightning_vescale.models import Llama, LlamaConfig, save_pretrained  # noqa: E402
from lightning_vescale.quant import BlockFormat, QuantizedTensor, quantize_frozen_weights  # noqa: E402
from lightning_vescale.quant.lora import LoRAConfig, apply_lora  # noqa: E402
from lightning_vescale.quant.peft import (  # noqa: E402
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    base_state_dict,
    save_merged_pretrained,
    save_peft_adapter,
)

CONFIG = LlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96, max_seq_len=32)


def _qlora_model(fmt: BlockFormat) -> Llama:
    torch.manual_seed(0)
    model = Llama(CONFIG)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=("*attention.wq", "*attention.wv", "*feed_forward.w2")))
    quantize_frozen_weights(model, fmt, exclude=("tok_embeddings.*", "output.*"))
    for name, p in model.named_parameters():
        if name.endswith("lora_B.weight"):
            torch.nn.init.normal_(p, std=0.05)  # as after training: the adapters change the output
    return model.eval()


def _tokens() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("kind", ["fp8_e4m3", "int8"])
def test_peft_adapter_on_the_dequantized_base_matches(kind, tmp_path):
    model = _qlora_model(BlockFormat(kind, 32))
    assert isinstance(model.layers[0].attention.wq.base_layer.weight, QuantizedTensor)
    with torch.no_grad():
        ours = model(_tokens())
    # The base the adapters were trained on (dequantized), as a Hugging Face directory.
    with torch.device("meta"):
        base = Llama(CONFIG)
    base.load_state_dict(base_state_dict(model), assign=True)
    save_pretrained(base, CONFIG, tmp_path / "base")
    save_peft_adapter(model, CONFIG, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    assert (tmp_path / "adapter" / ADAPTER_WEIGHTS).is_file()

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = hf(_tokens()).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    # A check that can fail: without the adapter the output differs.
    with torch.no_grad(), hf.disable_adapter():
        assert not torch.allclose(hf(_tokens()).logits, ours, atol=1e-3)


def test_merged_export_matches(tmp_path):
    model = _qlora_model(BlockFormat("fp8_e4m3", 32))
    with torch.no_grad():
        ours = model(_tokens())
    save_merged_pretrained(model, CONFIG, tmp_path / "merged")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(_tokens()).logits, ours, rtol=1e-4, atol=1e-4)


def test_no_adapters_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="has no LoRA adapters"):
        save_peft_adapter(Llama(CONFIG), CONFIG, tmp_path)

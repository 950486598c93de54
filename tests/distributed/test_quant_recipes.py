"""The quant group of the recipes end to end: QLoRA from an FP8 checkpoint, a quantized AllGather, config errors.

The QLoRA fine-tune runs once for the module (a module-scoped fixture; its tests stay on one pytest-xdist worker),
each test checks one behaviour of it: the frozen weights are stored and gathered as FP8 codes; the checkpoint keeps
the file's own codes (bitwise: no re-quantization) and trained adapters; the PEFT adapter on the dequantized base
gives the merged Hugging Face export's logits (1e-4), which differ from the base's."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from lightning_vescale.export import read_model_state
from lightning_vescale.models import Llama, from_pretrained, llama_config, save_pretrained
from tests.recipe_zygote import ROOT, run_command, run_recipe

pytestmark = pytest.mark.slow  # recipe runs as subprocesses (Hydra, Lightning's launcher): tens of seconds each

BLOCK = 32


ONE_WORKER = pytest.mark.xdist_group(name="test_quant_recipes.qlora_finetune")
"""The tests of the fixture's fine-tune: on one pytest-xdist worker, so it runs once."""


class QLoRARun(NamedTuple):
    root: Path
    run: Path
    arch: object
    output: str


@pytest.fixture(scope="module")
def qlora(tmp_path_factory) -> QLoRARun:
    """``recipes/finetune.py`` from an FP8 block-quantized checkpoint, with LoRA adapters and the HF export."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from tests.unit.test_quant_hf_import import FMT, _write_fp8

    tmp_path = tmp_path_factory.mktemp("qlora")
    assert FMT.block_size == BLOCK
    torch.manual_seed(0)
    arch = llama_config("tiny")
    _write_fp8(Llama(arch), arch, tmp_path / "fp8")
    run = tmp_path / "ft" / "run"
    proc = run_recipe("finetune.py", f"init_from={tmp_path / 'fp8'}", "quant=fp8_block", f"quant.block_size={BLOCK}",
                      "quant.lora_rank=4", f"output_root={tmp_path}", f"hydra.run.dir={run}", "trainer.max_steps=6",
                      "trainer.checkpoint_every_n_steps=0", "trainer.limit_val_batches=0", "export_hf=true",
                      "optimizer.lr=1e-2", "scheduler.warmup_steps=1")
    return QLoRARun(tmp_path, run, arch, proc.stderr + proc.stdout)


@ONE_WORKER
def test_qlora_finetune_stores_and_gathers_the_frozen_weights_as_fp8(qlora: QLoRARun):
    assert "Linear layers; 14 frozen weights stored as fp8_e4m3/32" in qlora.output
    summary = json.loads((qlora.run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["world_size"] == 2 and summary["loss_is_finite"]
    assert summary["comm_bytes_per_step_by_kind"]["all_gather_quant_codes"] > 0


@ONE_WORKER
def test_qlora_checkpoint_keeps_the_files_fp8_codes_and_the_trained_adapters(qlora: QLoRARun):
    """The checkpoint holds the base as FP8 codes + scales (the file's own codes: no re-quantization) and the
    adapters."""
    state = read_model_state(qlora.run / "checkpoints" / "last.ckpt")
    codes = state["layers.0.attention.wq.base_layer.weight"]
    assert codes.dtype == torch.float8_e4m3fn and "layers.0.attention.wq.base_layer.weight_scale_inv" in state
    kept, _ = from_pretrained(qlora.root / "fp8", quantized_weights="keep")
    assert torch.equal(codes.view(torch.uint8), kept.layers[0].attention.wq.weight.codes.view(torch.uint8))
    assert state["layers.0.attention.wq.lora_B.weight"].abs().sum() > 0  # trained


@ONE_WORKER
def test_qlora_adapter_on_the_dequantized_base_equals_the_merged_export(qlora: QLoRARun):
    """<run>/adapter (PEFT) on the dequantized base = <run>/hf (adapters merged), both loaded by transformers."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    tmp_path, run = qlora.root, qlora.run
    base, _ = from_pretrained(tmp_path / "fp8", quantized_weights="dequantize")
    save_pretrained(base, qlora.arch, tmp_path / "base")
    adapter_config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["r"] == 4 and adapter_config["peft_type"] == "LORA"
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(hf_base, run / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(run / "hf", torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(tokens).logits, merged(tokens).logits, rtol=1e-4, atol=1e-4)
        with with_adapter.disable_adapter():
            assert not torch.allclose(with_adapter(tokens).logits, merged(tokens).logits, atol=1e-4)


def test_train_with_a_quantized_all_gather(tmp_path):
    run = tmp_path / "run"
    run_recipe("train.py", "quant=int8_gather", f"quant.block_size={BLOCK}", f"output_root={tmp_path}",
               f"hydra.run.dir={run}", "trainer.max_steps=4", "trainer.checkpoint_every_n_steps=0",
               "trainer.limit_val_batches=0")
    summary = json.loads((run / "summary.json").read_text())
    kinds = summary["comm_bytes_per_step_by_kind"]
    assert summary["loss_is_finite"] and kinds["all_gather_quant_codes"] > 0 and kinds["all_gather_quant_scales"] > 0


@pytest.mark.parametrize(
    "script,overrides,message",
    [
        ("train.py", ["quant=fp8_block"], "quant mode qlora trains adapters on frozen weights: run recipes/finetune.py"),
        ("train.py", ["quant=fp8_gather", "strategy=ddp"], "quant=fp8_e4m3 (gather) needs strategy=vescale"),
        ("train.py", ["quant=fp8_gather", "quant.block_size=0"], "quant.block_size must be a positive int"),
    ],
)
def test_quant_config_mistakes_stop_before_the_run(tmp_path, script, overrides, message):
    cmd = [sys.executable, str(ROOT / "recipes" / script), f"output_root={tmp_path}", *overrides]
    proc = run_command(cmd, env=dict(os.environ), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert not any(tmp_path.iterdir())

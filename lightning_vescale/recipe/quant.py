"""The recipes' ``quant`` group: block-quantized weights on the model, the weights to load, adapter exports.

* ``quant=fp8_block`` / ``int8_block`` (``recipes/finetune.py``): QLoRA-style. :func:`apply_quantization`
  wraps the ``lora_targets`` Linear layers in LoRA adapters, freezes everything else and declares the frozen
  ``targets`` block-quantized, so the strategy stores them sharded as codes + scales. The initial weights load
  through :func:`~lightning_vescale.quant.lora.load_base_state_dict` (an FP8 checkpoint's own codes are kept
  when its block size and format are the run's). At the end, :class:`AdapterExport` writes ``<run>/adapter``
  (PEFT) and, with ``export_hf=true``, ``<run>/hf`` with the adapters merged.
* ``quant=fp8_gather`` / ``int8_gather``: :func:`apply_quantization` declares a quantized AllGather for the
  trained ``targets``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

from lightning_vescale.quant import BlockFormat, quantize_all_gather, quantize_frozen_weights
from lightning_vescale.quant.lora import apply_lora
from lightning_vescale.recipe.schema import QuantConfig

__all__ = ["ADAPTER_DIR", "AdapterExport", "apply_quantization", "block_format", "quantized_weights_mode"]

logger = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"


def block_format(quant: QuantConfig) -> BlockFormat:
    """The run's block format (:meth:`QuantConfig.block_format`)."""
    return quant.block_format()


def apply_quantization(model: nn.Module, quant: QuantConfig) -> None:
    """Adapters and quantization declarations on a freshly built (meta or real) model, before sharding."""
    fmt = block_format(quant)
    if quant.mode == "qlora":
        wrapped = apply_lora(model, quant.lora_config())
        names = quantize_frozen_weights(model, fmt, targets=tuple(quant.targets), exclude=tuple(quant.exclude))
        logger.info("quant: LoRA (rank %d, alpha %g) on %d Linear layers; %d frozen weights stored as %s",
                    quant.lora_rank, quant.lora_alpha, len(wrapped), len(names), fmt.name)
    else:
        names = quantize_all_gather(model, fmt, targets=tuple(quant.targets), exclude=tuple(quant.exclude))
        logger.info("quant: %d trained weights gathered as %s codes + scales", len(names), fmt.name)


def quantized_weights_mode(quant: Optional[QuantConfig], hf_config: dict[str, Any]) -> Optional[str]:
    """How ``from_pretrained`` should read an FP8 block checkpoint for this run (None: it is not one).

    A QLoRA run in the checkpoint's own format and block size keeps its codes ("keep"); anything else
    dequantizes (a QLoRA run in another format then quantizes the dequantized weights)."""
    spec = hf_config.get("quantization_config")
    if not spec:
        return None
    block = spec.get("weight_block_size") or [None]
    if quant is not None and quant.mode == "qlora" and quant.format == "fp8_e4m3" and block[0] == quant.block_size:
        return "keep"
    return "dequantize"


class AdapterExport(Callback):
    """At the end of a QLoRA fit: ``<run>/adapter`` (PEFT files) and, with ``merged``, ``<run>/hf`` (adapters merged
    into the dequantized base, a Hugging Face directory). Every rank takes part (the weights are gathered)."""

    def __init__(self, run_dir: Path, arch: Any, model_type: Optional[str], *, merged: bool,
                 base_model_name_or_path: Optional[str] = None) -> None:
        self.run_dir = Path(run_dir)
        self.arch = arch
        self.model_type = model_type
        self.merged = merged
        self.base = base_model_name_or_path

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning_vescale.quant.peft import save_merged_pretrained, save_peft_adapter

        write = trainer.is_global_zero
        model = pl_module.model
        assert isinstance(model, nn.Module)
        save_peft_adapter(model, self.arch, self.run_dir / ADAPTER_DIR, model_type=self.model_type,
                          base_model_name_or_path=self.base, write=write)
        if write:
            logger.info("wrote the LoRA adapters (PEFT) to %s", self.run_dir / ADAPTER_DIR)
        if self.merged:
            save_merged_pretrained(model, self.arch, self.run_dir / "hf", model_type=self.model_type, write=write)
            if write:
                logger.info("wrote the model with the adapters merged to %s", self.run_dir / "hf")

"""A fine-tuning run's starting weights (:func:`load_initial_weights`) and what a run records of where its weights
came from (``model.json``, the tokenizer files), so an export works whatever moves later."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

import torch

from lightning_vescale.export import (
    TOKENIZER_DIR,
    copy_tokenizer_files,
    locate_checkpoint,
    read_model_state,
    read_run_model,
    tokenizer_source_of,
    write_run_model,
)
from lightning_vescale.models import from_pretrained
from lightning_vescale.models.hf import read_pretrained_config
from lightning_vescale.quant.tensor import weights_state_dict
from lightning_vescale.recipe.checks import Resume, check_same_architecture
from lightning_vescale.recipe.paths import absolute
from lightning_vescale.recipe.schema import CheckpointModelConfig, FinetuneConfig, ModelConfig, QuantConfig, TrainConfig
from lightning_vescale.state_dict.report import mismatch_report

__all__ = ["hf_model_type", "load_initial_weights", "record_run", "tokenizer_source"]


def load_initial_weights(
    init_from: Union[str, Path], model: ModelConfig, *, quant: Optional[QuantConfig] = None,
    allow_unverified: bool = False,
) -> dict[str, torch.Tensor]:
    """The full state dict a fine-tuning run starts from, checked against the chosen ``model``.

    ``init_from`` is one of:

    * a Hugging Face checkpoint directory (``config.json`` + safetensors; loaded with
      :func:`lightning_vescale.models.from_pretrained`);
    * a recipe run directory (its ``checkpoints/last.ckpt``) or one of its checkpoints (a sharded directory
      of the vescale or fsdp2 strategy, or a DDP file): only the model's tensors are read, in this one
      process, whatever world size saved it;
    * a state-dict file (``.safetensors``, or a ``torch.save`` of a ``state_dict``; a Lightning checkpoint
      file's ``state_dict`` is accepted too).

    With ``model=from_checkpoint`` the model config is the checkpoint's own (plus the user's overrides), so
    only the tensors' names and shapes are checked. An FP8 block checkpoint (``quantization_config``) is
    dequantized, except for a QLoRA run (``quant``) in its own format and block size, which gets its codes and
    scales as they are (:class:`~lightning_vescale.quant.QuantizedTensor` entries). A sharded checkpoint without
    ``checksums.json`` is refused unless ``allow_unverified``.

    Raises:
        FileNotFoundError: the path does not exist, or a directory is none of the above.
        ValueError: the checkpoint's architecture or tensors do not match ``model``; the message lists the
            differing fields (or names and shapes) and how to pick the matching model.
    """
    from lightning_vescale.recipe.quant import quantized_weights_mode

    path = Path(init_from)
    arch = model.build_config()
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in model.build_model().state_dict().items()}
    chosen = f"model={model.family}_{model.preset}" + (f" with {model.overrides()}" if model.overrides() else "")
    from_checkpoint = isinstance(model, CheckpointModelConfig)
    if path.is_dir() and (path / "config.json").is_file():
        mode = quantized_weights_mode(quant, json.loads((path / "config.json").read_text()))
        hf_model, hf_arch = from_pretrained(path, quantized_weights=mode)
        if not from_checkpoint:
            check_same_architecture(hf_arch, arch, path, chosen)
        state = weights_state_dict(hf_model) if mode == "keep" else hf_model.state_dict()
    elif path.exists():
        try:
            checkpoint, _ = locate_checkpoint(path)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"init_from={str(path)!r} is a directory without config.json (found: "
                f"{sorted(p.name for p in path.iterdir())[:10]}). Fine-tuning starts from a Hugging Face checkpoint "
                f"directory, a recipe run or checkpoint, or a full state-dict file."
            ) from None
        try:
            state = read_model_state(checkpoint, allow_unverified=allow_unverified)
        except ValueError as err:
            raise ValueError(f"init_from={str(path)!r}: {err}") from None
    else:
        raise FileNotFoundError(f"init_from={str(path)!r} does not exist (resolved to {str(path.resolve())!r})")
    _check_state_matches(state, expected, path, chosen)
    return state


def _check_state_matches(state: dict, expected: dict, path: Path, chosen: str) -> None:
    report = mismatch_report(expected, {k: tuple(v.shape) for k, v in state.items()}, ours="model",
                             theirs="checkpoint")
    if report:
        raise ValueError(
            f"init_from={str(path)!r} does not match {chosen}:\n{report}\n"
            f"Pick the model the weights were saved from (model=...), or override its fields (model.<field>=...)."
        )


def hf_model_type(config: TrainConfig, resume: Optional[Resume]) -> Optional[str]:
    """The Hugging Face model_type the weights came from (what an export writes by default), if any."""
    if isinstance(config.model, CheckpointModelConfig):
        return config.model.hf_model_type
    if isinstance(config, FinetuneConfig):
        path = absolute(config.init_from)
        if path.is_dir() and (path / "config.json").is_file():
            return read_pretrained_config(path)[1]
    if resume is not None and resume.run_dir is not None:
        try:
            return read_run_model(resume.run_dir)[1]
        except (OSError, ValueError):
            return None
    return None


def tokenizer_source(config: TrainConfig, resume: Optional[Resume]) -> Optional[Path]:
    """Where the tokenizer files of the starting weights are: a Hugging Face ``init_from`` or an earlier run."""
    if isinstance(config, FinetuneConfig) and resume is None:
        return tokenizer_source_of(absolute(config.init_from))
    if resume is not None and resume.run_dir is not None:
        return resume.run_dir / TOKENIZER_DIR
    return None


def record_run(config: TrainConfig, run_dir: Path, resume: Optional[Resume]) -> None:
    """``model.json`` and the tokenizer files: what an export of this run needs, whatever moves later."""
    write_run_model(run_dir, config.model.build_config(), hf_model_type(config, resume))
    source = tokenizer_source(config, resume)
    if source is not None and source.is_dir():
        copy_tokenizer_files(source, run_dir / TOKENIZER_DIR)

"""Offline export, in one process: a recipe run (or one of its checkpoints) as a Hugging Face model directory, and a
sharded checkpoint as one weights file (``python -m lightning_vescale.convert``, :func:`convert`).

    python -m lightning_vescale.export outputs/llama_tiny_finetune/2026-01-01_12-00-00 my_model/
    python -m lightning_vescale.export outputs/.../checkpoints/step-000300.ckpt my_model/ --dtype bfloat16

The output holds ``config.json`` and ``model.safetensors`` (what ``transformers``'
``AutoModelForCausalLM.from_pretrained`` loads), plus the tokenizer files the run kept (a fine-tune from a
Hugging Face directory copies them into ``<run>/tokenizer/``). Any world size and strategy that wrote the
checkpoint works (vescale and FSDP2 sharded directories, DDP single files): the tensors are read whole
here, no process group or GPU needed.

This module also reads the layout of a run directory for the recipes (no Lightning import)::

    <run>/model.json                  the resolved model config (family, every field, Hugging Face model_type)
    <run>/.hydra/config.yaml          the composed config (model preset and overrides for older runs)
    <run>/checkpoints/last.ckpt       a link to the newest step-NNNNNN.ckpt
    <run>/tokenizer/                  tokenizer files of the weights the run started from, if any
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Optional, Union

import torch

from lightning_vescale.models.families import FAMILIES, family_of
from lightning_vescale.models.hf import SUPPORTED_MODEL_TYPES, read_pretrained_config, save_pretrained

__all__ = [
    "TOKENIZER_FILES",
    "arch_from_dict",
    "check_tokenizer_files",
    "checkpoint_step",
    "convert",
    "convert_main",
    "copy_tokenizer_files",
    "export_hf",
    "load_full_model_state",
    "locate_checkpoint",
    "read_model_state",
    "read_run_model",
    "read_source_config",
    "tokenizer_source_of",
    "write_run_model",
]

PathLike = Union[str, os.PathLike]
ModelArch = Any

RUN_MODEL_FILE = "model.json"
TOKENIZER_DIR = "tokenizer"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "generation_config.json",
)
"""Files of a Hugging Face directory that travel with the weights (tokenizer, chat template, generation)."""

_STEP = re.compile(r"step-(\d+)")


# ----------------------------------------------------------------------------------------------------
# Where things are
# ----------------------------------------------------------------------------------------------------


def _is_checkpoint(path: Path) -> bool:
    return (path.is_dir() and (path / ".metadata").is_file()) or path.is_file()


def locate_checkpoint(path: PathLike) -> tuple[Path, Optional[Path]]:
    """``(checkpoint, run_dir)`` for a run directory (its ``checkpoints/last.ckpt``) or a checkpoint.

    ``run_dir`` is ``None`` for a checkpoint outside a run's ``checkpoints/`` folder.

    Raises:
        FileNotFoundError: ``path`` is neither; the message says what was expected.
    """
    path = Path(path)
    if (path / "checkpoints" / "last.ckpt").exists():
        return path / "checkpoints" / "last.ckpt", path
    if _is_checkpoint(path):
        return path, path.parent.parent if path.parent.name == "checkpoints" else None
    if path.is_dir() and (path / "checkpoints").is_dir():
        raise FileNotFoundError(
            f"{str(path)!r} is a run directory without checkpoints/last.ckpt (found: "
            f"{sorted(p.name for p in (path / 'checkpoints').iterdir())[:8]}); pass one of its checkpoints"
        )
    what = "does not exist" if not path.exists() else "is neither a run directory nor a checkpoint"
    raise FileNotFoundError(
        f"{str(path)!r} {what}: pass a run directory (with checkpoints/last.ckpt) or a checkpoint "
        f"(a .../checkpoints/step-NNNNNN.ckpt directory or file)"
    )


def checkpoint_step(checkpoint: PathLike) -> Optional[int]:
    """The optimizer step a recipe checkpoint was saved at (from its ``step-NNNNNN`` name; ``last.ckpt``
    is followed to its target), or ``None`` for another name."""
    match = _STEP.fullmatch(Path(os.path.realpath(checkpoint)).stem)
    return int(match.group(1)) if match else None


# ----------------------------------------------------------------------------------------------------
# The model config of a run
# ----------------------------------------------------------------------------------------------------


def arch_from_dict(family: str, fields: dict[str, Any]) -> ModelArch:
    """A model config from its fields as ``dataclasses.asdict`` wrote them (``family``: a key of ``FAMILIES``;
    a ``rope_scaling`` dict becomes the family's scaling type in the config's own ``__post_init__``)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; expected one of {', '.join(FAMILIES)}")
    config_cls = FAMILIES[family].config_cls
    names = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise ValueError(f"{family} models have no field(s) {unknown}")
    values = dict(fields)
    if "dense_layers" in values:
        values["dense_layers"] = tuple(values["dense_layers"])
    return config_cls(**values)


def write_run_model(run_dir: PathLike, arch: ModelArch, hf_model_type: Optional[str] = None) -> Path:
    """Write ``<run>/model.json``: the resolved model config, so the run can be exported wherever its
    starting weights went."""
    path = Path(run_dir) / RUN_MODEL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"family": family_of(arch), "config": dataclasses.asdict(arch), "hf_model_type": hf_model_type}
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def read_run_model(run_dir: PathLike) -> tuple[ModelArch, Optional[str]]:
    """``(model config, Hugging Face model_type or None)`` of a recipe run.

    From ``model.json``; for runs written before it existed, from the preset and overrides in
    ``.hydra/config.yaml``.

    Raises:
        FileNotFoundError: the run directory has neither file.
    """
    run_dir = Path(run_dir)
    record_file = run_dir / RUN_MODEL_FILE
    if record_file.is_file():
        record = json.loads(record_file.read_text())
        return arch_from_dict(record["family"], record["config"]), record.get("hf_model_type")
    saved = run_dir / ".hydra" / "config.yaml"
    if not saved.is_file():
        raise FileNotFoundError(
            f"{str(run_dir)!r} has no {RUN_MODEL_FILE} or .hydra/config.yaml, so the model's config is unknown"
        )
    import yaml

    model = dict(yaml.safe_load(saved.read_text())["model"])
    family, preset = model.pop("family"), model.pop("preset")
    overrides = {k: v for k, v in model.items() if v is not None}
    base = dataclasses.asdict(FAMILIES[family].preset(preset))
    return arch_from_dict(family, {**base, **overrides}), None


def read_source_config(path: PathLike) -> tuple[ModelArch, Optional[str]]:
    """``(model config, Hugging Face model_type or None)`` of the weights at ``path``: a Hugging Face
    directory (``config.json``), a recipe run directory or one of its checkpoints.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` carries no model config (a state-dict file, or a checkpoint outside a run);
            the message says how to name the model instead.
    """
    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file():
        return read_pretrained_config(path)
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist (resolved to {str(path.resolve())!r})")
    try:
        _, run_dir = locate_checkpoint(path)
    except FileNotFoundError:
        run_dir = None
    if run_dir is None:
        raise ValueError(
            f"{str(path)!r} carries no model config (it is not a Hugging Face directory with config.json, nor a "
            f"recipe run or one of its checkpoints): name the model instead, e.g. model=llama_tiny model.dim=..."
        )
    return read_run_model(run_dir)


# ----------------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------------


def _read_state_dict_file(path: Path) -> dict[str, torch.Tensor]:
    from lightning_vescale.checkpoint import read_state_file

    state: Any = read_state_file(path)  # safetensors, or torch.load(weights_only=True): nothing unpickled
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):  # a Lightning checkpoint
        state = {k.removeprefix("model."): v for k, v in state["state_dict"].items()}
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(
            f"{str(path)!r} is not a state dict (a mapping of names to tensors); export one with "
            f"torch.save(model.state_dict(), path) or lightning_vescale.checkpoint.save_full"
        )
    return state


def _read_sharded_checkpoint(path: Path, allow_unverified: bool = False) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP checkpoint directory, read whole in this process (no process group, nothing
    unpickled, checksums verified; a directory without them only with ``allow_unverified``)."""
    from lightning_vescale.checkpoint import read_full_tensors

    # VeScaleStrategy stores "model.<module fqn>", ModelParallelStrategy "state_dict.<module fqn>"; the
    # LightningModule holds the network as ``self.model``.
    for prefix in ("model.model.", "state_dict.model."):
        state = read_full_tensors(path, prefix=prefix, allow_unverified=allow_unverified)
        if state:
            return {k[len(prefix):]: v for k, v in state.items()}
    raise ValueError(
        f"{str(path)!r} is a sharded checkpoint without the recipe model's tensors (no keys 'model.model.*' or "
        f"'state_dict.model.*')"
    )


def read_model_state(checkpoint: PathLike, *, allow_unverified: bool = False) -> dict[str, torch.Tensor]:
    """The recipe model's full tensors from a checkpoint: a sharded directory (vescale, FSDP2; any world
    size), a Lightning checkpoint file, or a state-dict file (``.safetensors`` or a ``torch.save``).
    A sharded directory without ``checksums.json`` is refused unless ``allow_unverified``."""
    path = Path(checkpoint)
    if path.is_dir() and (path / ".metadata").is_file():
        return _read_sharded_checkpoint(path, allow_unverified)
    if path.is_file():
        return _read_state_dict_file(path)
    raise FileNotFoundError(f"{str(path)!r} is not a checkpoint (a directory with .metadata, or a file)")


# ----------------------------------------------------------------------------------------------------
# One weights file from a sharded checkpoint (``python -m lightning_vescale.convert``)
# ----------------------------------------------------------------------------------------------------

_CONVERT_DOC = """Convert a sharded checkpoint directory into one ordinary weights file, offline, in one process.

    python -m lightning_vescale.convert CHECKPOINT_DIR model.safetensors
    python -m lightning_vescale.convert CHECKPOINT_DIR model.pt --format torch --strip-prefix model.

Works on any directory written by lightning_vescale.checkpoint.save (and so by the Lightning and Fabric strategies
and the recipes), whatever world size wrote it. No process group, GPU or model code is needed; the result loads
with plain safetensors.torch.load_file / torch.load into an unsharded model.
"""


def load_full_model_state(checkpoint_dir: Union[str, os.PathLike], *, strip_prefix: str = "",
                          allow_unverified: bool = False) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) tensors from a sharded checkpoint directory, by parameter name.

    Nothing in the checkpoint is unpickled, its metadata is checked against its files before anything is
    allocated, and its checksums are verified (a directory without ``checksums.json`` is refused unless
    ``allow_unverified``).
    """
    from lightning_vescale.checkpoint import read_full_tensors

    path = Path(checkpoint_dir)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(
            f"{path} is not a complete sharded checkpoint (no .metadata file): pass the directory that "
            f"lightning_vescale.checkpoint.save / the strategy wrote, e.g. .../checkpoints/step-000300.ckpt"
        )
    model = {k.removeprefix("model."): v for k, v in read_full_tensors(path, prefix="model.",
                                                                                 allow_unverified=allow_unverified).items()}
    if not model:
        raise ValueError(f"{path} holds no model state")
    out = {}
    for name, tensor in model.items():
        if strip_prefix and name.startswith(strip_prefix):
            name = name[len(strip_prefix):]
        out[name] = tensor
    return out


def convert(checkpoint_dir: Union[str, os.PathLike], output: Union[str, os.PathLike], *, format: str = "safetensors",
            strip_prefix: str = "", allow_unverified: bool = False) -> Path:
    """Write the model of ``checkpoint_dir`` as one ``safetensors`` or ``torch.save`` file at ``output``
    (``allow_unverified``: convert a checkpoint whose ``checksums.json`` is missing)."""
    if format not in ("safetensors", "torch"):
        raise ValueError(f"format must be 'safetensors' or 'torch', got {format!r}")
    tensors = load_full_model_state(checkpoint_dir, strip_prefix=strip_prefix, allow_unverified=allow_unverified)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    if format == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous().clone() for k, v in tensors.items()}, str(tmp))
    else:
        torch.save(tensors, tmp)
    os.replace(tmp, output)  # never leave a half-written file under the final name
    return output


def convert_main(argv: Optional[list[str]] = None) -> None:
    """``python -m lightning_vescale.convert CHECKPOINT_DIR OUTPUT``: one weights file from a sharded checkpoint."""
    parser = argparse.ArgumentParser(prog="python -m lightning_vescale.convert", description=_CONVERT_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output")
    parser.add_argument("--format", choices=["safetensors", "torch"], default=None,
                        help="default: from the output's suffix (.safetensors, else torch)")
    parser.add_argument("--strip-prefix", default="",
                        help="remove this prefix from names, e.g. 'model.' for a LightningModule's attribute")
    parser.add_argument("--allow-unverified", action="store_true",
                        help="convert a checkpoint whose checksums.json is missing (its bytes cannot be verified)")
    args = parser.parse_args(argv)
    fmt = args.format or ("safetensors" if args.output.endswith(".safetensors") else "torch")
    out = convert(args.checkpoint_dir, args.output, format=fmt, strip_prefix=args.strip_prefix,
                  allow_unverified=args.allow_unverified)
    tensors = load_full_model_state(args.checkpoint_dir, strip_prefix=args.strip_prefix,
                                    allow_unverified=args.allow_unverified)
    total = sum(t.numel() for t in tensors.values())
    print(f"wrote {len(tensors)} tensors ({total / 1e6:.2f}M elements) to {out}")



# ----------------------------------------------------------------------------------------------------
# Tokenizer files and the export
# ----------------------------------------------------------------------------------------------------


def tokenizer_source_of(weights: PathLike) -> Optional[Path]:
    """Where the tokenizer files of the weights at ``weights`` are: a Hugging Face directory itself, or the
    ``tokenizer/`` folder of the recipe run a checkpoint belongs to (``None``: neither)."""
    path = Path(weights)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    try:
        run_dir = locate_checkpoint(path)[1]
    except FileNotFoundError:
        return None
    return None if run_dir is None else run_dir / TOKENIZER_DIR


def _link_boundary(source: Path) -> Path:
    """The folder a tokenizer file of ``source`` may link within: a run's ``tokenizer/`` -> the run folder; a
    Hugging Face cache snapshot (``models--org--name/snapshots/<rev>``) -> the repository's folder, whose
    ``blobs/`` its files link to; any other directory -> itself."""
    if source.name == TOKENIZER_DIR:
        return source.parent
    if source.parent.name == "snapshots":
        return source.parent.parent
    return source


def check_tokenizer_files(source: PathLike) -> list[str]:
    """The :data:`TOKENIZER_FILES` that ``source`` has, after checking that none is a link out of its folder
    (see :func:`copy_tokenizer_files`).

    Raises:
        ValueError: a file is a link that leaves the folder; names the file and where it points.
    """
    source = Path(source)
    names = [n for n in TOKENIZER_FILES if (source / n).is_file()]
    boundary = _link_boundary(source).resolve()
    for name in names:
        real = (source / name).resolve()
        if not real.is_relative_to(boundary):
            raise ValueError(
                f"tokenizer file {source / name} is a link to {real}, outside {boundary}: refused, so that no file from "
                f"elsewhere is copied into runs and exports. Replace the link with the file itself"
            )
    return names


def copy_tokenizer_files(source: PathLike, destination: PathLike) -> list[str]:
    """Copy the :data:`TOKENIZER_FILES` that ``source`` has into ``destination``; returns their names.

    A file that is a link leaving ``source``'s folder (a run's folder for its ``tokenizer/``, a Hugging Face
    cache repository for a snapshot) is refused before anything is copied (``ValueError``).
    """
    source, destination = Path(source), Path(destination)
    names = check_tokenizer_files(source)
    if names:
        destination.mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copy2(source / name, destination / name)
    return names


def export_hf(
    source: PathLike,
    output_dir: PathLike,
    *,
    dtype: Optional[torch.dtype] = None,
    model_type: Optional[str] = None,
    overwrite: bool = False,
    allow_unverified: bool = False,
) -> Path:
    """Write the model of a run directory or checkpoint as a Hugging Face directory at ``output_dir``.

    Args:
        source: a run directory (its ``checkpoints/last.ckpt``) or one of its checkpoints.
        output_dir: the directory to write (``config.json``, ``model.safetensors``, tokenizer files).
        dtype: cast the weights (default: as trained, i.e. the fp32 master weights of a mixed-precision run).
        model_type: ``"llama"``, ``"mixtral"`` or ``"qwen2_moe"``; default: the type the run started from,
            else what :func:`~lightning_vescale.models.save_pretrained` picks for the model.
        overwrite: replace an existing non-empty ``output_dir``.
        allow_unverified: export a sharded checkpoint whose ``checksums.json`` is missing (refused by default).

    The directory is written next to ``output_dir`` and renamed into place, so a failure leaves nothing
    half-written under the final name.

    Raises:
        FileNotFoundError: ``source`` is not a run or checkpoint.
        FileExistsError: ``output_dir`` exists, is not empty, and ``overwrite`` is False.
        ValueError: the run's model config is unknown, the weights do not match it, or the architecture
            cannot be expressed as ``model_type``.
    """
    checkpoint, run_dir = locate_checkpoint(source)
    if run_dir is None:
        raise ValueError(
            f"{str(checkpoint)!r} is not inside a recipe run (<run>/checkpoints/...), so its model config is unknown; "
            f"pass the run directory or one of its checkpoints"
        )
    output_dir = Path(output_dir)
    if output_dir.exists() and any(output_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{str(output_dir)!r} exists and is not empty; pick a new directory or pass --overwrite")
    arch, run_model_type = read_run_model(run_dir)
    state = read_model_state(checkpoint, allow_unverified=allow_unverified)
    with torch.device("meta"):
        model = FAMILIES[family_of(arch)].model_cls(arch)
    model.to_empty(device="cpu")
    model.init_buffers()
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
    if missing or unexpected or wrong:
        raise ValueError(
            f"the weights in {str(checkpoint)!r} do not match the run's model config ({RUN_MODEL_FILE}): "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}, wrong shape {wrong[:5]}"
        )
    model.load_state_dict(state, strict=True)
    tmp = output_dir.with_name(output_dir.name + ".tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(model, arch, tmp, model_type=model_type or run_model_type, dtype=dtype)
    copy_tokenizer_files(run_dir / TOKENIZER_DIR, tmp)
    if output_dir.exists():
        shutil.rmtree(output_dir)
    os.replace(tmp, output_dir)
    return output_dir


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_vescale.export", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", help="a run directory (uses checkpoints/last.ckpt) or one of its checkpoints")
    parser.add_argument("output_dir", help="the Hugging Face directory to write")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default: the checkpoint's dtype")
    parser.add_argument("--model-type", choices=SUPPORTED_MODEL_TYPES, default=None,
                        help="default: the type the run started from, else llama / qwen2_moe / mixtral by model")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    parser.add_argument("--allow-unverified", action="store_true",
                        help="export a checkpoint whose checksums.json is missing (its bytes cannot be verified)")
    args = parser.parse_args(argv)
    try:
        out = export_hf(args.source, args.output_dir, dtype=_DTYPES.get(args.dtype), model_type=args.model_type,
                        overwrite=args.overwrite, allow_unverified=args.allow_unverified)
    except (OSError, ValueError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    files = sorted(p.name for p in out.iterdir())
    sys.stdout.write(f"wrote {out} ({', '.join(files)})\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

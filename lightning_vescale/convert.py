"""Convert a sharded checkpoint directory into one ordinary weights file, offline, in one process.

    python -m lightning_vescale.convert CHECKPOINT_DIR model.safetensors
    python -m lightning_vescale.convert CHECKPOINT_DIR model.pt --format torch --strip-prefix model.

Works on any directory written by :func:`lightning_vescale.checkpoint.save` (and so by the Lightning
and Fabric strategies and the recipes), whatever world size wrote it: DCP reads every saved box into
full tensors. No process group, GPU or model code is needed. The result loads with plain
``safetensors.torch.load_file`` / ``torch.load`` into an unsharded model.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Union

import torch

__all__ = ["load_full_model_state", "convert"]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output")
    parser.add_argument("--format", choices=["safetensors", "torch"], default=None,
                        help="default: from the output's suffix (.safetensors, else torch)")
    parser.add_argument("--strip-prefix", default="",
                        help="remove this prefix from names, e.g. 'model.' for a LightningModule's attribute")
    parser.add_argument("--allow-unverified", action="store_true",
                        help="convert a checkpoint whose checksums.json is missing (its bytes cannot be verified)")
    args = parser.parse_args()
    fmt = args.format or ("safetensors" if args.output.endswith(".safetensors") else "torch")
    out = convert(args.checkpoint_dir, args.output, format=fmt, strip_prefix=args.strip_prefix,
                  allow_unverified=args.allow_unverified)
    tensors = load_full_model_state(args.checkpoint_dir, strip_prefix=args.strip_prefix,
                                    allow_unverified=args.allow_unverified)
    total = sum(t.numel() for t in tensors.values())
    print(f"wrote {len(tensors)} tensors ({total / 1e6:.2f}M elements) to {out}")


if __name__ == "__main__":
    main()

"""Non-tensor checkpoint values (loop state, hyperparameters, schedulers, RNG) as JSON, never pickle.

A sharded checkpoint must load without running code stored in it, so everything that is not a tensor is
encoded as typed JSON and stored as a ``uint8`` tensor (DCP reads tensors with ``weights_only=True``).
The encoding keeps what JSON alone would lose: tuples, non-string dict keys, non-finite floats, small
tensors and numpy arrays (inline, with their dtype and shape), and ``pathlib`` paths. Anything else is
refused at save time with the path of the offending value, before a byte is written.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import numpy as np
import torch

__all__ = ["decode", "encode", "from_bytes_tensor", "to_bytes_tensor"]

_TAG = "__lv__"


def _encode(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {_TAG: "float", "value": repr(value)}
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and k != _TAG for k in value):
            return {k: _encode(v, f"{where}.{k}") for k, v in value.items()}
        return {_TAG: "dict", "items": [[_encode(k, f"{where} key"), _encode(v, f"{where}[{k!r}]")]
                                        for k, v in value.items()]}
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        if t.is_quantized or t.is_sparse or t.is_complex():
            raise TypeError(f"{where}: a {t.layout} / {t.dtype} tensor cannot be stored in checkpoint values")
        return {_TAG: "tensor", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "data": _encode(t.float().tolist() if t.dtype == torch.bfloat16 or t.dtype.itemsize == 1
                                and t.dtype.is_floating_point else t.tolist(), where)}
    if isinstance(value, np.ndarray):
        return {_TAG: "ndarray", "dtype": str(value.dtype), "shape": list(value.shape),
                "data": _encode(value.tolist(), where)}
    if isinstance(value, np.generic):
        return _encode(value.item(), where)
    if isinstance(value, pathlib.PurePath):
        return {_TAG: "path", "value": str(value)}
    if isinstance(value, torch.dtype):
        return {_TAG: "dtype", "value": str(value).removeprefix("torch.")}
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which a checkpoint does not store: "
        f"checkpoints hold tensors and plain values (numbers, strings, lists, tuples, dicts, small tensors, numpy "
        f"arrays) so that loading one can never run code. Convert it to plain values (e.g. in state_dict() or "
        f"on_save_checkpoint), or keep it out of the checkpoint."
    )


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {k: _decode(v) for k, v in value.items()}
    if tag == "float":
        return float(value["value"])
    if tag == "tuple":
        return tuple(_decode(v) for v in value["items"])
    if tag == "dict":
        return {_hashable(_decode(k)): _decode(v) for k, v in value["items"]}
    if tag == "tensor":
        dtype = getattr(torch, value["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown tensor dtype {value['dtype']!r} in checkpoint values")
        data = _decode(value["data"])
        return torch.tensor(data, dtype=torch.float32 if dtype.is_floating_point else dtype).to(dtype).reshape(
            value["shape"])
    if tag == "ndarray":
        return np.asarray(_decode(value["data"]), dtype=np.dtype(value["dtype"])).reshape(value["shape"])
    if tag == "path":
        return pathlib.Path(value["value"])
    if tag == "dtype":
        dtype = getattr(torch, value["value"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {value['value']!r} in checkpoint values")
        return dtype
    raise ValueError(f"unknown value tag {tag!r} in checkpoint values (written by a newer release?)")


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def encode(value: Any, where: str = "value") -> str:
    """``value`` as typed JSON text; ``TypeError`` naming ``where`` for what cannot be stored."""
    return json.dumps(_encode(value, where), allow_nan=False, separators=(",", ":"))


def decode(text: str) -> Any:
    """The value :func:`encode` encoded."""
    return _decode(json.loads(text))


def to_bytes_tensor(value: Any, where: str = "value") -> torch.Tensor:
    """``value`` encoded as a 1-D ``uint8`` tensor (what DCP stores)."""
    data = encode(value, where).encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def from_bytes_tensor(t: torch.Tensor) -> Any:
    """The value stored by :func:`to_bytes_tensor`."""
    return decode(bytes(t.numpy().tobytes()).decode("utf-8"))

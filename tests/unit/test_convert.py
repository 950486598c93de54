"""Offline conversion of a sharded checkpoint directory into one ordinary weights file."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lightning_vescale import checkpoint as ckpt
from lightning_vescale.convert import convert, load_full_model_state
from tests.toy_models import TinyTransformer


def test_convert_round_trips_and_loads_without_the_library(tmp_path) -> None:
    torch.manual_seed(0)
    model = TinyTransformer()
    ckpt.save(tmp_path / "ck", model)
    out = convert(tmp_path / "ck", tmp_path / "weights.safetensors")
    fresh = TinyTransformer()
    assert not torch.equal(fresh.tok.weight, model.tok.weight)  # the load below must be what makes them equal
    fresh.load_state_dict(load_file(str(out)), strict=False)
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    torch_out = convert(tmp_path / "ck", tmp_path / "weights.pt", format="torch", strip_prefix="layers.")
    assert any(k.startswith("0.") for k in torch.load(torch_out))


def test_convert_errors_name_the_problem(tmp_path) -> None:
    (tmp_path / "half").mkdir()
    with pytest.raises(FileNotFoundError, match="not a complete sharded checkpoint"):
        load_full_model_state(tmp_path / "half")
    with pytest.raises(ValueError, match="format must be"):
        convert(tmp_path / "half", tmp_path / "x.bin", format="npz")

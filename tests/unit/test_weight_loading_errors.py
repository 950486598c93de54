"""Loading weights that are not weights: every loader refuses them with a message, and loads nothing.

Checkpoints are written with :func:`save_pretrained` (a Hugging Face layout) and then damaged the way a
user would meet them: integer or bool tensors where float weights belong, a safetensors header whose
dtype is relabelled (same byte size, so only the kind gives it away) or whose dtype no longer fits the
bytes, a shard index that points outside the checkpoint directory, and a config.json far larger than
the weights (refused from the headers, before the model is allocated).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_vescale.models import Llama, LlamaConfig, from_pretrained, save_pretrained
from lightning_vescale.state_dict.dtype_kinds import check_dtype_kinds
from tests.toy_models import MLP

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_hidden=48, max_seq_len=16)
WQ = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    save_pretrained(Llama(CONFIG), CONFIG, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _rewrite_header(file: Path, edit) -> None:
    """Apply ``edit`` to the JSON header of a safetensors file, keeping its tensor bytes."""
    raw = file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    file.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + n :])


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_from_pretrained_refuses_non_float_weights(checkpoint: Path, dtype: torch.dtype) -> None:
    state = load_file(checkpoint / "model.safetensors")
    state[WQ] = (state[WQ] > 0) if dtype == torch.bool else (state[WQ] * 1000).to(dtype)
    save_file(state, checkpoint / "model.safetensors")
    kind = "bool" if dtype == torch.bool else "integer"
    with pytest.raises(ValueError, match=rf"dtype kind mismatches.*\n.*{WQ} -> layers.0.attention.wq.weight: "
                                         rf"{str(dtype)[6:]} \({kind}\), model float32 \(floating\)"):
        from_pretrained(checkpoint)


def test_from_pretrained_refuses_a_header_dtype_relabelled_within_the_byte_size(checkpoint: Path) -> None:
    # F32 -> I32 keeps the byte size, so safetensors accepts it; the values would be float bits read as ints.
    _rewrite_header(checkpoint / "model.safetensors", lambda h: h[WQ].update(dtype="I32"))
    with pytest.raises(ValueError, match=rf"{WQ} -> layers.0.attention.wq.weight: int32 \(integer\)"):
        from_pretrained(checkpoint)


def test_from_pretrained_names_the_file_whose_header_does_not_fit_its_bytes(checkpoint: Path) -> None:
    _rewrite_header(checkpoint / "model.safetensors", lambda h: h[WQ].update(dtype="F16"))
    with pytest.raises(ValueError, match=r"model\.safetensors is not a valid safetensors file .*save it again"):
        from_pretrained(checkpoint)


def _shard(checkpoint: Path, shard_name: str) -> None:
    """Turn the checkpoint into an index whose only shard is named ``shard_name``."""
    state = load_file(checkpoint / "model.safetensors")
    (checkpoint / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {name: shard_name for name in state}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    return state


@pytest.mark.parametrize("outside", ["../secret.safetensors", "/abs/model.safetensors", "sub/../../x.safetensors"])
def test_index_shards_must_stay_inside_the_checkpoint_directory(checkpoint: Path, outside: str) -> None:
    state = _shard(checkpoint, outside)
    if not outside.startswith("/"):
        (checkpoint / "sub").mkdir()
        save_file(state, checkpoint / outside)  # the file exists: only its place is wrong
    with pytest.raises(ValueError, match=r"names shard files outside the checkpoint directory"):
        from_pretrained(checkpoint)


def test_index_shards_in_a_subdirectory_load(checkpoint: Path) -> None:
    reference, _ = from_pretrained(checkpoint)
    state = _shard(checkpoint, "shards/model-00001-of-00001.safetensors")
    (checkpoint / "shards").mkdir()
    save_file(state, checkpoint / "shards" / "model-00001-of-00001.safetensors")
    model, _ = from_pretrained(checkpoint)
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_an_oversized_config_fails_with_the_mismatch_before_allocating(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    # 2**40 x 32 fp32 embeddings (4 TiB): allocating them fails, so only a check on the meta device gets here.
    (checkpoint / "config.json").write_text(json.dumps({**config, "vocab_size": 2**40}))
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight -> tok_embeddings\.weight: checkpoint "
                                         r"\(64, 32\), model \(1099511627776, 32\)"):
        from_pretrained(checkpoint)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_check_dtype_kinds_refuses_int_and_bool_for_float_weights(dtype: torch.dtype) -> None:
    model = torch.nn.Linear(3, 2)
    state = {"weight": torch.ones(2, 3, dtype=dtype), "bias": torch.zeros(2)}
    with pytest.raises(ValueError, match=rf"the full state dict holds tensors of another kind.*\n  weight: "
                                         rf"{str(dtype)[6:]} \(\w+\), model float32 \(floating\)"):
        check_dtype_kinds(model, state, what="full state dict")
    check_dtype_kinds(model, {"weight": torch.ones(2, 3, dtype=torch.bfloat16)}, what="full state dict")


def _bool_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    first = next(iter(state))
    state[first] = state[first] > 0  # loaded silently as 0.0 / 1.0 before
    return state


def test_load_full_state_dict_refuses_bool_weights_and_changes_nothing() -> None:
    from lightning_vescale import checkpoint as ckpt

    model = MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"(?s)full state dict holds tensors of another kind.*weight: bool \(bool\)"):
        ckpt.load_full_state_dict(model, _bool_state(model))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_recipe_initial_weights_refuse_bool_weights() -> None:
    from lightning_vescale.recipe.module import load_full_state_dict_into

    model = MLP()
    with pytest.raises(ValueError, match=r"the initial state dict holds tensors of another kind"):
        load_full_state_dict_into(model, _bool_state(model))

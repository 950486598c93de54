"""Loading a checkpoint never runs code stored in it, never half-loads, and notices flipped bytes.

In one process without a process group (the same code as on N ranks): crafted pickles in ``.metadata`` and in
an entry, through every offline entry point (``checkpoint.load``, ``convert`` (function and command line),
the recipes' ``init_from`` reader); damaged metadata; silent corruption caught by the checksums (and shown to
be silent without them); values that would need pickle refused at save time; format-1 checkpoints (release
0.1): their weights load by default, the pickled rest only when trusted; leftovers of failed saves removed.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from safetensors.torch import load_file

from lightning_vescale import checkpoint as ckpt
from lightning_vescale.checkpoint import _directory, _storage
from lightning_vescale.checkpoint._values import to_bytes_tensor
from lightning_vescale.convert import convert
from lightning_vescale.export import read_model_state
from tests.toy_models import MLP

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


class Payload:
    """Unpickling this creates ``marker``: the observable side effect of code run by a load."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def trained(seed: int = 0):
    torch.manual_seed(seed)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    F.mse_loss(model(torch.randn(4, 7)), torch.randn(4, 5)).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def fresh(seed: int = 3):
    """A model of another init and an optimizer without state: what a load must leave as it is on failure."""
    torch.manual_seed(seed)
    model = MLP()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def unchanged(model, before) -> bool:
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.fixture
def saved(tmp_path) -> Path:
    model, opt = trained()
    path = tmp_path / "ck"
    ckpt.save(path, model, opt, extra={"step": 1})
    return path


def test_a_pickled_metadata_file_never_runs(saved, tmp_path) -> None:
    marker = tmp_path / "pwned"
    (saved / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    model, opt = fresh()
    before = snapshot(model)
    with pytest.raises(ckpt.CheckpointError, match=r"\.metadata is not checkpoint metadata.*refused to load (io|builtins)\.open"):
        ckpt.load(saved, model, opt)
    assert not marker.exists() and unchanged(model, before) and not opt.state


def test_a_pickled_entry_never_runs(tmp_path) -> None:
    # A checkpoint whose loop state is a pickle (what DCP writes for a non-tensor), with valid checksums.
    marker, path = tmp_path / "pwned", tmp_path / "evil"
    model, _ = trained()
    meta = {"format": "lightning_vescale", "version": ckpt.FORMAT_VERSION, "world_size": 1}
    state = {"model": ckpt.get_model_state_dict(model), "values": {"meta": to_bytes_tensor(meta),
                                                                   "extra": Payload(marker)}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    _storage.write_checksums(str(path), _storage.written_items_crc(str(path), _storage.read_metadata(str(path)), 0))
    with pytest.raises(ckpt.CheckpointError, match=r"entry 'values\.extra' is pickled.*weights_only=False"):
        ckpt.load(path, MLP())
    assert not marker.exists()


def test_offline_readers_never_run_payloads(saved, tmp_path) -> None:
    marker = tmp_path / "pwned"
    (saved / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    for read in (lambda: convert(saved, tmp_path / "out.safetensors"), lambda: read_model_state(saved)):
        with pytest.raises(ckpt.CheckpointError, match=r"refused to load (io|builtins)\.open"):
            read()
    done = subprocess.run([sys.executable, "-m", "lightning_vescale.convert", str(saved), str(tmp_path / "o.pt")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "refused to load io.open" in done.stderr, done.stderr[-2000:]
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists() and not (tmp_path / "o.pt").exists()


@pytest.mark.parametrize("damage", ["empty", "truncated", "flipped"])
def test_damaged_metadata_is_a_checkpoint_error(saved, damage) -> None:
    meta = saved / ".metadata"
    data = meta.read_bytes()
    meta.write_bytes({"empty": b"", "truncated": data[: len(data) // 2],
                      "flipped": bytes(b ^ 0xFF for b in data[:64]) + data[64:]}[damage])
    model, opt = fresh()
    before = snapshot(model)
    with pytest.raises(ckpt.CheckpointError, match=r"\.metadata"):
        ckpt.load(saved, model, opt)
    assert unchanged(model, before) and not opt.state


def _corrupt_tensor_bytes(path: Path, fqn: str, value: torch.Tensor) -> tuple[str, int]:
    """Overwrite 4 bytes inside the stored data of tensor ``fqn``, in the item that holds ``value``'s bytes."""
    metadata = _storage.read_metadata(str(path))
    raw = value.detach().contiguous().view(-1).numpy().tobytes()[:64]
    for index, info in metadata.storage_data.items():
        if index.fqn != fqn:
            continue
        file = path / info.relative_path
        blob = bytearray(file.read_bytes())
        at = blob.find(raw, info.offset, info.offset + info.length)
        if at >= 0:
            at += 8
            blob[at : at + 4] = bytes(b ^ 0x5A for b in blob[at : at + 4])
            file.write_bytes(bytes(blob))
            return info.relative_path, at
    raise AssertionError(f"the bytes of {fqn} were not found in its stored items")


def test_flipped_bytes_are_caught_by_the_checksums(tmp_path) -> None:
    model, opt = trained()
    path = tmp_path / "ck"
    ckpt.save(path, model, opt)
    weight = model.blocks[1].up.weight
    file, _ = _corrupt_tensor_bytes(path, "model.blocks.1.up.weight", weight)
    other, other_opt = fresh()
    before = snapshot(other)
    with pytest.raises(ckpt.CheckpointError, match=rf"{file} is corrupted: the bytes of tensor 'model\.blocks\.1\.up\.weight'"):
        ckpt.load(path, other, other_opt)
    assert unchanged(other, before) and not other_opt.state
    # Negative control: DCP alone reads the corrupted value without a word.
    plain = {"model.blocks.1.up.weight": torch.empty_like(weight)}
    dcp.load(plain, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    assert not torch.equal(plain["model.blocks.1.up.weight"], weight.detach())


def test_values_that_need_pickle_are_refused_before_writing(tmp_path) -> None:
    model, opt = trained()
    with pytest.raises(TypeError, match=r"extra\.state\.obj is a builtins\.object.*never run code"):
        ckpt.save(tmp_path / "ck", model, opt, extra={"state": {"obj": object()}})
    assert list(tmp_path.iterdir()) == []
    # What the values can hold round-trips exactly.
    extra = {"step": 3, "lr": 1e-3, "nan": float("nan"), "t": (1, "a"), 4: [None, True], "m": torch.tensor([1.5, 2.0])}
    ckpt.save(tmp_path / "ok", model, opt, extra=extra)
    got = ckpt.load(tmp_path / "ok", MLP())
    assert got["step"] == 3 and got["t"] == (1, "a") and got[4] == [None, True] and torch.equal(got["m"], extra["m"])
    assert got["nan"] != got["nan"] and got["lr"] == 1e-3


def test_format_1_weights_load_by_default_and_the_rest_only_when_trusted() -> None:
    path = FIXTURES / "ckpt_v1"  # written by release 0.1 on 2 ranks (tests/fixtures/README.md)
    want_model = load_file(FIXTURES / "ckpt_v1_model.safetensors")
    want_optim = load_file(FIXTURES / "ckpt_v1_optim.safetensors")
    values = json.loads((FIXTURES / "ckpt_v1_values.json").read_text())

    model = MLP()
    assert ckpt.load(path, model) == {}  # weights only: nothing pickled is read
    assert all(torch.equal(v, want_model[k]) for k, v in model.state_dict().items())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ckpt.CheckpointError, match="format 1 .*pickled.*weights_only=False"):
        ckpt.load(path, model, opt)
    assert not opt.state

    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    assert ckpt.load(path, model, opt, schedulers=sched, weights_only=False) == {"step": 3, "note": "v1"}
    assert all(torch.equal(v, want_model[k]) for k, v in model.state_dict().items())
    names = dict((p, n) for n, p in model.named_parameters())
    for p, state in opt.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], want_optim[f"{names[p]}/{key}"]), (names[p], key)
    assert opt.param_groups[0]["lr"] == values["lr"] and sched.state_dict()["last_epoch"] == values["sched"]["last_epoch"]


def test_leftovers_of_failed_saves_are_removed(saved, monkeypatch) -> None:
    parent = saved.parent
    stale = parent / f"{saved.name}.tmp-deadbeef0000"  # a save whose rank 0 was killed after the write
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"x" * 100)
    model, opt = trained(seed=2)
    ckpt.save(saved, model, opt)
    assert sorted(p.name for p in parent.iterdir()) == ["ck"]
    # The final rename fails: the temporary directory is removed, the previous checkpoint stays loadable.
    monkeypatch.setattr(_directory, "commit", lambda tmp, path: (_ for _ in ()).throw(OSError("rename failed")))
    newer, newer_opt = trained(seed=9)
    with pytest.raises(OSError, match="rename failed"):
        ckpt.save(saved, newer, newer_opt)
    assert sorted(p.name for p in parent.iterdir()) == ["ck"]
    reloaded = MLP()
    ckpt.load(saved, reloaded)
    assert unchanged(reloaded, snapshot(model))
    assert os.path.isfile(saved / _storage.CHECKSUM_FILE)


def test_weights_holding_nan_are_not_saved_unless_asked(tmp_path) -> None:
    model, opt = trained()
    path = tmp_path / "ck"
    ckpt.save(path, model, opt, extra={"step": 1})
    with torch.no_grad():
        model.blocks[1].up.weight[3, 4] = float("nan")
    with pytest.raises(ValueError, match=rf"not saving checkpoint {path}: the model's weights are not finite "
                                         r"\(rank 0: tensor blocks\.1\.up\.weight holds NaN or inf\); the checkpoint "
                                         r"there \(if any\) is unchanged"):
        ckpt.save(path, model, opt, extra={"step": 2})
    other, other_opt = fresh()
    assert ckpt.load(path, other, other_opt) == {"step": 1}  # the good checkpoint is still there
    ckpt.save(path, model, opt, extra={"step": 2}, allow_non_finite=True)
    assert ckpt.load(path, other, other_opt) == {"step": 2}

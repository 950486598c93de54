"""Checkpoint errors and directory handling, in one process without a process group.

Unsharded models go through the same code as sharded ones (their parameters are plain tensors), so
every check that needs no collective is exercised here: mismatched models and optimizers, missing and
half-written directories, the crash window of an atomic save, full state dict checks and export files.
"""

from __future__ import annotations

import logging
import os
import random

import pytest
import torch
import torch.nn.functional as F

from lightning_vescale import checkpoint as ckpt
from lightning_vescale.checkpoint import _save_load
from lightning_vescale.state_dict.report import mismatch_report
from tests.toy_models import MLP, TinyTransformer


def trained(seed: int = 0, **mlp_kwargs):
    torch.manual_seed(seed)
    model = MLP(**mlp_kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        F.mse_loss(model(torch.randn(4, 7)), torch.randn(4, 5)).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def unchanged(model, before) -> bool:
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor))


# --------------------------------------------------------------------------------------------------------
# Pure comparison


def test_mismatch_report_names_every_difference() -> None:
    expected = {"a": (2, 3), "b": (4,), "c": None}
    saved = {"a": (2, 4), "c": None, "d": (1,)}
    report = mismatch_report(expected, saved, ours="model", theirs="checkpoint")
    assert "missing from the checkpoint (1): b (4,)" in report
    assert "unexpected in the checkpoint, not in the model (1): d (1,)" in report
    assert "shape mismatch (1): a: checkpoint (2, 4), model (2, 3)" in report
    assert mismatch_report(expected, dict(expected), ours="m", theirs="c") is None
    many = {f"w{i}": (i,) for i in range(30)}
    assert "... and 10 more" in mismatch_report(many, {}, ours="model", theirs="checkpoint")


# --------------------------------------------------------------------------------------------------------
# save / load


def test_round_trip_restores_everything(tmp_path) -> None:
    model, opt, sched = trained()
    extra = {"step": 2, "seen": torch.arange(3), "by_epoch": {0: [1.5]}, "callbacks": {}}
    ckpt.save(tmp_path / "ck", model, opt, schedulers=sched, extra=extra)
    draws = (torch.rand(2), random.random())
    model2, opt2, sched2 = trained(seed=1)
    loaded = ckpt.load(tmp_path / "ck", model2, opt2, schedulers=[sched2])
    assert list(loaded) == list(extra) and torch.equal(loaded.pop("seen"), extra.pop("seen"))
    assert loaded == extra  # exactly: int keys and empty containers survive
    assert torch.equal(torch.rand(2), draws[0]) and random.random() == draws[1]
    assert unchanged(model2, snapshot(model))
    sd, sd2 = opt.state_dict(), opt2.state_dict()
    assert sd["param_groups"] == sd2["param_groups"] and sched.state_dict() == sched2.state_dict()
    for i, entries in sd["state"].items():
        assert all(torch.equal(v, sd2["state"][i][k]) for k, v in entries.items())
    # Optimizer states are created when absent; loading without the optimizer or schedulers is fine.
    model3, _, _ = trained(seed=2)
    fresh = torch.optim.AdamW(model3.parameters(), lr=1.0)
    ckpt.load(tmp_path / "ck", model3, fresh)
    assert fresh.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], sd["state"][0]["exp_avg"])
    ckpt.load(tmp_path / "ck", MLP())


class Counting(torch.nn.Module):
    """A module with non-tensor extra state (``get_extra_state``), like a step counter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.count = 0

    def get_extra_state(self):
        return {"count": self.count}

    def set_extra_state(self, state) -> None:
        self.count = state["count"]


def test_module_extra_state_round_trips(tmp_path) -> None:
    model = torch.nn.Sequential(Counting(), Counting())
    model[1].count = 5
    ckpt.save(tmp_path / "ck", model)
    fresh = torch.nn.Sequential(Counting(), Counting())
    ckpt.load(tmp_path / "ck", fresh)
    assert (fresh[0].count, fresh[1].count) == (0, 5) and unchanged(fresh, snapshot(model))
    other = torch.nn.Sequential(Counting(), Counting())
    ckpt.load_full_state_dict(other, ckpt.export_full_state_dict(model))
    assert other[1].count == 5 and unchanged(other, snapshot(model))


def test_another_model_is_refused_before_anything_changes(tmp_path) -> None:
    model, opt, sched = trained()
    ckpt.save(tmp_path / "ck", model, opt, schedulers=sched)
    other, other_opt, other_sched = trained(seed=3, hidden=38, num_blocks=4)
    before = snapshot(other)
    state_before = other_opt.state_dict()
    with pytest.raises(ValueError, match="does not match the model") as err:
        ckpt.load(tmp_path / "ck", other, other_opt, schedulers=other_sched)
    message = str(err.value)
    assert str(tmp_path / "ck") in message
    assert "missing from the checkpoint (4): blocks.3.up.weight (38, 13)" in message, message
    assert "blocks.0.up.weight: checkpoint (37, 13), model (38, 13)" in message, message
    assert unchanged(other, before)
    assert other_opt.state_dict()["state"][0]["step"] == state_before["state"][0]["step"]
    # Fewer blocks: the checkpoint's extra ones are unexpected.
    small, _, _ = trained(seed=4, num_blocks=2)
    with pytest.raises(ValueError, match=r"unexpected in the checkpoint, not in .* \(4\): blocks\.2\.up\.weight"):
        ckpt.load(tmp_path / "ck", small)


def test_another_optimizer_or_schedulers_are_refused(tmp_path, caplog) -> None:
    model, opt, sched = trained()
    ckpt.save(tmp_path / "ck", model, opt, schedulers=sched)
    model2 = MLP()
    before = snapshot(model2)
    sgd = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="holds the state of a torch.optim.adamw.AdamW optimizer, not of a "
                                         "torch.optim.sgd.SGD"):
        ckpt.load(tmp_path / "ck", model2, sgd)
    assert not sgd.state and unchanged(model2, before)
    adam = torch.optim.AdamW(model2.parameters())
    scheds = [torch.optim.lr_scheduler.StepLR(adam, 1), torch.optim.lr_scheduler.StepLR(adam, 1)]
    with pytest.raises(ValueError, match=r"holds 1 LR scheduler\(s\), but 2 were given"):
        ckpt.load(tmp_path / "ck", model2, adam, schedulers=scheds)
    # Same optimizer class with other settings (amsgrad): the checkpoint's hyperparameters are restored, as
    # torch's load_state_dict does, and the replaced settings are named in a warning.
    ams = torch.optim.AdamW(model2.parameters(), amsgrad=True)
    with caplog.at_level(logging.WARNING, logger="lightning_vescale.checkpoint"):
        ckpt.load(tmp_path / "ck", model2, ams)
    assert "amsgrad: True -> False" in caplog.text
    assert ams.param_groups[0]["amsgrad"] is False and set(next(iter(ams.state.values()))) == {
        "step", "exp_avg", "exp_avg_sq"}
    # Saved without an optimizer: asking for one is an error.
    ckpt.save(tmp_path / "model_only", model)
    with pytest.raises(ValueError, match="saved without an optimizer"):
        ckpt.load(tmp_path / "model_only", model2, adam)


def test_unsupported_optimizer_state_is_named(tmp_path) -> None:
    model = MLP()
    opt = torch.optim.Adafactor(model.parameters())
    F.mse_loss(model(torch.randn(4, 7)), torch.randn(4, 5)).backward()
    opt.step()
    with pytest.raises(ValueError, match="neither laid out like the parameter"):
        ckpt.save(tmp_path / "ck", model, opt)


def test_missing_and_incomplete_directories(tmp_path) -> None:
    model = MLP()
    with pytest.raises(FileNotFoundError, match=f"no checkpoint at {tmp_path / 'nope'}"):
        ckpt.load(tmp_path / "nope", model)
    half = tmp_path / "half"
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"partial")
    with pytest.raises(ckpt.CheckpointError, match=f"checkpoint directory {half} is incomplete: it has no .metadata"):
        ckpt.load(half, model)
    # An unfinished atomic save is named when the checkpoint itself is missing.
    (tmp_path / "ck.tmp-0123").mkdir()
    with pytest.raises(FileNotFoundError, match=r"unfinished saves that never completed: \['ck.tmp-0123'\]"):
        ckpt.load(tmp_path / "ck", model)
    # Saving over something that is not a checkpoint is refused (it would be deleted).
    with pytest.raises(ValueError, match="refusing to replace"):
        ckpt.save(half, model)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        ckpt.save(tmp_path / "file", model)


def test_atomic_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, caplog) -> None:
    model, opt, _ = trained()
    path = tmp_path / "ck"
    ckpt.save(path, model, opt, extra={"step": 1})
    # A save that fails while writing leaves the previous checkpoint as it was.
    writer = _save_load.dcp.FileSystemWriter

    class Failing(writer):
        def write_data(self, plan, planner):
            raise OSError("disk full")

    monkeypatch.setattr(_save_load.dcp, "FileSystemWriter", Failing)
    newer, newer_opt, _ = trained(seed=5)
    with pytest.raises(ckpt.CheckpointError, match="disk full"):  # DCP's failure, as one exception type
        ckpt.save(path, newer, newer_opt, extra={"step": 2})
    monkeypatch.setattr(_save_load.dcp, "FileSystemWriter", writer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # the unfinished directory was removed
    fresh = MLP()
    assert ckpt.load(path, fresh) == {"step": 1}
    assert unchanged(fresh, snapshot(model))
    # The crash window between the two renames: only <path>.old exists, and load falls back to it.
    os.rename(path, f"{path}.old")
    with caplog.at_level(logging.WARNING, logger="lightning_vescale.checkpoint"):
        assert ckpt.load(path, MLP()) == {"step": 1}
    assert "ck.old" in caplog.text
    # The next save completes normally and removes the stale .old and nothing else.
    ckpt.save(path, newer, newer_opt, extra={"step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert ckpt.load(path, fresh) == {"step": 2} and unchanged(fresh, snapshot(newer))


# --------------------------------------------------------------------------------------------------------
# Full state dicts


def test_full_state_dict_checks_names_and_shapes() -> None:
    model = TinyTransformer()
    before = snapshot(model)
    source = TinyTransformer(vocab=60, n_layers=1).state_dict()
    with pytest.raises(ValueError, match="the full state dict does not match the model") as err:
        ckpt.load_full_state_dict(model, source)
    message = str(err.value)
    assert "missing from the state dict (10): layers.1.norm1.weight (24,)" in message, message
    assert "tok.weight: state dict (60, 24), model (53, 24)" in message, message
    assert unchanged(model, before)
    # strict=False skips missing / unexpected names, but never a wrong shape.
    with pytest.raises(ValueError, match="shape mismatch"):
        ckpt.load_full_state_dict(model, source, strict=False)
    partial = {k: v for k, v in TinyTransformer().state_dict().items() if k.startswith("layers.0.")}
    partial["bogus"] = torch.zeros(1)
    ckpt.load_full_state_dict(model, partial, strict=False)
    assert torch.equal(model.layers[0].attn.qkv.weight, partial["layers.0.attn.qkv.weight"])
    with pytest.raises(ValueError, match=r"unexpected in the state dict, not in the model \(1\): bogus"):
        ckpt.load_full_state_dict(model, {**model.state_dict(), "bogus": torch.zeros(1)})


def test_save_full_is_plain_and_checks_its_format(tmp_path) -> None:
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = TinyTransformer()
    ckpt.save_full(tmp_path / "m.safetensors", model)
    ckpt.save_full(tmp_path / "m.pt", model, format="torch")
    for sd in (load_file(tmp_path / "m.safetensors"), torch.load(tmp_path / "m.pt")):
        other = TinyTransformer()
        other.load_state_dict(sd, strict=True)  # tied head.weight is in the file under both names
        assert unchanged(other, snapshot(model))
    assert sorted(os.listdir(tmp_path)) == ["m.pt", "m.safetensors"]  # no temporary files left
    with pytest.raises(ValueError, match="format must be 'safetensors' or 'torch', got 'npz'"):
        ckpt.save_full(tmp_path / "m.npz", model, format="npz")

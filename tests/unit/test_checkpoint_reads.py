"""Reading a checkpoint that others write, damage or leave behind (issue 25), in one process.

* A save that replaces or relinks the checkpoint while it is read: the read is of one save, or refused
  (a deterministic interleaving, then a writer thread saving while readers read ``last.ckpt``).
* A ``.metadata`` whose shapes the files do not back is refused before anything is allocated.
* A checkpoint without ``checksums.json`` is refused by every reader unless ``allow_unverified``.
* The temporary directories of killed saves are removed by the next save in the folder, whichever target
  they were for; a live save's are kept.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from lightning_vescale import checkpoint as ckpt
from lightning_vescale.checkpoint import _directory, _storage
from lightning_vescale.convert import convert
from lightning_vescale.export import export_hf, read_model_state, write_run_model
from lightning_vescale.models import Llama, llama_config
from tests.toy_models import MLP


def filled(value: float) -> nn.Module:
    """An MLP whose every weight is ``value``: a load shows which save its weights came from."""
    model = MLP()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def weights_step(model: nn.Module) -> set[float]:
    return {float(v) for p in model.parameters() for v in p.detach().unique()}


def relink(link: Path, target: str) -> None:
    tmp = link.with_name(link.name + ".tmp-link")
    tmp.symlink_to(target)
    os.replace(tmp, link)


# ---------------------------------------------------------------------------------------------------------
# Consistent reads


def test_a_save_that_replaces_the_checkpoint_during_a_load_never_mixes_two_saves(tmp_path, monkeypatch) -> None:
    path = tmp_path / "ck"
    ckpt.save(path, filled(1.0), extra={"step": 1})
    real_read = _storage.SafeFileSystemReader.read_data
    replaced = []

    def read_data(self, plan, planner):
        if not replaced and any(item.storage_index.fqn.startswith("model.") for item in plan.items):
            replaced.append(True)  # the writer commits step 2 at the same path between the reader's two reads
            ckpt.save(path, filled(2.0), extra={"step": 2})
        return real_read(self, plan, planner)

    monkeypatch.setattr(_storage.SafeFileSystemReader, "read_data", read_data)
    reader = filled(0.0)
    try:
        extra = ckpt.load(path, reader)
    except ckpt.CheckpointError as err:  # the save it opened was deleted under it: refused, nothing changed
        assert "nothing was loaded" in str(err) and weights_step(reader) == {0.0}  # noqa: PT017 - either outcome is checked
    else:
        assert weights_step(reader) == {float(extra["step"])}, "the step counter and the weights are of two saves"
    assert replaced


def test_reads_of_last_ckpt_while_a_writer_saves_are_each_of_one_save(tmp_path) -> None:
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    last = folder / "last.ckpt"
    ckpt.save(folder / "step-1", filled(1.0), extra={"step": 1})
    last.symlink_to("step-1")
    stop = threading.Event()

    def writer() -> None:  # as the recipes' StepCheckpoint: save, relink last.ckpt, then drop the one before
        for step in range(2, 30):
            ckpt.save(folder / f"step-{step}", filled(float(step)), extra={"step": step})
            relink(last, f"step-{step}")
            old = folder / f"step-{step - 2}"
            if old.exists():
                shutil.rmtree(old)
        stop.set()

    thread = threading.Thread(target=writer)
    thread.start()
    loads = mixed = refused = 0
    try:
        while not stop.is_set() or loads == 0:
            reader = filled(0.0)
            try:
                step = ckpt.load(last, reader)["step"]
            except (ckpt.CheckpointError, FileNotFoundError):
                refused += 1
                assert weights_step(reader) == {0.0}
                continue
            loads += 1
            mixed += weights_step(reader) != {float(step)}
    finally:
        thread.join()
    assert mixed == 0, f"{mixed} of {loads} loads mixed two saves ({refused} refused)"
    assert loads > 0


# ---------------------------------------------------------------------------------------------------------
# What .metadata may claim


def _forge(path: Path, edit) -> None:
    metadata = _storage.read_metadata(str(path))
    edit(metadata)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


def test_a_shape_the_files_do_not_hold_is_refused_before_anything_is_allocated(tmp_path) -> None:
    path = tmp_path / "ck"
    ckpt.save(path, MLP())
    fqn = "model.out.weight"

    def huge(metadata) -> None:  # 4 TB claimed by one chunk of a few hundred bytes
        md = metadata.state_dict_metadata[fqn]
        md.size = torch.Size([10**6, 10**6])
        md.chunks[0].sizes = torch.Size([10**6, 10**6])

    _forge(path, huge)
    with pytest.raises(ckpt.CheckpointError, match=r"tensor 'model\.out\.weight' claims a chunk of size "
                                                   r"\[1000000, 1000000\] .* but its stored item holds only \d+ bytes"):
        convert(path, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_a_tensor_whose_chunk_was_removed_is_refused(tmp_path) -> None:
    path = tmp_path / "ck"
    ckpt.save(path, MLP())
    _forge(path, lambda metadata: metadata.state_dict_metadata["model.out.weight"].chunks.clear())
    with pytest.raises(ckpt.CheckpointError, match=r"the chunks of tensor 'model\.out\.weight' \(shape \[5, 13\]\) "
                                                   r"cover 0 of its 65 elements"):
        ckpt.read_full_tensors(path)


# ---------------------------------------------------------------------------------------------------------
# Missing checksums


class Recipe(nn.Module):
    """The recipes' LightningModule holds the network as ``self.model``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Llama(llama_config("tiny"))


def test_a_checkpoint_without_checksums_is_refused_by_every_reader_unless_allowed(tmp_path) -> None:
    run = tmp_path / "run"
    path = run / "checkpoints" / "step-000001.ckpt"
    ckpt.save(path, Recipe())
    write_run_model(run, llama_config("tiny"))
    (run / "checkpoints" / "last.ckpt").symlink_to(path.name)
    os.remove(path / _storage.CHECKSUM_FILE)
    missing = r"has no checksums\.json, so its bytes cannot be verified.*allow_unverified=True"
    with pytest.raises(ckpt.CheckpointError, match=missing):
        ckpt.read_full_tensors(path)
    with pytest.raises(ckpt.CheckpointError, match=missing):
        convert(path, tmp_path / "w.safetensors")
    with pytest.raises(ckpt.CheckpointError, match=missing):
        read_model_state(path)  # init_from
    with pytest.raises(ckpt.CheckpointError, match=missing):
        export_hf(run, tmp_path / "hf")
    with pytest.raises(ckpt.CheckpointError, match=missing):
        ckpt.load(path, Recipe())
    proc = subprocess.run([sys.executable, "-m", "lightning_vescale.convert", str(path), str(tmp_path / "c.pt")],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert proc.returncode != 0 and "has no checksums.json" in proc.stderr
    # The documented override reads them as they are.
    assert ckpt.read_full_tensors(path, allow_unverified=True)
    assert export_hf(run, tmp_path / "hf", allow_unverified=True).is_dir()
    ckpt.load(path, Recipe(), allow_unverified=True)


# ---------------------------------------------------------------------------------------------------------
# Leftovers of killed saves


_KILLED_SAVE = """
import os, signal, sys
from lightning_vescale.checkpoint import _directory
_directory.WriterLock(sys.argv[1])                 # rank 0 starts the save
open(os.path.join(sys.argv[1], "__0_0.distcp"), "wb").write(b"x" * 100)
os.kill(os.getpid(), signal.SIGKILL)               # and is killed before it commits
"""


def test_the_next_save_in_the_folder_removes_killed_saves_but_never_a_live_one(tmp_path) -> None:
    killed = tmp_path / "step-000002.ckpt.tmp-0123456789ab"
    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(killed)], env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert proc.returncode == -9 and killed.is_dir()
    live = tmp_path / "step-000003.ckpt.tmp-ba9876543210"
    lock = _directory.WriterLock(str(live))  # another job saving into the same folder right now
    try:
        fd = os.open(live / _directory.WRITER_LOCK, os.O_RDWR)  # a second description: its lock is taken
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
        ckpt.save(tmp_path / "step-000004.ckpt", MLP())  # another target than the killed save's
        assert not killed.exists(), "a killed save's temporary directory was left behind"
        assert live.is_dir(), "a live save's temporary directory was removed"
    finally:
        lock.release()
    assert not (tmp_path / "step-000004.ckpt" / _directory.WRITER_LOCK).exists()

"""On 2 gloo ranks: a damaged checkpoint changes nothing on any rank, and no entry point runs stored code.

One class of tests sharing its 2 ranks (:class:`tests.dist_pool.DistributedTest`), one test per behaviour:

* Four bytes flipped in one rank's shard file (a piece rank 1 wrote): every rank raises ``CheckpointError`` (an
  ``Exception``) naming the file and the tensor, and no rank's parameters or optimizer states changed (bitwise: the
  ranks agree before any copy). A missing shard file is named the same way, and so is a ``.metadata`` that lost a
  chunk (by ``load`` and by ``read_full_tensors``).
* A ``.metadata`` replaced by a pickle that would create a file: refused through ``Trainer.fit(ckpt_path=...)``
  (``weights_only`` True and False: metadata is never unpickled freely), ``Fabric.load`` and
  ``VeScaleAccelerator.load_state``; the file is never created.
"""

from __future__ import annotations

import math
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader, TensorDataset

import lightning_vescale as lv
import lightning_vescale.lightning  # noqa: F401 - registers strategy="vescale"
from lightning_vescale import checkpoint as ckpt
from lightning_vescale.accelerate import VeScaleAccelerator
from tests.dist_pool import DistributedTest
from tests.toy_models import MLP
from tests.unit.test_checkpoint_safety import Payload, _corrupt_tensor_bytes


def sharded(seed: int):
    torch.manual_seed(seed)
    model = MLP()
    for block in model.blocks:
        lv.fully_shard(block)
    lv.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def snapshot(model, opt) -> list[torch.Tensor]:
    out = [p.to_local().clone() for p in model.parameters()]
    out += [v.to_local().clone() if hasattr(v, "to_local") else v.clone()
            for p in model.parameters() for v in opt.state.get(p, {}).values()]
    return out


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def craft(path: Path, marker: Path) -> None:
    """Rank 0 replaces the checkpoint's metadata with a pickle that creates ``marker``."""
    if dist.get_rank() == 0:
        (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    dist.barrier()


def _saved(rank: int, path: Path):
    """A trained model and optimizer saved at ``path``; a tensor of which rank 1 wrote a piece of at least 16
    elements; and another model and optimizer, trained, with a snapshot of them."""
    model, opt = sharded(0)
    x, y = torch.randn(8, 7), torch.randn(8, 5)
    F.mse_loss(model(x[rank::2]), y[rank::2]).backward()
    opt.step()
    ckpt.save(path, model, opt)
    name, weight = next((n, p) for n, p in model.named_parameters()
                        if p.layout_info.ranges[1][1] - p.layout_info.ranges[1][0] >= 16)
    other, other_opt = sharded(1)
    F.mse_loss(other(x[rank::2]), y[rank::2]).backward()
    other_opt.step()
    return name, weight, other, other_opt, snapshot(other, other_opt)


def _corrupt_rank1_piece(rank: int, path: Path, name: str, weight) -> str:
    """Rank 0 corrupts the piece of ``weight`` rank 1 wrote; the name of its file, on every rank."""
    full = weight.full_tensor()
    start, end = weight.layout_info.ranges[1]
    file = [None]
    if rank == 0:
        file[0] = _corrupt_tensor_bytes(path, f"model.{name}", full.view(-1)[start:end])[0]
    dist.broadcast_object_list(file)
    assert file[0].startswith("__1_")
    return file[0]


def _flipped_bytes(rank: int, world: int, tmp: str) -> None:
    path = Path(tmp) / "ck"
    name, weight, other, other_opt, before = _saved(rank, path)
    file = _corrupt_rank1_piece(rank, path, name, weight)
    with pytest.raises(ckpt.CheckpointError, match=rf"{file} is corrupted: the bytes of tensor 'model\.{name}'") as err:
        ckpt.load(path, other, other_opt)
    assert isinstance(err.value, Exception)
    assert same(snapshot(other, other_opt), before), "a failed load changed this rank's model or optimizer"


def _missing_shard_file(rank: int, world: int, tmp: str) -> None:
    path = Path(tmp) / "ck"
    name, weight, other, other_opt, before = _saved(rank, path)
    file = _corrupt_rank1_piece(rank, path, name, weight)  # finds the file rank 1 wrote
    if rank == 0:
        os.remove(path / file)
    dist.barrier()
    with pytest.raises(ckpt.CheckpointError, match=rf"cannot read checkpoint file .*{file}"):
        ckpt.load(path, other, other_opt)
    assert same(snapshot(other, other_opt), before)


def _lost_chunk(rank: int, world: int, tmp: str) -> None:
    """A .metadata with the chunk rank 1 wrote of one tensor removed (issue 25): its rows would load as
    uninitialised memory on rank 1. Refused on every rank and every reader before anything is read."""
    path = Path(tmp) / "ck_chunk"
    name, weight, other, other_opt, before = _saved(rank, path)
    full = weight.full_tensor()
    if rank == 0:
        remove_chunk(path, f"model.{name}", weight.layout_info.ranges[1][0])
    dist.barrier()
    lost = rf"the chunks of tensor 'model\.{name}' \(shape \[.*\]\) cover \d+ of its {full.numel()} elements"
    with pytest.raises(ckpt.CheckpointError, match=lost):
        ckpt.load(path, other, other_opt)
    assert same(snapshot(other, other_opt), before)
    with pytest.raises(ckpt.CheckpointError, match=lost):
        ckpt.read_full_tensors(path)  # export, convert and init_from read through it


def remove_chunk(path: Path, fqn: str, flat_start: int) -> None:
    """Drop from ``path``'s metadata the chunk of ``fqn`` that holds flat element ``flat_start``."""
    from lightning_vescale.checkpoint import _storage

    metadata = _storage.read_metadata(str(path))
    md = metadata.state_dict_metadata[fqn]
    strides = [math.prod(md.size[i + 1:]) for i in range(len(md.size))]

    kept = [c for c in md.chunks if sum(o * s for o, s in zip(c.offsets, strides)) != flat_start]
    assert len(kept) == len(md.chunks) - 1, (md.chunks, flat_start)
    md.chunks[:] = kept
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


def _trainer(rank: int, world: int, tmp: str) -> None:
    tmp = Path(tmp)
    marker = tmp / "pwned"
    trainer_kwargs = dict(strategy="vescale", accelerator="cpu", devices=world, logger=False,
                          enable_progress_bar=False, enable_model_summary=False, max_steps=2)
    t = Trainer(default_root_dir=tmp, **trainer_kwargs)
    t.fit(BoringModel())
    path = tmp / "trainer_ckpt"
    t.save_checkpoint(path)
    craft(Path(t.strategy.broadcast(str(path))), marker)
    for weights_only in (True, False):
        t2 = Trainer(default_root_dir=tmp, **trainer_kwargs)
        with pytest.raises(ckpt.CheckpointError, match=r"refused to load (io|builtins)\.open"):
            t2.fit(BoringModel(), ckpt_path=path, weights_only=weights_only)
    dist.barrier()
    assert not marker.exists(), "a load ran code stored in a checkpoint"


def _fabric(rank: int, world: int, tmp: str) -> None:
    tmp = Path(tmp)
    marker = tmp / "pwned"
    fabric = Fabric(accelerator="cpu", devices=world, strategy="vescale")
    fabric.launch()
    torch.manual_seed(0)
    module = fabric.setup_module(MLP())
    fpath = tmp / "fabric_ckpt"
    fabric.save(fpath, {"model": module, "step": 1})
    craft(fpath, marker)
    with pytest.raises(ckpt.CheckpointError, match=r"refused to load (io|builtins)\.open"):
        fabric.load(fpath, {"model": module, "step": 0})
    dist.barrier()
    assert not marker.exists(), "a load ran code stored in a checkpoint"


def _accelerate(rank: int, world: int, tmp: str) -> None:
    tmp = Path(tmp)
    marker = tmp / "pwned"
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    accelerator = VeScaleAccelerator(cpu=True)
    net = MLP()
    accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1),
                        DataLoader(TensorDataset(torch.randn(8, 7)), batch_size=2))
    apath = tmp / "accel_ckpt"
    accelerator.save_state(str(apath))
    craft(apath / "vescale_model_0", marker)
    with pytest.raises(ckpt.CheckpointError, match=r"refused to load (io|builtins)\.open"):
        accelerator.load_state(str(apath))
    dist.barrier()
    assert not marker.exists(), "a load ran code stored in a checkpoint"


class TestCheckpointSafetyOn2Ranks(DistributedTest):
    world_size = 2

    def test_flipped_bytes_are_named_and_change_nothing_on_any_rank(self, tmp_path) -> None:
        self.run_ranks(_flipped_bytes, str(tmp_path))

    def test_a_missing_shard_file_is_named_and_changes_nothing(self, tmp_path) -> None:
        self.run_ranks(_missing_shard_file, str(tmp_path))

    def test_metadata_that_lost_a_chunk_is_refused_by_every_reader(self, tmp_path) -> None:
        self.run_ranks(_lost_chunk, str(tmp_path))

    def test_trainer_fit_runs_no_stored_code(self, tmp_path) -> None:
        self.run_ranks(_trainer, str(tmp_path))

    def test_fabric_load_runs_no_stored_code(self, tmp_path) -> None:
        self.run_ranks(_fabric, str(tmp_path))

    def test_accelerate_load_state_runs_no_stored_code(self, tmp_path) -> None:
        self.run_ranks(_accelerate, str(tmp_path))

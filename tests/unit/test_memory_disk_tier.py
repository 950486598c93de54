"""The disk tier holds what the ledger says, and nothing else returns from it unverified (issue 25).

Activation files are deleted when backward has read them (or autograd drops the graph unread), so the swap
folder does not grow step after step; a tier file changed on disk is refused by its checksum.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.nn.functional as F

from lightning_vescale.memory import DiskStore, DiskTierError, offload_activations
from lightning_vescale.memory.ledger import memory_stats
from lightning_vescale.models import Llama, llama_config


def files(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.endswith(".bin"))


def loss_of(model: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    tokens = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(seed))
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@pytest.fixture
def offloaded(tmp_path):
    torch.manual_seed(0)
    model = Llama(llama_config("tiny"))
    memory_stats.reset()
    offload = offload_activations(model, ["layers.*"], "disk", disk_dir=str(tmp_path), min_bytes=1024)
    yield model, offload
    offload.close()


def test_activation_files_are_deleted_when_backward_has_read_them(offloaded) -> None:
    model, offload = offloaded
    for step in range(3):
        loss = loss_of(model, step)
        held = memory_stats.current[("activations", "disk")]
        assert held > 0 and len(files(offload.store.root)) > 0
        on_disk = sum(os.path.getsize(os.path.join(offload.store.root, n)) for n in files(offload.store.root))
        assert on_disk == held, "the ledger counts what is on disk"
        loss.backward()
        assert files(offload.store.root) == [], f"step {step}: backward left its activation files on disk"
        assert memory_stats.current[("activations", "disk")] == 0


def test_a_graph_dropped_without_backward_deletes_its_files(offloaded) -> None:
    model, offload = offloaded
    loss = loss_of(model)
    assert files(offload.store.root)
    del loss
    gc.collect()
    assert files(offload.store.root) == [] and memory_stats.current[("activations", "disk")] == 0


def test_a_second_backward_through_the_graph_says_what_to_use_instead(offloaded) -> None:
    model, _ = offloaded
    loss = loss_of(model)
    loss.backward(retain_graph=True)
    with pytest.raises(DiskTierError, match=r"read by a backward already .* \(retain_graph=True\).*'host' or 'checkpoint'"):
        loss.backward()


def test_a_tier_file_changed_on_disk_is_refused(tmp_path) -> None:
    store = DiskStore(str(tmp_path))
    t = torch.randn(1000)
    store.write("opt/exp_avg", t)
    path = os.path.join(store.root, "opt_exp_avg.bin")
    with open(path, "r+b") as f:  # random bytes over part of the file
        f.seek(100)
        f.write(os.urandom(64))
    out = torch.empty_like(t)
    with pytest.raises(DiskTierError, match=r"opt_exp_avg\.bin changed on disk since it was written"):
        store.read_into("opt/exp_avg", out)
    store.write("opt/exp_avg", t)  # written again: read back bitwise
    store.read_into("opt/exp_avg", out)
    assert torch.equal(out, t)
    store.close()

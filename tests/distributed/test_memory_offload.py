"""Optimizer states on the disk tier train bitwise like states in memory, and checkpoint exactly.

On 1 and 3 gloo ranks (fp32, CPU): a sharded MLP trained with AdamW and with Muon + AdamW
(``build_optimizer``), once with states in memory and once with ``MemoryPolicy(optimizer_states="disk")`` and
small buckets (so several buckets, prefetch included, are exercised): every parameter and state is bitwise
equal after every step; between steps the states' storage is released (the ledger counts it on disk); a
save and a resume into a fresh offloaded optimizer continue bitwise.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

import lightning_vescale as lv
from lightning_vescale import checkpoint as ckpt
from lightning_vescale.memory import MemoryPolicy, memory_stats, offload_optimizer_states, resident_states
from lightning_vescale.optim import build_optimizer
from tests.dist_utils import run_distributed
from tests.toy_models import MLP

STEPS = 3


def sharded(ref):
    model = copy.deepcopy(ref)
    for block in model.blocks:
        lv.fully_shard(block)
    return lv.fully_shard(model)


def make_optimizer(kind: str, model):
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return build_optimizer(model, lr=1e-2, muon_lr=2e-2)


def train_step(model, opt, step: int, rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(4 * world, 7, generator=g), torch.randn(4 * world, 5, generator=g)
    F.mse_loss(model(x[rank::world]), y[rank::world]).backward()
    opt.step()
    opt.zero_grad()


def states_of(opt) -> list[torch.Tensor]:
    return [v.full_tensor() if hasattr(v, "full_tensor") else v for p in opt.state for v in opt.state[p].values()
            if isinstance(v, torch.Tensor)]


def _run(rank: int, world: int, tmp: str) -> None:
    for kind in ("adamw", "muon"):
        torch.manual_seed(0)
        ref = MLP()
        plain, swapped = sharded(ref), sharded(ref)
        plain_opt, opt = make_optimizer(kind, plain), make_optimizer(kind, swapped)
        policy = MemoryPolicy(optimizer_states="disk", disk_dir=os.path.join(tmp, f"swap{rank}"), bucket_bytes=2048)
        offload = offload_optimizer_states(opt, policy)
        assert len(offload.buckets()) > 2, "several buckets must be swapped for the test to mean anything"
        memory_stats.reset()
        for step in range(STEPS):
            train_step(plain, plain_opt, step, rank, world)
            train_step(swapped, opt, step, rank, world)
            for p, q in zip(plain.parameters(), swapped.parameters()):
                assert torch.equal(p.to_local(), q.to_local()), (kind, step)
            # Between steps every per-element state lives on disk: its storage is released.
            released = [v.to_local().untyped_storage().nbytes() == 0
                        for s in opt.state.values() for v in s.values() if hasattr(v, "to_local")]
            assert released and all(released), (kind, step)
        assert memory_stats.current[("optimizer_states", "disk")] > 0
        with resident_states(opt):  # to read offloaded states, bring them in
            assert [torch.equal(a, b) for a, b in zip(states_of(plain_opt), states_of(opt))] == [True] * len(
                states_of(plain_opt)), kind

        # Save while the states are on disk, resume into a fresh offloaded optimizer: bitwise the same run.
        path = os.path.join(tmp, f"ck_{kind}")
        ckpt.save(path, swapped, opt)
        assert all(v.to_local().untyped_storage().nbytes() == 0
                   for s in opt.state.values() for v in s.values() if hasattr(v, "to_local")), "put back after save"
        torch.manual_seed(5)
        resumed = sharded(MLP())
        resumed_opt = make_optimizer(kind, resumed)
        offload_optimizer_states(resumed_opt, MemoryPolicy(optimizer_states="disk", bucket_bytes=2048,
                                                           disk_dir=os.path.join(tmp, f"swap_resumed{rank}")))
        ckpt.load(path, resumed, resumed_opt)
        for step in range(STEPS, STEPS + 2):
            train_step(plain, plain_opt, step, rank, world)
            train_step(resumed, resumed_opt, step, rank, world)
        for p, q in zip(plain.parameters(), resumed.parameters()):
            assert torch.equal(p.to_local(), q.to_local()), f"{kind}: resumed run differs"
        offload.close()


@pytest.mark.parametrize("world", [1, 3])
def test_disk_offloaded_optimizer_states_train_bitwise(tmp_path, world: int) -> None:
    run_distributed(_run, world, str(tmp_path), timeout=300)


def test_bad_policies_fail_before_training(tmp_path) -> None:
    with pytest.raises(ValueError, match="needs disk_dir"):
        MemoryPolicy(optimizer_states="disk")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    if os.access(read_only, os.W_OK):  # root ignores permissions: nothing to check here
        pytest.skip("running as a user that can write anywhere")
    with pytest.raises(ValueError, match="is not writable"):
        MemoryPolicy(optimizer_states="disk", disk_dir=str(read_only))


def _activations(rank: int, world: int, tmp: str) -> None:
    from lightning_vescale.memory import checkpoint_blocks, offload_activations
    from lightning_vescale.models import Llama, llama_config

    def grads(setup) -> tuple[list[torch.Tensor], float]:
        torch.manual_seed(0)
        model = Llama(llama_config("tiny"))
        setup(model)
        for block in model.layers:
            lv.fully_shard(block)
        lv.fully_shard(model)
        g = torch.Generator().manual_seed(7 + rank)
        tokens = torch.randint(0, model.config.vocab_size, (2, 33), generator=g)
        logits = model(tokens[:, :-1])
        on_disk = memory_stats.current[("activations", "disk")]
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
        return [p.grad.to_local().clone() for p in model.parameters()], on_disk

    memory_stats.reset()
    want, _ = grads(lambda m: None)
    got, held = grads(lambda m: offload_activations(m, ["layers.*"], "disk", disk_dir=os.path.join(tmp, f"a{rank}"),
                                                    min_bytes=1024))
    assert held > 0, "activations must be on disk between forward and backward"
    assert memory_stats.current[("activations", "disk")] == 0, "backward read every offloaded activation back"
    assert all(torch.equal(a, b) for a, b in zip(want, got)), "offloaded activations change the gradients"
    recomputed, _ = grads(lambda m: checkpoint_blocks(m, ["layers.*"]))
    assert all(torch.equal(a, b) for a, b in zip(want, recomputed)), "activation checkpointing changes the gradients"
    with pytest.raises(ValueError, match=r"pattern\(s\) \['decoder\.\*'\] match no module"):
        checkpoint_blocks(Llama(llama_config("tiny")), ["decoder.*"])


def test_offloaded_and_recomputed_activations_give_the_same_gradients(tmp_path) -> None:
    run_distributed(_activations, 2, str(tmp_path), timeout=300)

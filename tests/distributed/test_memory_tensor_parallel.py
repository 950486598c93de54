"""Memory tiers with tensor parallelism: the Llama plan on a ``("dp", "tp")`` mesh of 4 gloo ranks (dp2 x tp2), with
AdamW and with Muon (``build_optimizer``: Muon's tensor-parallel matrices communicate over the whole mesh inside each
bucket of the offloaded step), trains bitwise like the same run with everything on the device, for optimizer states
on host and on disk (in several buckets), master weights, gradient pieces and optimizer states on disk, gathered
parameters on disk and activations on disk; the ledger shows the bytes did move.

One class of tests on the 4 ranks (:class:`tests.dist_pool.DistributedTest`), one test per (optimizer, policy). The
device-only run an optimizer's tests compare with is trained once per rank process and kept (``_device_only``): it
is deterministic (seeded, the same mesh), so every test compares with the same bits as if it trained it itself.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import lightning_vescale as lv
from lightning_vescale.memory import MemoryPolicy, apply_memory_policy, memory_stats, resident_pieces
from lightning_vescale.models.llama import Llama, LlamaConfig
from lightning_vescale.optim import build_optimizer
from tests.dist_pool import DistributedTest

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16)
BATCH, STEPS = 4, 3
POLICIES = {  # policy -> the (class, tier) of the ledger that must have held bytes
    "states on host": (dict(optimizer_states="host"), None),  # host is the device's memory on CPU: nothing moves
    "states on disk, buckets": (dict(optimizer_states="disk", bucket_bytes=4096), ("optimizer_states", "disk")),
    "all pieces on disk": (dict(params="disk", grads="disk", optimizer_states="disk", bucket_bytes=8192),
                           ("params", "disk")),
    "gathered on disk": (dict(gathered_params="disk"), ("gathered_params", "disk")),
    "activations on disk": (dict(activations="disk"), ("activations", "disk")),
}


def _train(mesh, kind: str, policy: dict | None, tmp: str) -> dict[str, torch.Tensor]:
    dp = mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(CONFIG)
    lv.parallelize(model, "llama", mesh, granularity="muon" if kind == "muon" else None)
    opt = build_optimizer(model, lr=3e-3, muon_lr=2e-2) if kind == "muon" else torch.optim.AdamW(
        model.parameters(), lr=1e-2)
    handles = None
    if policy is not None:
        handles = apply_memory_policy(model, [opt], MemoryPolicy(**policy, disk_dir=os.path.join(tmp, kind)),
                                      rank=dist.get_rank())
        if handles.activations is not None:
            handles.activations.min_bytes = 0  # this model's activations are all below the default threshold
    memory_stats.reset()
    per = BATCH // mesh["dp"].size()
    for step in range(STEPS):
        tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, 9), generator=torch.Generator().manual_seed(step))
        x, y = tokens[dp * per : (dp + 1) * per, :-1], tokens[dp * per : (dp + 1) * per, 1:]
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        lv.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    with resident_pieces(model):
        out = {n: p.full_tensor() for n, p in model.named_parameters()}
    if handles is not None:
        handles.close()
    return out


_DEVICE_ONLY: dict[str, dict[str, torch.Tensor]] = {}  # per rank process: kind -> the device-only run's weights


def _device_only(mesh, kind: str, tmp: str) -> dict[str, torch.Tensor]:
    if kind not in _DEVICE_ONLY:
        _DEVICE_ONLY[kind] = _train(mesh, kind, None, tmp)
    return _DEVICE_ONLY[kind]


def _tier_trains_like_device_only(rank: int, world: int, tmp: str, kind: str, label: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    want = _device_only(mesh, kind, tmp)
    policy, moved = POLICIES[label]
    got = _train(mesh, kind, policy, tmp)
    if moved is not None:
        assert memory_stats.peak[moved] > 0, (kind, label, dict(memory_stats.peak))
    bad = [n for n in want if not torch.equal(want[n], got[n])]
    assert not bad, f"{kind}, {label}: differs from the device-only run in {bad}"


class TestMemoryTiersDp2Tp2(DistributedTest):
    world_size = 4
    pg_timeout = 300

    @pytest.mark.parametrize("label", list(POLICIES), ids=[k.replace(",", "").replace(" ", "_") for k in POLICIES])
    @pytest.mark.parametrize("kind", ["adamw", "muon"])
    def test_memory_tier_trains_bitwise_like_device_only(self, kind: str, label: str, tmp_path) -> None:
        self.run_ranks(_tier_trains_like_device_only, str(tmp_path), kind, label, timeout=600)

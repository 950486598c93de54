"""The dry run's bytes per step under sequence parallelism against a counted dp2 x tp2 run (4 gloo ranks).

The ``llama_sp`` plan on a small Llama: the engine's collectives (``comm_stats``) and torch's tensor-parallel ones
(:class:`~lightning_vescale.plan._hardware.FunctionalCollectiveCounter`: the AllGathers and ReduceScatters of the
sequence-split activations, the head's gathered logits) equal the dry run's bytes and calls per kind exactly, with and
without activation checkpointing of the blocks (one test each, :class:`tests.dist_pool.DistributedTest`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import lightning_vescale as lv
from lightning_vescale.memory import checkpoint_blocks
from lightning_vescale.models.llama import Llama, LlamaConfig
from lightning_vescale.plan import load_plan, resolve_plan
from lightning_vescale.plan._dry_run import Workload, dry_run
from lightning_vescale.plan._hardware import FunctionalCollectiveCounter, load_profile
from tests.dist_pool import DistributedTest

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16)
BATCH, SEQ = 2, 8


def _predicted(checkpointing: bool):
    with torch.device("meta"):
        meta = Llama(CONFIG)
    workload = Workload(batch_size=BATCH, seq_len=SEQ, precision="32-true", clip_grad=True, checkpointing=checkpointing)
    return dry_run(meta, resolve_plan(meta, load_plan("llama_sp")), 4, tensor_parallel=2, workload=workload,
                   hardware=load_profile("cpu"), activations={}).vescale


def _counted(mesh, dp: int, checkpointing: bool) -> tuple[dict, dict]:
    with torch.device("meta"):
        model = Llama(CONFIG)
    lv.parallelize(model, "llama_sp", mesh)
    if checkpointing:
        checkpoint_blocks(model, ["layers.*"])
    tokens = torch.randint(0, CONFIG.vocab_size, (2 * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    mine = tokens[dp * BATCH : (dp + 1) * BATCH]
    for _ in range(2):  # the first step also runs the one-time setup collectives
        lv.comm_stats.step()
        with FunctionalCollectiveCounter("tp") as tp:
            logits = model(mine[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        model.zero_grad(set_to_none=True)
    sent = {**dict(lv.comm_stats.step()), **{k: int(v) for k, v in tp.sent.items()}}
    return sent, tp.calls


def _run(rank: int, world: int, checkpointing: bool) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    sent, calls = _counted(mesh, dp, checkpointing)
    predicted = _predicted(checkpointing)
    want = {k: int(v) for k, v in predicted.collectives.items() if v}
    assert sent == want, (checkpointing, sent, want)
    assert calls == {k: v for k, v in predicted.calls.items() if k.endswith("_tp")}, (checkpointing, calls)
    # 2 blocks: q, k, v, w1, w3 gather their input (forward) and reduce-scatter its gradient (backward), and so does
    # the head; wo, w2 and the embedding reduce-scatter their output and gather its gradient; the head gathers the
    # logits. Checkpointing runs a block's forward collectives again (5 gathers, wo's reduce-scatter) but for w2's
    # reduce-scatter (its output feeds only the residual sum).
    assert calls["all_gather_tp"] == 2 * 5 + 1 + 1 + 2 * 2 + 1 + (2 * 5 if checkpointing else 0), calls
    assert calls["reduce_scatter_tp"] == 2 * 2 + 1 + 2 * 5 + 1 + (2 if checkpointing else 0), calls


class TestSequenceParallelBytesPerStep(DistributedTest):
    """dp2 x tp2 on 4 ranks."""

    world_size = 4

    @pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
    def test_bytes_and_calls_per_step_equal_the_dry_run(self, checkpointing: bool) -> None:
        self.run_ranks(_run, checkpointing)

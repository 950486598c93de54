"""The dry run under ep x tp against a counted dp2 x ep2 x tp2 run (8 gloo ranks, a tiny MoE, the moe plan; one step
after a warm-up, routers routing evenly as the dry run assumes).

Attention is split over tp (its AllReduces), each MoE feed-forward runs on 1/tp of the sequence (``tp: split_tokens``:
its output gathered over tp forward, its input gradient backward) in a group of its own sharded over all 8 ranks, the
experts (E/ep per rank) over the 4 dp x tp ranks of their ep coordinate, the rest over the 4 dp x ep ranks of a tp
coordinate; the all-to-alls run among the ep ranks on 1/tp of the tokens. Every kind's bytes and calls equal the
dry run's: the engine's (``comm_stats``), torch's tensor-parallel ones and the all-to-alls
(:class:`~lightning_vescale.plan._hardware.FunctionalCollectiveCounter`), exactly. The dry run's mesh is checked in
this process (it moves no data); the counted run on 8 ranks (:class:`tests.dist_pool.DistributedTest`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import lightning_vescale as lv
from lightning_vescale.models import MoE
from lightning_vescale.models.moe import TopKRouter
from lightning_vescale.plan import load_plan, resolve_plan
from lightning_vescale.plan._dry_run import Workload, dry_run
from lightning_vescale.plan._hardware import FunctionalCollectiveCounter, load_profile
from tests.dist_pool import DistributedTest
from tests.distributed.test_dry_run_expert_parallel import BATCH, CONFIG, SEQ, _even_routing


def _predicted(world: int):
    with torch.device("meta"):
        meta = MoE(CONFIG)
    workload = Workload(batch_size=BATCH, seq_len=SEQ, precision="32-true", clip_grad=True)
    return dry_run(meta, resolve_plan(meta, load_plan("moe")), world, tensor_parallel=2, expert_parallel=2,
                   workload=workload, hardware=load_profile("cpu"), activations={})


def test_the_dry_run_lays_out_a_3d_mesh() -> None:
    assert _predicted(8).mesh == "3-D (dp=2, ep=2, tp=2)"


def _bytes_and_calls_equal_the_dry_run(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "ep", "tp"))
    predicted = _predicted(world)
    assert predicted.mesh == "3-D (dp=2, ep=2, tp=2)"
    want = {k: int(v) for k, v in predicted.vescale.collectives.items() if v}

    torch.manual_seed(0)
    model = MoE(CONFIG)
    lv.parallelize(model, "moe", mesh)
    replica = rank // 2  # the (dp, ep) coordinate: the ranks of one tp group read the same tokens
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(replica))
    original = TopKRouter.forward
    TopKRouter.forward = _even_routing  # type: ignore[method-assign]
    try:
        for _ in range(2):  # the first step also runs the one-time setup collectives
            lv.comm_stats.step()
            with FunctionalCollectiveCounter("tp", all_to_all="ep") as counter:
                F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            model.zero_grad(set_to_none=True)
    finally:
        TopKRouter.forward = original  # type: ignore[method-assign]
    sent = {**dict(lv.comm_stats.step()), **{k: int(v) for k, v in counter.sent.items()}}
    assert sent == want, (sent, want)
    assert counter.calls == {k: predicted.vescale.calls[k] for k in counter.calls}, (counter.calls, predicted.vescale.calls)


class TestExpertTensorParallelBytesPerStep(DistributedTest):
    """dp2 x ep2 x tp2 on 8 ranks."""

    world_size = 8
    pg_timeout = 200

    def test_bytes_and_calls_per_step_equal_the_dry_run(self) -> None:
        self.run_ranks(_bytes_and_calls_equal_the_dry_run, timeout=400)

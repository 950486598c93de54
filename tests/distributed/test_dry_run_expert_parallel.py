"""The dry run under expert parallelism against a counted dp2 x ep2 run (4 gloo ranks, a tiny MoE, the moe plan).

The engine's collectives (``comm_stats``: the experts' groups sharded over the dp ranks, the rest over all four) and
the expert-parallel all-to-alls (:class:`~lightning_vescale.plan._hardware.FunctionalCollectiveCounter`) per step:

* with the routers routing evenly (token ``i`` to experts ``i k .. i k + k - 1`` mod ``E``: every ep rank's experts
  get half of every rank's rows, the dry run's assumption), every kind's bytes and calls equal the dry run's;
* with the routers' own (uneven) choice, the rows' all-to-alls send ``2 x dim x 4 B`` per row routed away (dispatch,
  the combine's backward) and per row received (the combine, the dispatch's backward), which the dry run's
  formula has equal under balance; the counts exchange and the engine's collectives are what the dry run says
  whatever the routing.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import lightning_vescale as lv
from lightning_vescale.models import MoE, moe_config
from lightning_vescale.models.moe import RouterOutput, TopKRouter
from lightning_vescale.plan import load_plan, resolve_plan
from lightning_vescale.plan._dry_run import Workload, dry_run
from lightning_vescale.plan._hardware import FunctionalCollectiveCounter, load_profile
from tests.dist_pool import DistributedTest

CONFIG = dataclasses.replace(moe_config("tiny"), vocab_size=64, dim=32, moe_hidden=32, shared_expert_hidden=32)
BATCH, SEQ = 2, 8


def _even_routing(self: TopKRouter, x_ND: torch.Tensor) -> RouterOutput:
    scores_NE = torch.softmax(F.linear(x_ND, self.weight).float(), dim=-1)
    N, k, E = x_ND.shape[0], self.top_k, self.num_experts
    selected_NA = (torch.arange(N)[:, None] * k + torch.arange(k)) % E
    weights_NA = scores_NE.gather(-1, selected_NA)
    counts_E = torch.bincount(selected_NA.flatten(), minlength=E)
    return RouterOutput(weights_NA.to(x_ND.dtype), selected_NA, scores_NE, counts_E)


def _counted(mesh, rank: int) -> tuple[dict, dict, list]:
    torch.manual_seed(0)
    model = MoE(CONFIG)  # expert parallelism splits real weights (identical on every rank)
    lv.parallelize(model, "moe", mesh)
    routed: list = []
    for layer in model.moe_layers():
        layer.router.register_forward_hook(lambda m, args, out: routed.append(out.num_tokens_per_expert_E))
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # the first step also runs the one-time setup collectives
        lv.comm_stats.step()
        routed.clear()
        with FunctionalCollectiveCounter(all_to_all="ep") as counter:
            F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        model.zero_grad(set_to_none=True)
    sent = {**dict(lv.comm_stats.step()), **{k: int(v) for k, v in counter.sent.items()}}
    return sent, counter.calls, list(routed)


def _predicted(world: int):
    """The dry run's bytes (non-zero kinds) and calls per step of the moe plan on dp2 x ep2."""
    with torch.device("meta"):
        meta = MoE(CONFIG)
    workload = Workload(batch_size=BATCH, seq_len=SEQ, precision="32-true", clip_grad=True)
    predicted = dry_run(meta, resolve_plan(meta, load_plan("moe")), world, expert_parallel=2, workload=workload,
                        hardware=load_profile("cpu"), activations={}).vescale
    return {k: int(v) for k, v in predicted.collectives.items() if v}, predicted.calls


def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))


def _even_routing_equals_the_dry_run(rank: int, world: int) -> None:
    mesh = _mesh()
    want, predicted_calls = _predicted(world)
    original = TopKRouter.forward
    TopKRouter.forward = _even_routing  # type: ignore[method-assign]
    try:
        sent, calls, _ = _counted(mesh, rank)
    finally:
        TopKRouter.forward = original  # type: ignore[method-assign]
    assert sent == want, (sent, want)
    assert calls == {k: predicted_calls[k] for k in calls} == {"all_to_all_ep": 2 * 4, "all_to_all_ep_counts": 2}


def _own_routing_rows_sent_and_received(rank: int, world: int) -> None:
    mesh = _mesh()
    want, _ = _predicted(world)
    sent, calls, routed = _counted(mesh, rank)  # the routers' own choice
    everyone: list = [None] * world
    dist.all_gather_object(everyone, [c.tolist() for c in routed])
    ep_rank, peer = mesh["ep"].get_local_rank(), rank ^ 1  # ("dp", "ep"): the other ep rank of this dp coordinate
    half = CONFIG.num_experts // 2
    out = sum(sum(c[(1 - ep_rank) * half : (2 - ep_rank) * half]) for c in everyone[rank])  # rows bound for the peer
    into = sum(sum(c[ep_rank * half : (ep_rank + 1) * half]) for c in everyone[peer])  # rows the peer sends here
    # Dispatch and the combine's backward send the rows this rank routes away; the combine and the dispatch's
    # backward send back those it received.
    assert sent["all_to_all_ep"] == 2 * (out + into) * CONFIG.dim * 4, (sent, out, into)
    assert sent["all_to_all_ep_counts"] == want["all_to_all_ep_counts"]
    assert {k: v for k, v in sent.items() if not k.startswith("all_to_all")} == \
        {k: v for k, v in want.items() if not k.startswith("all_to_all")}
    if rank == 0:
        print(f"all_to_all_ep bytes with the routers' own choice: dry run (balanced) {want['all_to_all_ep']}, "
              f"rank 0 {sent['all_to_all_ep']} (rows out {out}, in {into}; balanced: {BATCH * SEQ * CONFIG.top_k} each way)")


class TestExpertParallelBytesPerStep(DistributedTest):
    """dp2 x ep2 on 4 ranks."""

    world_size = 4

    def test_even_routing_bytes_and_calls_equal_the_dry_run(self) -> None:
        self.run_ranks(_even_routing_equals_the_dry_run)

    def test_uneven_routing_sends_the_rows_routed_away_and_received(self) -> None:
        self.run_ranks(_own_routing_rows_sent_and_received)

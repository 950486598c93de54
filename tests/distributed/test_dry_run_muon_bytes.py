"""The dry run's Muon all-to-alls against counted runs: every rank's ``muon_gather`` / ``muon_scatter`` bytes per
step (``comm_stats``) equal the dry run's, on 2 gloo ranks (dp2: the default plan's element granularity splits
matrices over the ranks; ``granularity: muon`` keeps them whole: nothing is sent) and on 4
(dp2 x tp2: each tp-split matrix gathered whole to one rank of the (dp, tp) mesh). One class per world size
(:class:`tests.dist_pool.DistributedTest`), one test per granularity; every comparison is exact."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import lightning_vescale as lv
from lightning_vescale.models.llama import Llama, LlamaConfig
from lightning_vescale.optim import build_optimizer
from lightning_vescale.plan import load_plan, resolve_plan
from lightning_vescale.plan._dry_run import Workload, dry_run
from lightning_vescale.plan._hardware import load_profile
from tests.dist_pool import DistributedTest

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16)


def _plan(granularity: str) -> dict:
    plan = load_plan("llama").to_dict()
    if granularity != "element":
        plan["rules"].append({"match": "**.layers.*.*.w*.weight", "granularity": granularity})
    return plan


def _counted(mesh, plan) -> list[dict]:
    with torch.device("meta"):
        model = Llama(CONFIG)
    lv.parallelize(model, plan, mesh)
    opt = build_optimizer(model, lr=1e-3)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):  # the first step also builds Muon's plan (its "setup" collectives)
        lv.comm_stats.step()
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    mine = {k: v for k, v in lv.comm_stats.step().items() if k.startswith("muon")}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def _predicted(plan, world: int, tp: int) -> dict:
    with torch.device("meta"):
        meta = Llama(CONFIG)
    workload = Workload(batch_size=2, seq_len=8, precision="32-true", optimizer="muon")
    return dry_run(meta, resolve_plan(meta, lv.load_plan(plan)), world, tensor_parallel=tp, workload=workload,
                   hardware=load_profile("cpu"), activations={}).vescale.per_rank


def _check(counted: list[dict], predicted: dict, sends: bool = True) -> None:
    for kind in ("muon_gather", "muon_scatter"):
        got = [c.get(kind, 0) for c in counted]
        assert got == predicted[kind], (kind, got, predicted[kind])
        assert any(got) == sends, f"{kind}: {got}"


def _element_granularity_dp2(rank: int, world: int) -> None:
    plan = _plan("element")
    _check(_counted(None, plan), _predicted(plan, world, 1))


def _muon_granularity_dp2(rank: int, world: int) -> None:
    # Every matrix whole on one rank: the local path, nothing sent (moving one does not pay at these sizes).
    plan = _plan("muon")
    _check(_counted(None, plan), _predicted(plan, world, 1), sends=False)


def _element_granularity_dp2_tp2(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = _plan("element")
    _check(_counted(mesh, plan), _predicted(plan, world, 2))


class TestMuonBytesDp2(DistributedTest):
    world_size = 2

    def test_split_matrices_send_the_dry_runs_bytes_per_rank(self) -> None:
        self.run_ranks(_element_granularity_dp2)

    def test_whole_matrices_send_nothing_as_the_dry_run_says(self) -> None:
        self.run_ranks(_muon_granularity_dp2)


class TestMuonBytesDp2Tp2(DistributedTest):
    world_size = 4

    def test_tp_split_matrices_send_the_dry_runs_bytes_per_rank(self) -> None:
        self.run_ranks(_element_granularity_dp2_tp2)

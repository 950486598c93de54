"""The dry run's expert parallelism (``ep=``) without a process group: one ep rank's model, the all-to-all formula,
the command line and its errors. (Against a counted dp2 x ep2 run: ``tests/distributed/
test_dry_run_expert_parallel.py``.)"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from lightning_vescale.models import MoE, moe_config
from lightning_vescale.plan import PlanError, load_plan, resolve_plan
from lightning_vescale.plan.__main__ import main
from lightning_vescale.plan._dry_run import Workload, dry_run
from lightning_vescale.plan._hardware import load_profile
from lightning_vescale.plan._tensor_parallel import expert_groups, expert_parallel_bytes, expert_parallel_view

CONFIG = dataclasses.replace(moe_config("tiny"), vocab_size=64, dim=32, moe_hidden=32, shared_expert_hidden=32)


def _moe() -> MoE:
    with torch.device("meta"):
        return MoE(CONFIG)


def test_an_ep_rank_keeps_its_share_of_the_experts_in_groups_of_their_own():
    model = _moe()
    local, resolved = expert_parallel_view(model, resolve_plan(model, load_plan("moe")), 2)
    assert expert_groups(local) == {"layers.0.feed_forward.experts", "layers.1.feed_forward.experts"}
    assert local.layers[0].feed_forward.experts.w1_EDF.shape == (2, 32, 32)
    assert resolved.params["layers.1.feed_forward.experts.w2_EFD"].shape == (2, 32, 32)
    assert model.layers[0].feed_forward.experts.w1_EDF.shape == (4, 32, 32), "the caller's model is not changed"


def test_all_to_all_bytes_under_balanced_routing():
    # Per MoE layer and rank: 16 tokens x top 2 = 32 rows of 32 fp32 elements, half bound for the other ep rank, in
    # dispatch and combine, forward and backward; the counts: 4 int64, half sent.
    local, _ = expert_parallel_view(_moe(), resolve_plan(_moe(), load_plan("moe")), 2)
    sent, calls = expert_parallel_bytes(local, 2, 16, 4)
    assert sent == {"all_to_all_ep": 2 * 4 * 32 // 2 * 32 * 4, "all_to_all_ep_counts": 2 * 4 * 8 // 2}
    assert calls == {"all_to_all_ep": 2 * 4, "all_to_all_ep_counts": 2}
    # ep 4: three quarters leave; checkpointing runs the two forward ones (and the counts) again.
    sent4, calls4 = expert_parallel_bytes(local, 4, 16, 4, checkpointed=frozenset({"layers.0", "layers.1"}))
    assert sent4["all_to_all_ep"] == pytest.approx(sent["all_to_all_ep"] * 1.5 * 6 / 4) and calls4["all_to_all_ep"] == 12


def test_expert_groups_are_sharded_over_the_dp_ranks_only():
    model = _moe()
    resolved = resolve_plan(model, load_plan("moe"))
    workload = Workload(batch_size=2, seq_len=8, precision="32-true")
    run = dry_run(model, resolved, 8, expert_parallel=2, workload=workload, hardware=load_profile("cpu"), activations={})
    dp4 = dry_run(model, resolved, 4, workload=workload, hardware=load_profile("cpu"), activations={})
    experts = {g["group"]: g for g in run.groups if "experts" in g["group"]}
    assert run.mesh == "2-D (dp=4, ep=2)" and experts
    # An ep rank's half of the experts over the 4 dp ranks: the shard of one ep rank's stack over 4 ranks, which is
    # half the shard of the whole stack over 4 ranks (dp4 without ep).
    whole = {g["group"]: g for g in dp4.groups if "experts" in g["group"]}
    assert all(2 * g["shard_bytes"] == whole[name]["shard_bytes"] for name, g in experts.items())
    assert any("assume balanced routing" in n for n in run.notes)


def test_dry_run_cli_sizes_an_expert_parallel_mesh(capsys):
    assert main(["model=moe_tiny", "world_size=8", "ep=2"]) == 0
    out = capsys.readouterr().out
    assert "(ep=2 without plan=: using plan 'moe'" in out and "mesh: 2-D (dp=4, ep=2)" in out
    assert "all-to-all ep/step" in out and "assume balanced routing" in out
    assert main(["model=moe_tiny", "world_size=8"]) == 0
    assert "all-to-all ep" not in capsys.readouterr().out
    assert main(["model=deepseek_v3_tiny", "world_size=16", "ep=2", "tp=2"]) == 0  # its family's plan
    out = capsys.readouterr().out
    assert "(tp=2, ep=2 without plan=: using plan 'deepseek_v3'" in out and "mesh: 3-D (dp=4, ep=2, tp=2)" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["model=moe_tiny", "world_size=8", "ep=3"], r"ep=3 does not divide world_size / tp = 8 / 1"),
    (["model=moe_tiny", "world_size=8", "ep=8"], r"ep=8 does not divide the 4 experts of layers.0.feed_forward.experts"),
    (["model=moe_tiny", "world_size=8", "ep=2", "replicate=2"], r"HSDP x expert parallelism is not supported"),
    (["model=llama_tiny", "world_size=8", "ep=2", "plan=llama"], r"has no routed experts"),
])
def test_dry_run_ep_errors_name_the_fix(capsys, argv, message):
    assert main(argv) == 2
    assert re.search(message, capsys.readouterr().err)


def test_experts_not_in_a_group_of_their_own_are_refused():
    model = _moe()
    with pytest.raises(PlanError, match=r"layers.0.feed_forward.experts \(GroupedExperts\) is not a group of its own"):
        expert_parallel_view(model, resolve_plan(model, None), 2)


def test_ep_by_tp_groups_and_collectives():
    # (dp, ep, tp) = (2, 2, 2): the moe plan splits attention over tp and runs each feed-forward on 1/tp of the tokens.
    model = _moe()
    workload = Workload(batch_size=2, seq_len=8, precision="32-true", clip_grad=False)
    run = dry_run(model, resolve_plan(model, load_plan("moe")), 8, tensor_parallel=2, expert_parallel=2,
                  workload=workload, hardware=load_profile("cpu"), activations={})
    assert run.mesh == "3-D (dp=2, ep=2, tp=2)"
    groups = {g["group"]: g for g in run.groups}
    # The feed-forward a group of its own (router, shared experts) sharded over all 8 ranks, the experts over the 4
    # dp x tp ranks of an ep coordinate: their AllGathers send 7 / 3 shards; a block's attention over the 4 dp x ep.
    ff, experts, block = groups["layers.0.feed_forward"], groups["layers.0.feed_forward.experts"], groups["layers.0"]
    assert ff["all_gather_bytes"] == 2 * 7 * ff["shard_bytes"]
    assert experts["all_gather_bytes"] == 2 * 3 * experts["shard_bytes"]
    assert block["all_gather_bytes"] == 2 * 3 * block["shard_bytes"]
    c = run.vescale.collectives
    # split_tokens: the output gathered over tp forward and the input gradient backward, 16 tokens x dim 32 fp32, half
    # of each sent; per layer the all-to-alls on 8 tokens (1/tp), half of 8 x top 2 rows leaving.
    assert c["all_gather_tp"] == 2 * 2 * 16 * 32 * 4 / 2
    assert c["all_to_all_ep"] == 2 * 4 * 8 * 2 / 2 * 32 * 4
    assert c["all_reduce_tp"] == 2 * 16 * 32 * 4 * (1 + 3)  # wo forward, wq/wk/wv input gradients: 2 (tp-1)/tp = 1

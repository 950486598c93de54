"""Owner assignment for Muon (pure): Newton–Schulz cost, LPT determinism and balance, routing helpers."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn

from lightning_vescale.optim import (
    Muon,
    assign_owners,
    build_optimizer,
    muon_granularity,
    newton_schulz_cost,
    route_parameters,
)


def test_newton_schulz_cost_formula() -> None:
    # steps * s^2 * (2l + s) with s the short side, l the long side: orientation does not matter.
    assert newton_schulz_cost((3, 7), 5) == 5 * 9 * (14 + 3)
    assert newton_schulz_cost((7, 3), 5) == newton_schulz_cost((3, 7), 5)
    assert newton_schulz_cost((4, 4), 1) == 16 * 12
    assert newton_schulz_cost((4096, 14336)) == 5 * 4096**2 * (2 * 14336 + 4096)
    assert newton_schulz_cost((0, 9)) == 0.0
    # Matches the multiply-adds of torch's iteration on the short-side-first matrix X (s x l):
    # X Xᵀ (s·s·l), A·A (s·s·s), B·X (s·s·l) per step.
    short, long, steps = 5, 11, 3
    expected = steps * (short * short * long + short**3 + short * short * long)
    assert newton_schulz_cost((long, short), steps) == expected
    with pytest.raises(ValueError, match="matrices"):
        newton_schulz_cost((3, 4, 5))


def test_lpt_known_answer_and_ties() -> None:
    # Classic LPT: 7,6,5,4,3 on 2 ranks -> [7,4,3]=14? LPT gives 7->0, 6->1, 5->1 (6<7), 4->0, 3->1: 11 / 14.
    costs = {"a": 7.0, "b": 6.0, "c": 5.0, "d": 4.0, "e": 3.0}
    out = assign_owners(costs, 2)
    assert out.owners == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 0}
    assert out.loads == (14.0, 11.0)
    assert out.balance == pytest.approx(14.0 / 12.5)
    assert out.owned_by(1) == ["b", "c"]
    # Equal costs: by name, each to the least loaded rank, ties to the lowest rank.
    equal = assign_owners({"w3": 1.0, "w1": 1.0, "w2": 1.0, "w0": 1.0}, 3)
    assert equal.owners == {"w0": 0, "w1": 1, "w2": 2, "w3": 0}
    # Initial loads are filled around.
    seeded = assign_owners({"x": 2.0, "y": 1.0}, 3, initial_loads=[0.0, 5.0, 1.0])
    assert seeded.owners == {"x": 0, "y": 2} and seeded.loads == (2.0, 5.0, 2.0)
    assert assign_owners({}, 4).balance == 1.0
    with pytest.raises(ValueError, match="initial_loads"):
        assign_owners({"x": 1.0}, 2, initial_loads=[0.0])
    with pytest.raises(ValueError, match="finite"):
        assign_owners({"x": float("nan")}, 2)


def test_lpt_with_candidates() -> None:
    # Tensor parallelism: a matrix may only go to the ranks holding a piece of it (here the tp ranks of one dp
    # rank: {0, 1} or {2, 3}); among them, the least loaded. Matrices without candidates go anywhere, and the
    # ranks that took candidate-bound matrices are seen with their new load (no stale heap entry wins).
    costs = {"a": 8.0, "b": 8.0, "c": 4.0, "d": 4.0, "free": 3.0, "free2": 1.0}
    out = assign_owners(costs, 4, candidates={"a": [0, 1], "b": [0, 1], "c": [2, 3], "d": [0, 1]})
    assert out.owners == {"a": 0, "b": 1, "c": 2, "d": 0, "free": 3, "free2": 3}, out.owners
    assert out.loads == (12.0, 8.0, 4.0, 4.0)
    seeded = assign_owners({"x": 1.0}, 3, initial_loads=[0.0, 2.0, 1.0], candidates={"x": [1, 2]})
    assert seeded.owners == {"x": 2}
    with pytest.raises(ValueError, match="non-empty list of ranks"):
        assign_owners({"x": 1.0}, 2, candidates={"x": [2]})
    with pytest.raises(ValueError, match="not in costs"):
        assign_owners({"x": 1.0}, 2, candidates={"y": [0]})


def test_lpt_deterministic_and_balanced() -> None:
    # A Llama-like stack: 16 layers of 7 matrices; insertion order must not matter.
    dim, hidden, kv = 512, 1376, 128
    shapes = {"wq": (dim, dim), "wk": (kv, dim), "wv": (kv, dim), "wo": (dim, dim),
              "w1": (hidden, dim), "w2": (dim, hidden), "w3": (hidden, dim)}
    costs = {f"layers.{i}.{n}": newton_schulz_cost(s) for i in range(16) for n, s in shapes.items()}
    items = list(costs.items())
    first = assign_owners(costs, 8)
    for seed in range(5):
        random.Random(seed).shuffle(items)
        again = assign_owners(dict(items), 8)
        assert again.owners == first.owners and again.loads == first.loads
    for n in (2, 3, 4, 8):
        out = assign_owners(costs, n)
        assert sum(out.loads) == pytest.approx(sum(costs.values()))
        assert out.balance <= 1.05, (n, out.balance)
        # LPT bound: max load <= mean + largest job.
        assert max(out.loads) <= sum(costs.values()) / n + max(costs.values())
    # Far fewer matrices than ranks: some ranks idle, balance reported honestly.
    few = assign_owners({"a": 1.0, "b": 1.0}, 4)
    assert few.balance == pytest.approx(2.0)


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(11, 6)
        self.proj = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.experts = nn.Module()
        self.experts.w1 = nn.Parameter(torch.randn(3, 6, 4))
        self.blob = nn.Parameter(torch.randn(2, 3, 4))
        self.head = nn.Linear(6, 11, bias=False)
        self.frozen = nn.Parameter(torch.randn(3, 3), requires_grad=False)


def test_routing_and_granularity() -> None:
    model = _Toy()
    routes = route_parameters(model)
    muon = [n for n, _ in routes["muon"]]
    adamw = [n for n, _ in routes["adamw"]]
    assert muon == ["proj.weight", "experts.w1"]
    assert adamw == ["blob", "tok.weight", "proj.bias", "norm.weight", "norm.bias", "head.weight"]  # direct params first
    # Overrides by name.
    routes = route_parameters(model, muon_patterns=["head.*"], adamw_patterns=["proj.weight"])
    assert [n for n, _ in routes["muon"]] == ["experts.w1", "head.weight"]
    with pytest.raises(ValueError, match="both"):
        route_parameters(model, muon_patterns=["proj.*"], adamw_patterns=["proj.weight"])
    gran = muon_granularity(model)
    by_name = dict(model.named_parameters())
    assert gran("proj.weight", by_name["proj.weight"]) == "matrix"
    assert gran("w1", by_name["experts.w1"]) == "matrix"  # each expert whole; the full name is found from the parameter
    assert gran("tok.weight", by_name["tok.weight"]) == "element"
    assert gran("norm.weight", by_name["norm.weight"]) == "element"


def test_muon_rejects_what_it_cannot_orthogonalize() -> None:
    model = _Toy()
    with pytest.raises(ValueError, match=r"norm\.weight.*adamw_patterns"):
        Muon([("proj.weight", model.proj.weight), ("norm.weight", model.norm.weight)])
    with pytest.raises(ValueError, match=r"3-D parameter blob .*expert"):
        Muon([("blob", model.blob)])
    Muon([("blob", model.blob)], expert_patterns=["blob"])
    model.blob._vescale_expert_stack = True
    Muon([("blob", model.blob)])
    with pytest.raises(ValueError, match="mode"):
        Muon([model.proj.weight], mode="everywhere")
    # build_optimizer: one optimizer with both kinds; routed 3-D undeclared tensors go to AdamW.
    opt = build_optimizer(_Toy(), lr=1e-3)
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert opt.param_groups[0]["param_names"] == ["proj.weight", "experts.w1"]


def test_auto_mode_cost_model_moves_whole_matrices_only_when_it_pays() -> None:
    """``mode="auto"``: matrices the planner put whole on rank 0 move to rank 1 only if NS time dominates."""
    from lightning_vescale.optim.muon import MuonCostModel, _Bucket, _Matrix

    def bucket_all_on_rank0():
        group = {"mode": "auto"}
        shapes = [(64, 64)] * 4
        ms = [_Matrix(f"m{i}", i, s, newton_schulz_cost(s), [(0, s[0] * s[1]), (0, 0)], (0, s[0] * s[1]), group,
                      holder=0) for i, s in enumerate(shapes)]
        return _Bucket(None, 0, 2, torch.device("cpu"), matrices=list(ms)), ms

    opt = Muon([torch.zeros(2, 2)])
    opt.cost_model = MuonCostModel(flops_per_second=1e9, bytes_per_second=1e12)  # NS slow, links fast
    bucket, ms = bucket_all_on_rank0()
    loads = opt._assign(bucket)
    assert sorted(m.mode for m in ms) == ["gather", "gather", "local", "local"]
    assert loads[0] == loads[1]
    bucket.layout()
    assert bucket.bytes_sent() == (2 * 64 * 64 * 2, 0)  # rank 0 ships two matrices in bf16, gets them back
    opt.cost_model = MuonCostModel(flops_per_second=1e15, bytes_per_second=1e6)  # NS fast, links slow
    bucket, ms = bucket_all_on_rank0()
    opt._assign(bucket)
    assert all(m.mode == "local" and m.owner == 0 for m in ms) and bucket.matrices == []


def test_muon_on_plain_tensors_is_torch_muon() -> None:
    """Unsharded (replicated) tensors: every rank orthogonalizes them itself, bitwise torch.optim.Muon."""
    torch.manual_seed(0)
    shapes = [(7, 5), (5, 9), (1, 4)]
    mine = [nn.Parameter(torch.randn(s)) for s in shapes]
    ref = [nn.Parameter(p.detach().clone()) for p in mine]
    opt = Muon(mine, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", nesterov=False)
    ref_opt = torch.optim.Muon(ref, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", nesterov=False)
    for _ in range(3):
        for a, b in zip(mine, ref):
            a.grad = torch.randn(a.shape)
            b.grad = a.grad.clone()
        opt.step()
        ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(mine, ref))
    assert opt.plan_report()["modes"] == {"replicated": 3}

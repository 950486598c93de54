"""Planner: invariants on random groups, determinism, bounds, optimality against brute force, errors.

The checks here recompute everything from ``piece``/``local_offset``/``offsets`` independently of
``BufferPlan.validate`` (which is also called), so a bug in ``validate`` cannot hide a bad plan.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lightning_vescale.engine.planner as planner
from lightning_vescale.engine.planner import (
    BufferPlan,
    TensorSpec,
    granularity_numel,
    plan_buffer,
    shard_size_lower_bound,
)

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True, database=None)


# -- helpers ----------------------------------------------------------------------------------------

def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)

def make_spec(name: str, shape: tuple, granularity, cost: float = 0.0) -> TensorSpec:
    return TensorSpec.from_granularity(name, shape, granularity, cost)


def is_edge(spec: TensorSpec, x: int) -> bool:
    """Whether a cut x elements into the tensor is allowed: granules of g restart every period."""
    return x % spec.period % spec.granularity == 0


@st.composite
def groups(draw, max_tensors: int = 7, max_dim: int = 9):
    """A list of TensorSpecs with mixed ranks, zero-size tensors and every kind of granularity, including
    blocks of rows that do not divide the rows (a shorter last block, per matrix of a 3-D stack)."""
    specs = []
    for i in range(draw(st.integers(0, max_tensors))):
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.integers(0, max_dim)) for _ in range(ndim))
        kinds = ["element", "row", "matrix", "tensor"] + list(range(1, max_dim + 2))
        gran = draw(st.sampled_from(kinds))
        cost = draw(st.sampled_from([0.0, 0.0, float(math.prod(shape))]))
        specs.append(make_spec(f"layers.{i}.w", shape, gran, cost))
    return specs


@st.composite
def moe_groups(draw):
    """Many copies of a few expert shapes (the classes the greedy fills work on) plus small vectors."""
    specs = []
    for t in range(draw(st.integers(1, 3))):
        rows, cols = draw(st.integers(1, 64)), draw(st.integers(1, 64))
        gran = draw(st.sampled_from(["row", "matrix", "tensor", 2, 4, 8, 16]))
        if draw(st.booleans()):  # one fused (E, rows, cols) stack instead of E matrices
            specs.append(make_spec(f"experts.w{t}", (draw(st.integers(1, 40)), rows, cols), gran))
            continue
        for e in range(draw(st.integers(1, 40))):
            specs.append(make_spec(f"experts.{e}.w{t}", (rows, cols), gran))
    for v in range(draw(st.integers(0, 3))):
        specs.append(make_spec(f"norm{v}", (draw(st.integers(1, 64)),), "element"))
    return specs


def check_plan(plan: BufferPlan, specs: list[TensorSpec], world_size: int, alignment: int) -> None:
    """Every invariant of DESIGN.md's planner problem, recomputed from the public lookups."""
    plan.validate()
    N, S = plan.world_size, plan.shard_size
    assert world_size == N and plan.alignment == alignment
    assert sorted(plan.specs, key=lambda s: s.name) == sorted(specs, key=lambda s: s.name)
    assert S % alignment == 0 and S >= 0
    total = sum(s.numel for s in specs)
    assert plan.total_numel == total and plan.padding == N * S - total >= 0
    assert -(-total // N) <= S
    spans = []
    for i, spec in enumerate(plan.specs):
        assert plan.index_of(spec.name) == i
        off, e = plan.offsets[i], spec.numel
        if e == 0:
            assert all(plan.piece(i, r) == (0, 0) for r in range(N))
            continue
        assert off % alignment == 0 and off >= 0 and off + e <= N * S
        spans.append((off, off + e))
        # The nonempty pieces, in rank order, tile [0, e) exactly once; inner cuts are granule edges.
        cursor = 0
        for r, (lo, hi) in enumerate(plan.pieces(i)):
            if lo == hi:
                continue
            assert lo == cursor, (spec.name, r, lo, cursor)
            assert is_edge(spec, lo), f"{spec.name}: rank {r} starts inside a granule at {lo}"
            # The piece sits in rank r's shard, at local_offset.
            local = plan.local_offset(i, r)
            assert off + lo == r * S + local and local >= 0 and local + (hi - lo) <= S
            cursor = hi
        assert cursor == e, (spec.name, cursor, e)
    spans.sort()
    for (_, hi), (lo, _) in zip(spans, spans[1:]):
        assert hi <= lo, "tensors overlap in the buffer"
    # Per rank: local pieces are disjoint and fit in S.
    for r in range(N):
        local = sorted((plan.local_offset(i, r), plan.piece(i, r)[1] - plan.piece(i, r)[0])
                       for i in range(len(plan.specs)) if plan.piece(i, r)[1] > plan.piece(i, r)[0])
        for (a_off, a_len), (b_off, _) in zip(local, local[1:]):
            assert a_off + a_len <= b_off
        assert sum(n for _, n in local) <= S


# -- brute force ------------------------------------------------------------------------------------
def _first_bad_boundary(start: int, e: int, g: int, P: int, S: int, N: int):
    """The first rank boundary strictly inside [start, start + e) that is not a granule edge, or None."""
    return next((k * S for k in range(start // S + 1, N) if k * S < start + e and (k * S - start) % P % g), None)


def _fits_in_order(order: tuple, S: int, N: int, a: int) -> bool:
    """Earliest placement, one aligned offset at a time (optimal for a fixed order)."""
    c = 0
    for e, g, P in order:
        start = -(-c // a) * a
        while start + e <= N * S and _first_bad_boundary(start, e, g, P, S, N) is not None:
            start += a
        if start + e > N * S:
            return False
        c = start + e
    return True


def brute_force_shard_size(specs: list[TensorSpec], N: int, a: int) -> int:
    """The optimal S: every order, every aligned S from ceil(total / N) upward."""
    items = [(s.numel, s.granularity, s.period) for s in specs if s.numel]
    if not items:
        return 0
    S = max(a, _ceil_div(_ceil_div(sum(e for e, _, _ in items), N), a) * a)
    orders = sorted(set(itertools.permutations(items)))
    while not any(_fits_in_order(o, S, N, a) for o in orders):
        S += a
    return S


def random_small_case(rng: random.Random) -> tuple[list[TensorSpec], int, int]:
    specs = []
    for i in range(rng.randint(2, 4)):
        shape = tuple(rng.randint(1, 8) for _ in range(rng.randint(1, 3)))
        kinds = ["element", "row", "matrix", "tensor", 2, 3, 5]
        specs.append(make_spec(f"t{i}", shape, rng.choice(kinds)))
    return specs, rng.randint(2, 6), rng.choice([1, 1, 2, 3])


# -- invariants -------------------------------------------------------------------------------------
@settings(max_examples=200, **SETTINGS)
@given(specs=groups(), world_size=st.integers(1, 9), alignment=st.sampled_from([1, 1, 2, 3, 4, 8]))
def test_random_plans_satisfy_invariants(specs, world_size, alignment):
    plan = plan_buffer(specs, world_size, alignment=alignment)
    check_plan(plan, specs, world_size, alignment)
    assert plan.shard_size >= shard_size_lower_bound(specs, world_size, alignment=alignment)


@settings(max_examples=80, **SETTINGS)
@given(specs=groups(max_tensors=24, max_dim=40), world_size=st.integers(2, 64),
       alignment=st.sampled_from([1, 4, 16]))
def test_larger_random_plans_satisfy_invariants(specs, world_size, alignment):
    plan = plan_buffer(specs, world_size, alignment=alignment)
    check_plan(plan, specs, world_size, alignment)


@settings(max_examples=80, **SETTINGS)
@given(specs=moe_groups(), world_size=st.integers(2, 128), alignment=st.sampled_from([1, 8]))
def test_expert_groups_satisfy_invariants(specs, world_size, alignment):
    plan = plan_buffer(specs, world_size, alignment=alignment)
    check_plan(plan, specs, world_size, alignment)
    assert plan.shard_size >= shard_size_lower_bound(specs, world_size, alignment=alignment)


@settings(max_examples=100, **SETTINGS)
@given(specs=groups(), world_size=st.integers(1, 9))
def test_element_granularity_padding_is_below_world_size(specs, world_size):
    specs = [TensorSpec(s.name, s.shape, 1) for s in specs]
    plan = plan_buffer(specs, world_size)
    total = sum(s.numel for s in specs)
    assert plan.shard_size == -(-total // world_size)
    assert plan.padding < world_size


def test_zero_size_tensors_and_all_empty_group():
    specs = [make_spec("a", (0, 4), "row"), make_spec("b", (3, 4), "row"), make_spec("c", (0,), "element")]
    plan = plan_buffer(specs, 4)
    check_plan(plan, specs, 4, 1)
    empty = [make_spec("x", (0, 5), "row"), make_spec("y", (0,), "tensor")]
    plan = plan_buffer(empty, 3, alignment=4)
    check_plan(plan, empty, 3, 4)
    assert plan.shard_size == 0 and plan.padding == 0
    assert plan_buffer([], 2).shard_size == 0


def test_whole_tensors_fewer_than_ranks_leave_ranks_empty():
    specs = [make_spec(f"w{i}", (8, 4 + i), "tensor") for i in range(3)]
    plan = plan_buffer(specs, 8)
    check_plan(plan, specs, 8, 1)
    for i in range(3):
        owners = [r for r, (lo, hi) in enumerate(plan.pieces(i)) if hi > lo]
        assert len(owners) == 1, "a whole-tensor granule must stay on one rank"
    assert plan.shard_size == max(s.numel for s in specs)
    assert sum(1 for r in range(8) if all(plan.piece(i, r)[1] == 0 for i in range(3))) >= 5


# -- determinism ------------------------------------------------------------------------------------
@settings(max_examples=60, **SETTINGS)
@given(specs=groups(), world_size=st.integers(1, 9), alignment=st.sampled_from([1, 2, 4]))
def test_same_input_same_plan(specs, world_size, alignment):
    a = plan_buffer(specs, world_size, alignment=alignment)
    rebuilt = [TensorSpec(s.name, tuple(s.shape), s.granularity, s.cost, s.period) for s in specs]
    b = plan_buffer(rebuilt, world_size, alignment=alignment)
    assert a.fingerprint() == b.fingerprint()
    assert (a.offsets, a.specs, a.shard_size) == (b.offsets, b.specs, b.shard_size)
    # A permuted list may give another layout; it must still be a valid one.
    c = plan_buffer(list(reversed(specs)), world_size, alignment=alignment)
    check_plan(c, specs, world_size, alignment)


def _fingerprints_script() -> str:
    return (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('planner', {planner.__file__!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['planner'] = m; spec.loader.exec_module(m)\n"
        "specs = [m.TensorSpec(f'experts.{i}.w{j}', (64 + 16 * j, 96), 16 * 96 if j else 1, float(i))\n"
        "         for i in range(12) for j in range(3)] + [m.TensorSpec('norm', (96,), 1)]\n"
        "print(','.join(m.plan_buffer(specs, n, alignment=4).fingerprint() for n in (3, 8, 13)))\n"
    )


def test_plan_does_not_depend_on_hash_seed():
    script = _fingerprints_script()
    outs = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                check=True).stdout.strip())
    specs = [TensorSpec(f"experts.{i}.w{j}", (64 + 16 * j, 96), 16 * 96 if j else 1, float(i))
             for i in range(12) for j in range(3)] + [TensorSpec("norm", (96,), 1)]
    here = ",".join(plan_buffer(specs, n, alignment=4).fingerprint() for n in (3, 8, 13))
    assert outs == {here}, (outs, here)


# -- bounds and optimality --------------------------------------------------------------------------
def test_lower_bound_forces_granularity_of_long_tensors():
    # A tensor longer than 2S holds two boundaries, so its granularity must divide S.
    specs = [make_spec("down", (64, 14), "row"), make_spec("gate", (14, 64), "row")]
    plan = plan_buffer(specs, 16)
    lb = shard_size_lower_bound(specs, 16)
    assert lb % 14 == 0 and lb % 64 == 0 and plan.shard_size == lb
    check_plan(plan, specs, 16, 1)


def test_brute_force_optimality():
    """The planner's S against the exhaustive optimum on small groups, with and without its
    exhaustive-order and exact stages (groups of <= 5 tensors try every order, small groups every S exactly; the
    heuristic alone is below)."""
    rng = random.Random(2024)
    cases = [random_small_case(rng) for _ in range(400)]
    optimum = [brute_force_shard_size(specs, N, a) for specs, N, a in cases]
    report = {}
    for label, limit in (("heuristic only", 0), ("with exhaustive orders", planner._EXHAUSTIVE_MAX_TENSORS)):
        old, old_exact = planner._EXHAUSTIVE_MAX_TENSORS, planner._EXACT_MAX_STATES
        planner._EXHAUSTIVE_MAX_TENSORS = limit
        planner._EXACT_MAX_STATES = old_exact if limit else 0
        try:
            ratios = []
            for (specs, N, a), opt in zip(cases, optimum):
                plan = plan_buffer(specs, N, alignment=a)
                check_plan(plan, specs, N, a)
                assert plan.shard_size >= opt >= shard_size_lower_bound(specs, N, alignment=a)
                ratios.append(plan.shard_size / opt)
        finally:
            planner._EXHAUSTIVE_MAX_TENSORS, planner._EXACT_MAX_STATES = old, old_exact
        report[label] = (sum(r == 1 for r in ratios) / len(ratios), max(ratios))
    print("\nplanner vs brute force on 400 groups of 2-4 tensors, N in 2..6: "
          + "; ".join(f"{k}: optimal {rate:.1%}, worst S/S_opt {worst:.3f}" for k, (rate, worst) in report.items()))
    rate, worst = report["heuristic only"]
    assert rate >= 0.9 and worst <= 1.25, report
    rate, worst = report["with exhaustive orders"]
    assert rate == 1.0 and worst == 1.0, report


@settings(max_examples=100, **SETTINGS)
@given(data=st.data())
def test_heuristic_within_factor_of_optimum(data):
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1)))
    specs, N, a = random_small_case(rng)
    old, old_exact = planner._EXHAUSTIVE_MAX_TENSORS, planner._EXACT_MAX_STATES
    planner._EXHAUSTIVE_MAX_TENSORS = planner._EXACT_MAX_STATES = 0
    try:
        S = plan_buffer(specs, N, alignment=a).shard_size
    finally:
        planner._EXHAUSTIVE_MAX_TENSORS, planner._EXACT_MAX_STATES = old, old_exact
    opt = brute_force_shard_size(specs, N, a)
    assert shard_size_lower_bound(specs, N, alignment=a) <= opt <= S <= 1.25 * opt


def _orders_optimum(specs: list[TensorSpec], N: int, a: int, upto: int) -> int:
    """The optimal S below ``upto`` (else ``upto``): every distinct order, placed at earliest offsets (optimal for an
    order), at every size the bound's conditions allow, upward from the bound. Faster than brute_force_shard_size
    (one formula per tensor instead of one offset at a time) for groups of real layers' sizes."""
    items = [planner._Item(i, s, a) for i, s in enumerate(specs) if s.numel]
    orders = sorted(set(itertools.permutations([(it.e, it.g, it.L, it.P) for it in items])))
    valid = planner._ValidSizes(items, a)
    S = shard_size_lower_bound(specs, N, alignment=a)
    while upto > S:
        for order in orders:
            c = 0
            for e, g, L, P in order:
                off = planner._earliest_offset(c, e, g, L, S, a, P)
                if off is None or off + e > N * S:
                    break
                c = off + e
            else:
                return S
        S = valid.next(S + a)
    return upto


@settings(max_examples=60, **SETTINGS)
@given(data=st.data())
def test_small_groups_reach_the_brute_force_optimum(data):
    """With the exact stage, small groups (2-4 tensors of any granularity, restarting granules included) get the
    optimum the brute force finds, on 2-8 ranks."""
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1)))
    specs, _, a = random_small_case(rng)
    N = rng.randint(2, 8)
    plan = plan_buffer(specs, N, alignment=a)
    check_plan(plan, specs, N, a)
    assert plan.shard_size == brute_force_shard_size(specs, N, a)


# Quantized layers where the heuristic alone missed the optimum (4.01% padding against 1.16% on 2 ranks, the
# quant_tiles test model; 4% against 0 for a Llama layer at 128-row bands): (name, shape, granule, period).
_TILES = [("a", (300, 256), 32768, 76800), ("b", (200, 384), 49152, 76800), ("c", (257, 130), 16640, 33410),
          ("d", (128, 128), 16384, 0), ("stack", (3, 200, 130), 16640, 26000)]
_LLAMA = [("wq", (256, 256), 32768, 0), ("wk", (64, 256), 16384, 0), ("wv", (64, 256), 16384, 0),
          ("wo", (256, 256), 32768, 0), ("w1", (320, 256), 32768, 81920), ("w2", (256, 320), 40960, 0),
          ("w3", (320, 256), 32768, 81920)]


@pytest.mark.parametrize("N", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("group", [_TILES, _LLAMA], ids=["tiles", "llama"])
def test_quantized_layers_reach_the_optimum_over_every_order(group, N):
    specs = [TensorSpec(n, s, g, 0.0, p) for n, s, g, p in group]
    plan = plan_buffer(specs, N, alignment=4)
    check_plan(plan, specs, N, 4)
    assert plan.shard_size == _orders_optimum(specs, N, 4, plan.shard_size + 4)
    old = planner._EXACT_MAX_STATES
    planner._EXACT_MAX_STATES = 0
    try:
        heuristic = plan_buffer(specs, N, alignment=4).shard_size
    finally:
        planner._EXACT_MAX_STATES = old
    if (group, N) in ((_TILES, 2), (_LLAMA, 2)):
        assert heuristic > plan.shard_size  # the cases the exact stage is for


# -- cost balance -----------------------------------------------------------------------------------
@settings(max_examples=40, **SETTINGS)
@given(specs=groups(max_tensors=10), world_size=st.integers(2, 8))
def test_cost_only_breaks_ties(specs, world_size):
    costed = [TensorSpec(s.name, s.shape, s.granularity, float(s.numel) ** 1.5, s.period) for s in specs]
    free = [TensorSpec(s.name, s.shape, s.granularity, 0.0, s.period) for s in specs]
    with_cost, without = plan_buffer(costed, world_size), plan_buffer(free, world_size)
    assert with_cost.shard_size == without.shard_size
    check_plan(with_cost, costed, world_size, 1)
    same_layout = BufferPlan(tuple(c for s in without.specs for c in costed if c.name == s.name),
                             without.offsets, world_size, without.shard_size)
    assert max(with_cost.rank_costs()) <= max(same_layout.rank_costs()) + 1e-6


def test_whole_matrices_are_balanced_on_cost():
    # Muon-style: whole matrices, cost ~ s^2 (2l + s); 8 equal matrices on 4 ranks -> 2 each.
    specs = [make_spec(f"m{i}", (16, 16), "tensor", cost=16.0**3 * 3) for i in range(8)]
    plan = plan_buffer(specs, 4)
    check_plan(plan, specs, 4, 1)
    assert plan.padding == 0
    assert plan.summary()["cost_imbalance"] == pytest.approx(1.0)


# -- realistic groups -------------------------------------------------------------------------------
def _llama_layer(hidden: int, kv: int, ffn: int, gran) -> list[TensorSpec]:
    shapes = [("q", (hidden, hidden)), ("k", (kv, hidden)), ("v", (kv, hidden)), ("o", (hidden, hidden)),
              ("gate", (ffn, hidden)), ("up", (ffn, hidden)), ("down", (hidden, ffn)),
              ("norm1", (hidden,)), ("norm2", (hidden,))]
    return [make_spec(n, s, gran) for n, s in shapes]


def test_llama8b_layer_reaches_the_lower_bound():
    for N in (8, 64, 512):
        specs = _llama_layer(4096, 1024, 14336, "row")
        t0 = time.perf_counter()
        plan = plan_buffer(specs, N)
        assert time.perf_counter() - t0 < 1.0  # the benchmark measures < 0.1 s; loose here (shared CPU)
        assert plan.shard_size == shard_size_lower_bound(specs, N)
        assert plan.padding_ratio < 0.01
        check_plan(plan, specs, N, 1)


def test_llama70b_layer_padding_is_forced_by_granule_lcm():
    # gate/up (row = 8192) and down (row = 28672) are longer than 2S, so S is a multiple of
    # lcm(8192, 28672) = 57344 and ceil(total / 512) = 1671200 rounds up to 30 * 57344 (2.94%).
    specs = _llama_layer(8192, 1024, 28672, "row")
    plan = plan_buffer(specs, 512)
    assert plan.shard_size == shard_size_lower_bound(specs, 512) == 30 * 57344
    check_plan(plan, specs, 512, 1)


def test_moe_layer_with_many_experts_pads_little():
    specs = [make_spec("attn.o", (512, 2048), "row"), make_spec("norm", (512,), "element")]
    for e in range(64):
        specs += [make_spec(f"experts.{e}.gate", (256, 512), 16), make_spec(f"experts.{e}.down", (512, 256), 16)]
    plan = plan_buffer(specs, 48, alignment=8)
    check_plan(plan, specs, 48, 8)
    assert plan.padding_ratio < 0.01


# -- granularity meanings ---------------------------------------------------------------------------
def test_granule_per_matrix():
    """(granularity_numel, period) for every kind, on a vector, a matrix, an expert stack and a conv weight."""
    cases = {
        ((10,), "element"): (1, 10), ((10,), "row"): (1, 10), ((10,), 128): (1, 10), ((10,), "matrix"): (1, 10),
        ((10,), "tensor"): (10, 10),
        ((576, 7), "row"): (7, 4032), ((576, 7), 128): (128 * 7, 4032), ((8, 7), 128): (56, 56),
        ((576, 7), "matrix"): (4032, 4032), ((576, 7), "tensor"): (4032, 4032),
        # (E, rows, cols): a row of an expert matrix, k rows of each expert, one whole expert.
        ((4, 6, 5), "row"): (5, 30), ((4, 6, 5), 4): (20, 30), ((4, 6, 5), 16): (30, 30),
        ((4, 6, 5), "matrix"): (30, 30), ((4, 6, 5), "tensor"): (120, 120), ((4, 6, 5), "element"): (1, 120),
        ((3, 2, 2, 2), "row"): (8, 24), ((0, 7), "row"): (1, 0), ((0, 5, 3), 2): (1, 0),
    }
    for (shape, gran), expected in cases.items():
        assert planner.granule(shape, gran) == expected, (shape, gran)
        assert granularity_numel(shape, gran) == expected[0]


def test_spec_normalizes_uniform_granules():
    # Blocks that divide the matrix repeat uniformly over the whole stack: one period, the tensor.
    assert make_spec("w", (4, 6, 5), 3).period == 120 and make_spec("w", (4, 6, 5), "row").period == 120
    # A shorter last block per expert keeps the per-expert period; a 2-D tensor has one period.
    assert (make_spec("w", (4, 6, 5), 4).granularity, make_spec("w", (4, 6, 5), 4).period) == (20, 30)
    assert make_spec("w", (576, 7), 128).period == 4032
    # A granule longer than the period is the period (a block of more rows than the matrix has).
    assert TensorSpec("w", (8, 7), 128 * 7).granularity == 56


def test_shorter_last_block_of_rows():
    """576 rows in blocks of 128: cuts only every 128 rows; the last block (64 rows) stays whole."""
    spec = make_spec("kv_a", (576, 4), 128)
    for N in (2, 3, 4, 5, 8):
        plan = plan_buffer([spec], N)
        check_plan(plan, [spec], N, 1)
        cuts = {lo for lo, hi in plan.pieces(0) if hi > lo}
        assert cuts <= {r * 128 * 4 for r in range(5)}, (N, cuts)
    assert plan_buffer([spec], 5).shard_size == 128 * 4  # 5 blocks of 128 rows (the last one 64) on 5 ranks


def test_expert_stack_blocks_restart_at_every_expert():
    """(E=3, rows=6, cols=2) in blocks of 4 rows: per expert, blocks [0, 4) and [4, 6); never 4 rows across
    two experts. A cut at row 8 of the stack (row 2 of expert 1) would split a block."""
    spec = make_spec("experts.w", (3, 6, 2), 4)
    edges = {r * 2 for e in range(3) for r in (6 * e, 6 * e + 4)} | {36}
    for N in range(2, 7):
        for a in (1, 2, 4):
            plan = plan_buffer([spec], N, alignment=a)
            check_plan(plan, [spec], N, a)
            assert {lo for lo, hi in plan.pieces(0) if hi > lo} <= edges
            assert plan.shard_size == brute_force_shard_size([spec], N, a)
    with pytest.raises(AssertionError, match=r"cuts experts.w inside a granule of 8 \(granules restart every 12\)"):
        BufferPlan((spec,), (0,), world_size=3, shard_size=16)  # a cut at 16: row 2 of expert 1


def test_periodic_lower_bound_is_sound():
    """Restarting granules on many ranks: every S the brute force finds passes the bound's conditions."""
    rng = random.Random(7)
    for _ in range(150):
        E, rows, cols = rng.randint(2, 6), rng.randint(3, 9), rng.randint(1, 3)
        k = rng.choice([d for d in range(2, rows) if rows % d] or [rows])
        specs = [make_spec("experts.w", (E, rows, cols), k)]
        if rng.random() < 0.5:
            specs.append(make_spec("norm", (rng.randint(1, 9),), "element"))
        N, a = rng.randint(2, 7), rng.choice([1, 2])
        opt = brute_force_shard_size(specs, N, a)
        plan = plan_buffer(specs, N, alignment=a)
        check_plan(plan, specs, N, a)
        assert shard_size_lower_bound(specs, N, alignment=a) <= opt <= plan.shard_size
        assert plan.shard_size == opt, (specs, N, a)


# -- errors and the negative control ----------------------------------------------------------------
def test_errors_name_the_problem():
    for bad in ("block", 0, -128, 2.0, True):
        with pytest.raises(ValueError, match=r"unknown granularity .*'element', 'row', 'matrix', 'tensor'"):
            granularity_numel((6, 4), bad)
    with pytest.raises(ValueError, match="period 5 does not divide numel 24"):
        TensorSpec("w", (6, 4), 4, period=5)
    with pytest.raises(ValueError, match="granularity must be >= 1"):
        TensorSpec("w", (6, 4), 0)
    with pytest.raises(ValueError, match="negative dimension"):
        TensorSpec("w", (-6, 4), 1)
    specs = [make_spec("w", (6, 4), "row")]
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="world_size must be an int >= 1"):
            plan_buffer(specs, bad)
    with pytest.raises(ValueError, match="alignment must be an int >= 1"):
        plan_buffer(specs, 2, alignment=0)
    with pytest.raises(ValueError, match=r"unique, got duplicates \['w'\]"):
        plan_buffer(specs + [make_spec("w", (2,), "element"), make_spec("v", (2,), "element")], 2)


def test_validate_catches_hand_made_bad_plans():
    w = TensorSpec("w", (4, 4), 4)  # rows of 4 elements
    # Rank boundary 8 falls 6 elements into w (offset 2): inside a row.
    with pytest.raises(AssertionError, match="rank boundary 8 cuts w inside a granule of 4"):
        BufferPlan((w,), (2,), world_size=3, shard_size=8)
    BufferPlan((w,), (4,), world_size=3, shard_size=8)  # the same layout moved by one row is fine
    v = TensorSpec("v", (4,), 1)
    with pytest.raises(AssertionError, match="overlaps"):
        BufferPlan((w, v), (0, 10), world_size=2, shard_size=16)
    with pytest.raises(AssertionError, match="past the buffer"):
        BufferPlan((w,), (4,), world_size=2, shard_size=8)
    with pytest.raises(AssertionError, match="misaligned"):
        BufferPlan((w,), (2,), world_size=1, shard_size=20, alignment=2 * 2 * 5)


# -- reporting and API ------------------------------------------------------------------------------
def test_summary_costs_and_positional_construction():
    specs = [make_spec(f"m{i}", (4, 4 * (i + 1)), "tensor", cost=float(i + 1)) for i in range(5)]
    plan = plan_buffer(specs, 3, alignment=4)
    summary = plan.summary()
    assert summary["padding"] == plan.padding and summary["shard_size"] == plan.shard_size
    assert sum(plan.rank_costs()) == pytest.approx(15.0)
    assert summary["max_rank_cost"] == max(plan.rank_costs()) and summary["strategy"] == plan.strategy
    # The DBuffer engine builds plans positionally; the strategy label is not part of the fingerprint.
    same = BufferPlan(plan.specs, plan.offsets, plan.world_size, plan.shard_size, plan.alignment)
    assert same.fingerprint() == plan.fingerprint() and same == plan

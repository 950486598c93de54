"""Granularity on shapes real checkpoints have, on 3 gloo ranks shared by one class of tests
(:class:`tests.dist_pool.DistributedTest`), one test per behaviour; training compared with one process to 1e-5.

* Blocks of 16 rows on matrices whose rows 16 does not divide (a 36-row projection: blocks of 16, 16, 4; a
  4-row router: one block) and on ``(E, rows, cols)`` expert stacks, where the blocks restart at every expert
  (20 rows: 16 + 4 per expert); 1-D tensors stay element-granular. Every cut, read from the public
  ``p.layout_info.ranges``, is checked against the per-matrix definition, and training equals one process.
* ``"matrix"``: every expert matrix of a stack whole on one rank.
* Glob mappings: a glob that matches no parameter is an error naming it (at the first forward for a mapping
  given to ``fully_shard``, at once for ``granularity_by_pattern``: that check and the names it resolves need no
  ranks, they run in the test process).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import lightning_vescale as lv
from lightning_vescale.engine.fully_shard import granularity_by_pattern
from tests.dist_pool import DistributedTest


class ExpertBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(8))
        self.router = nn.Linear(8, 4)  # (4, 8): fewer rows than one block
        self.kv = nn.Linear(8, 36, bias=False)  # (36, 8): blocks of 16, 16 and 4 rows
        self.back = nn.Linear(36, 8)
        self.experts = nn.Module()
        self.experts.w1 = nn.Parameter(torch.randn(3, 8, 20) * 0.3)  # (E, in, out): 8 rows per expert
        self.experts.w2 = nn.Parameter(torch.randn(3, 20, 8) * 0.3)  # 20 rows per expert: 16 + 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.norm
        gates = F.softmax(self.router(h), dim=-1)
        y = sum(gates[:, e : e + 1] * (F.silu(h @ self.experts.w1[e]) @ self.experts.w2[e]) for e in range(3))
        return x + y + self.back(F.silu(self.kv(h)))


class ExpertNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ExpertBlock() for _ in range(2))
        self.head = nn.Linear(8, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def shard(model: ExpertNet, granularity) -> ExpertNet:
    for block in model.blocks:
        lv.fully_shard(block, granularity=granularity)
    return lv.fully_shard(model, granularity=granularity)


def cut_allowed(shape: tuple, x: int, block_rows) -> bool:
    """Whether a cut x elements into a tensor keeps blocks of ``block_rows`` rows of each matrix whole
    ("matrix": all its rows). Written from the definition, independently of the planner."""
    if len(shape) == 1:
        return True
    rows, cols = shape[-2:]
    within = x % (rows * cols) if len(shape) == 3 else x
    row, col = divmod(within, cols)
    step = rows if block_rows == "matrix" else block_rows
    return col == 0 and row % step == 0


def check_cuts(model: nn.Module, block_rows) -> int:
    """Every rank boundary inside every parameter is allowed; returns how many boundaries fall inside a tensor."""
    inner = 0
    for name, p in model.named_parameters():
        numel = p.numel()
        for start, end in p.layout_info.ranges:
            if end > start and 0 < start < numel:
                assert cut_allowed(tuple(p.shape), start, block_rows), (name, tuple(p.shape), start, block_rows)
                inner += 1
    return inner


def train_and_compare(model: nn.Module, ref: nn.Module, rank: int, world: int) -> float:
    """Two AdamW steps sharded and on one process (a copy of ``ref``); the largest parameter difference."""
    ref = copy.deepcopy(ref)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(2):
        torch.manual_seed(10 + step)
        x = torch.randn(4 * world, 8)
        mine = x[rank * 4 : (rank + 1) * 4]
        model(mine).square().mean().backward()
        ref(x).square().mean().backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    ref_params = dict(ref.named_parameters())
    worst = torch.zeros(())
    for name, p in model.named_parameters():
        start, end = p.local_range
        if end > start:
            full = ref_params[name].detach().reshape(-1)[start:end]
            worst = torch.maximum(worst, (p.to_local().reshape(-1) - full).abs().max())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def _ref() -> ExpertNet:
    torch.manual_seed(0)
    return ExpertNet()


def _blocks_of_16_cut_on_block_edges(rank: int, world: int) -> None:
    """Blocks of 16 rows: no shape is refused, every cut is on a block edge of its matrix."""
    model = shard(_ref(), 16)
    assert check_cuts(model, 16) > 0


def _blocks_of_16_train_exactly(rank: int, world: int) -> None:
    ref = _ref()
    model = shard(copy.deepcopy(ref), 16)
    assert train_and_compare(model, ref, rank, world) < 1e-5


def _matrix_keeps_each_expert_whole(rank: int, world: int) -> None:
    """Whole matrices (Muon's unit): every expert of a stack on one rank, the stack cut only between experts."""
    model = shard(_ref(), "matrix")
    check_cuts(model, "matrix")
    for p in (model.blocks[0].experts.w1, model.blocks[1].experts.w2):
        size = p.shape[1] * p.shape[2]
        for e in range(p.shape[0]):
            holders = [q for q, (s, t) in enumerate(p.layout_info.ranges) if s < (e + 1) * size and t > e * size]
            assert len(holders) == 1, (e, p.layout_info.ranges)


MAPPING = {"experts.*": 16, "head.weight": "matrix"}


def _glob_mapping_applies_where_it_matches(rank: int, world: int) -> None:
    """A glob mapping matches names relative to the module each call shards, and applies where it matches."""
    model = shard(_ref(), MAPPING)
    model(torch.randn(2, 8))
    stack = model.blocks[0].experts.w2
    assert all(cut_allowed(tuple(stack.shape), s, 16) for s, t in stack.layout_info.ranges if t > s)


def _unmatched_glob_fails_at_first_forward(rank: int, world: int) -> None:
    """A glob that matches nothing (a typo) is an error naming it, at the first forward: the mapping is shared
    by every call, and only all of them together tell whether it matched."""
    model = shard(_ref(), {**MAPPING, "blocks.*.kv.weight": "row"})
    with pytest.raises(ValueError, match=r"pattern\(s\) \['blocks\.\*\.kv\.weight'\] matched no parameter"):
        model(torch.randn(2, 8))


BY_PATTERN = {"blocks.*.experts.*": 16, "blocks.1.kv.weight": "row"}


def _by_pattern_trains_like_one_process(rank: int, world: int) -> None:
    ref = _ref()
    plain = copy.deepcopy(ref)
    model = shard(plain, granularity_by_pattern(plain, BY_PATTERN))
    assert train_and_compare(model, ref, rank, world) < 1e-5


class TestGranularityOn3Ranks(DistributedTest):
    world_size = 3

    def test_blocks_of_16_rows_cut_on_block_edges_of_each_matrix(self) -> None:
        self.run_ranks(_blocks_of_16_cut_on_block_edges)

    def test_blocks_of_16_rows_train_like_one_process(self) -> None:
        self.run_ranks(_blocks_of_16_train_exactly)

    def test_matrix_granularity_keeps_each_expert_whole(self) -> None:
        self.run_ranks(_matrix_keeps_each_expert_whole)

    def test_glob_mapping_applies_where_it_matches(self) -> None:
        self.run_ranks(_glob_mapping_applies_where_it_matches)

    def test_unmatched_glob_is_an_error_at_the_first_forward(self) -> None:
        self.run_ranks(_unmatched_glob_fails_at_first_forward)

    def test_granularity_by_pattern_trains_like_one_process(self) -> None:
        self.run_ranks(_by_pattern_trains_like_one_process)


def test_granularity_by_pattern_checks_the_models_names_at_once() -> None:
    """granularity_by_pattern matches the model's own names and checks them at once (no ranks needed)."""
    plain = _ref()
    with pytest.raises(ValueError, match=r"pattern\(s\) \['blocks\.\*\.experts\.w3'\] match no parameter"):
        granularity_by_pattern(plain, {"blocks.*.experts.*": 16, "blocks.*.experts.w3": "row"})
    by_name = granularity_by_pattern(plain, BY_PATTERN)
    assert by_name("w2", plain.blocks[1].experts.w2) == 16 and by_name("kv.weight", plain.blocks[1].kv.weight) == "row"
    assert by_name("kv.weight", plain.blocks[0].kv.weight) == "element"

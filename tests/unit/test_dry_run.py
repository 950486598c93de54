"""The dry run's parts against the things they predict: saved activations against a real forward, per-rank
optimizer states against the planner's pieces, FSDP2's padding, the hardware profiles, the command line.
(Bytes per step against ``comm_stats`` and the layouts against a sharded model: ``tests/distributed/
test_plan_parallelize.py``; the peak against the operating system: ``benchmarks/plan_check.py``.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_vescale.models.families import FAMILIES
from lightning_vescale.plan import resolve_plan
from lightning_vescale.plan.__main__ import main, world_sizes
from lightning_vescale.plan._activations import activation_bytes_per_token, activation_profile
from lightning_vescale.plan._dry_run import Workload, _per_rank_state_elements, dry_run
from lightning_vescale.plan._hardware import load_profile
from lightning_vescale.plan._layout import BufferLayout
from lightning_vescale.planner import TensorSpec, plan_buffer


def build(family: str, preset: str, **overrides) -> nn.Module:
    import dataclasses

    torch.manual_seed(0)
    return FAMILIES[family].model_cls(dataclasses.replace(FAMILIES[family].preset(preset), **overrides))


def saved_bytes_per_token(model: nn.Module, batch: int, seq: int, dtype: torch.dtype = torch.float32) -> float:
    """What autograd really keeps for backward in a CPU forward + the recipes' loss (distinct storages)."""
    model = model.to(dtype)
    tokens = torch.randint(0, model.tok_embeddings.num_embeddings, (batch, seq + 1))
    skip = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages.setdefault(t.untyped_storage()._cdata, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    return sum(n for k, n in storages.items() if k not in skip) / (batch * seq)


@pytest.mark.parametrize("family, preset", [("llama", "tiny"), ("llama", "debug"), ("moe", "tiny"), ("qwen3_moe", "tiny")])
def test_activation_count_matches_a_real_forward(family: str, preset: str) -> None:
    model = build(family, preset)
    real = saved_bytes_per_token(model, batch=2, seq=64)
    assert activation_bytes_per_token(model) == pytest.approx(real, rel=0.01)


def test_activation_count_in_bf16_matches_a_real_forward() -> None:
    model = build("llama", "tiny")
    real = saved_bytes_per_token(model, batch=2, seq=64, dtype=torch.bfloat16)
    assert activation_bytes_per_token(build("llama", "tiny"), compute_dtype=torch.bfloat16) == pytest.approx(real, rel=0.01)


def test_each_kind_of_block_counted_once_gives_the_same_profile() -> None:
    # DeepSeek-V3 tiny: a dense first block, then MoE blocks; the plan makes blocks and experts groups.
    with torch.device("meta"):
        model = build("deepseek_v3", "tiny", n_layers=4)
    groups = ["", "layers.0", "layers.1", "layers.2", "layers.3", "layers.2.feed_forward.experts"]
    profile = activation_profile(model, groups)
    assert profile["layers.2"] == profile["layers.1"] == profile["layers.3"] != profile["layers.0"]
    assert sum(profile.values()) == pytest.approx(activation_bytes_per_token(model))
    assert len(model.layers) == 4, "the caller's model is not changed"


def test_per_rank_optimizer_states_equal_the_planners_pieces() -> None:
    specs = [TensorSpec("a", (5, 7), 7), TensorSpec("b", (13,), 1), TensorSpec("c", (3, 11), 33), TensorSpec("d", (2,))]
    plan = plan_buffer(specs, 7, alignment=4)
    layout = BufferLayout(plan, torch.float32, torch.float32, torch.float32, True)
    weights = [8, 4, 0, 8]
    got = _per_rank_state_elements(layout, weights).tolist()
    want = [sum((plan.piece(i, r)[1] - plan.piece(i, r)[0]) * w for i, w in enumerate(weights)) for r in range(7)]
    assert got == want


def test_dry_run_bytes_follow_the_ring_formula_and_fsdp2_pads_rows() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(6, 3, bias=False) for _ in range(2))  # 3 rows on 4 ranks
            self.embed = nn.Embedding(8, 6)

        def forward(self, x):
            h = self.embed(x)
            for b in self.blocks:
                h = torch.cat([b(h), b(h)], -1)
            return h

    with torch.device("meta"):
        model = Odd()
    resolved = resolve_plan(model)
    workload = Workload(batch_size=1, seq_len=4, precision="32-true", clip_grad=False)
    run = dry_run(model, resolved, 4, workload=workload, hardware=load_profile("h200"), activations={})
    # Blocks: 18 elements on 4 ranks, shard 8 (16-byte aligned), gathered twice; the root (48) once.
    assert run.vescale.collectives["all_gather"] == 3 * (2 * 2 * 8 + 12) * 4
    assert run.vescale.collectives["reduce_scatter"] == 3 * (2 * 8 + 12) * 4
    # FSDP2: each 3-row weight padded to 4 rows of 6; the embedding's 8 rows split evenly.
    assert run.fsdp2.collectives["all_gather"] == 3 * (2 * 2 * 6 + 12) * 4
    assert run.fsdp2.padding == pytest.approx(2 * 6 / (2 * 18 + 48))
    assert run.vescale.padding == pytest.approx(2 * (32 - 18) / (2 * 18 + 48))
    single = dry_run(model, resolved, 1, workload=workload, hardware=load_profile("h200"), activations={})
    assert single.vescale.bytes_per_step == 0 and single.vescale.params == 4 * (2 * 20 + 48)  # 16-byte aligned


def test_hardware_profiles_load_as_numbers() -> None:
    for name in ("h200", "cpu"):
        profile = load_profile(name)
        numbers = [profile.memory_bandwidth, profile.intra_node.bandwidth, profile.inter_node.latency,
                   *profile.flops.values()]
        assert all(isinstance(x, float) and x >= 0 for x in numbers), (name, numbers)
    h200 = load_profile("h200")
    assert h200.link(8) is h200.intra_node and h200.link(16) is h200.inter_node


def test_world_size_ranges() -> None:
    assert world_sizes("8..64") == [8, 16, 32, 64]
    assert world_sizes("8,24") == [8, 24]
    assert world_sizes("1024") == [1024]


def test_command_line_prints_both_engines(capsys) -> None:
    assert main(["model=llama_tiny", "world_size=2,4", "seq_len=64", "hardware=cpu", "precision=32-true"]) == 0
    out = capsys.readouterr().out
    assert "plan 'default' on Llama: 4 groups" in out
    assert sum(line.split()[:2] in (["2", "vescale"], ["2", "fsdp2"], ["4", "vescale"], ["4", "fsdp2"])
               for line in out.splitlines()) == 4


@pytest.mark.parametrize("argv, message", [
    (["model=llama_tiny", "world_size=2", "hardwre=cpu"], "unknown argument 'hardwre' (did you mean 'hardware'?)"),
    (["model=llama_7b", "world_size=2"], "unknown model 'llama_7b'; presets: "),
    (["model=llama_tiny", "world_size=two"], "world_size='two': give N, a list"),
    (["model=llama_tiny", "world_size=2", "plan=moe"], "rule #2 (match: '**.layers.*.feed_forward.experts') matches no"),
    (["model=llama_tiny", "world_size=2", "model.n_layer=3"], "model=llama_tiny with overrides {'n_layer': 3}"),
    (["world_size=2"], "model= is required"),
])
def test_command_line_errors_name_the_problem(argv, message, capsys) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err

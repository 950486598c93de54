"""The dry run's parts against the things they predict: saved activations against a real forward, per-rank
optimizer states against the planner's pieces, FSDP2's padding, the hardware profiles, the command line.
(Bytes per step against ``comm_stats`` and the layouts against a sharded model: ``tests/distributed/
test_plan_parallelize.py``; the peak against the operating system: ``benchmarks/plan_check.py``.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_vescale.engine.planner import TensorSpec, plan_buffer
from lightning_vescale.models.families import FAMILIES
from lightning_vescale.plan import PlanError, resolve_plan
from lightning_vescale.plan.__main__ import main, world_sizes
from lightning_vescale.plan._activations import activation_bytes_per_token, activation_profile
from lightning_vescale.plan._dry_run import Workload, _per_rank_state_elements, dry_run
from lightning_vescale.plan._hardware import load_profile
from lightning_vescale.plan._layout import BufferLayout, group_layouts


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


def test_a_plans_host_and_disk_tiers_leave_the_devices_bytes(capsys) -> None:
    from lightning_vescale.plan import load_plan

    with torch.device("meta"):
        model = build("llama", "tiny")
    workload = Workload(batch_size=1, seq_len=64, precision="32-true")
    plain = dry_run(model, resolve_plan(model, load_plan("llama")), 4, workload=workload, hardware=load_profile("h200"))
    tiered = dry_run(model, resolve_plan(model, load_plan("llama_offload")), 4, workload=workload,
                     hardware=load_profile("h200"))
    off, ve, base = tiered.vescale.off_device, tiered.vescale, plain.vescale
    assert set(off) == {"params/disk", "grads/disk", "optimizer_states/disk"}
    assert ve.params + off["params/disk"] == base.params and ve.grads + off["grads/disk"] == base.grads
    assert 0 < ve.optimizer < base.optimizer and base.peak - ve.peak >= off["params/disk"] + off["optimizer_states/disk"]
    assert ve.bytes_per_step == base.bytes_per_step  # the tiers move nothing between ranks
    # Host memory is the device's where the ranks share a CPU.
    host = resolve_plan(model, {"rules": [{"match": "layers.*", "group": True, "tier": "host"}]})
    assert dry_run(model, host, 4, workload=workload, hardware=load_profile("h200")).vescale.off_device
    assert not dry_run(model, host, 4, workload=workload, hardware=load_profile("cpu")).vescale.off_device
    assert main(["model=llama_tiny", "world_size=4", "seq_len=64", "hardware=h200", "plan=llama_offload"]) == 0
    out = capsys.readouterr().out
    assert "host/disk" in out and "per rank off the device" in out


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


def test_command_line_names_the_mesh_and_the_quantized_gathers(capsys, tmp_path) -> None:
    plan = tmp_path / "fp8.yaml"
    plan.write_text("rules:\n  - {match: '**.layers.*', group: true}\n"
                    "  - {match: '**.layers.*.feed_forward', quantization: fp8_block}\n")
    argv = ["model=llama_tiny", "world_size=4", "replicate=2", "seq_len=64", "hardware=cpu", f"plan={plan}"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "mesh: 2-D HSDP (replicate=2, shard=2): each group sharded over world_size / 2 ranks" in out
    header = next(line for line in out.splitlines() if line.startswith("ranks"))
    assert "(quantized)" in header and "all-reduce/step" in header
    assert "fp8_block x3" in out and "trained, gathered as codes + scales" in out


@pytest.mark.parametrize("argv, message", [
    (["model=llama_tiny", "world_size=2", "hardwre=cpu"], "unknown argument 'hardwre' (did you mean 'hardware'?)"),
    (["model=llama_7b", "world_size=2"], "unknown model 'llama_7b'; presets: "),
    (["model=llama_tiny", "world_size=two"], "world_size='two': give N, a list"),
    (["model=llama_tiny", "world_size=2", "plan=moe"], "rule #2 (match: '**.layers.*.feed_forward.experts') matches no"),
    (["model=llama_tiny", "world_size=2", "model.n_layer=3"], "model=llama_tiny with overrides {'n_layer': 3}"),
    (["world_size=2"], "model= is required"),
    (["model=llama_tiny", "world_size=8,12", "replicate=8"], "replicate=8 does not divide world_size=12"),
])
def test_command_line_errors_name_the_problem(argv, message, capsys) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


class _Quantizable(nn.Module):
    """Shapes whose last 128-row band (200 rows: 72) and tiles (130x300: partial edge tiles) are partial."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(96, 200), nn.Linear(200, 136)) for _ in range(2))
        self.stack = nn.Parameter(torch.empty(3, 40, 72))
        self.frozen = nn.Linear(300, 130, bias=False).requires_grad_(False)


def test_quantized_layouts_are_the_engines_buffers_at_any_world_size() -> None:
    from lightning_vescale.quant import parse_format
    from lightning_vescale.quant._gather import QuantizedGatherBuffer
    from lightning_vescale.quant._kinds import is_tile_major
    from lightning_vescale.quant._storage import QuantizedStorage

    with torch.device("meta"):
        model = _Quantizable()
    plan = {"rules": [{"match": "blocks.*", "group": True}, {"match": "blocks.*", "quantization": "fp8_block"},
                      {"match": "stack", "quantization": "int8_block"}, {"match": "frozen", "quantization": "int8_block"}]}
    resolved = resolve_plan(model, plan)
    tiled: set[tuple[int, ...]] = set()
    for N in (3, 5, 16):
        for g in resolved.groups:
            for lay in group_layouts(resolved, g, N):
                if lay.quant == "quantized_gather":  # the engine counts the scales of every rank's pieces
                    tile_major = [is_tile_major(s, lay.fmt, "block_major") for s in lay.plan.specs]
                    buf = QuantizedGatherBuffer(lay.plan, group=None, device=torch.device("meta"), dtype=lay.dtype,
                                                fmt=lay.fmt, tile_major=tile_major)
                    assert lay.scales_per_rank == buf.scales_per_rank > 0
                    # Cuts between 128x128 tiles of a tile-major master (136x200: its edge tiles allow it), else
                    # only between 128-row bands of each matrix (the last band holding what remains).
                    tiled |= {s.shape for s, t in zip(lay.plan.specs, tile_major) if t}
                    assert all((s.granularity, s.period) == (min(128, s.shape[-2]) * s.shape[-1],
                               s.shape[-2] * s.shape[-1] if s.shape[-2] % 128 else s.numel)
                               for s, t in zip(lay.plan.specs, tile_major) if len(s.shape) == 2 and not t)
                elif lay.quant == "quantized_storage":  # the engine plans its tiles itself
                    buf = QuantizedStorage([s.name for s in lay.plan.specs], [(130, 300)], fmt=parse_format("int8"),
                                           group=None, world_size=N, device=torch.device("meta"),
                                           param_dtype=torch.float32)
                    assert lay.plan.fingerprint() == buf.plan.fingerprint()
                    assert (lay.shard_bytes, lay.gathered_bytes) == (buf.local_nbytes(), 4 * buf.unsharded.numel())
    assert tiled == {(136, 200)}
    layouts = [lay for g in resolved.groups for lay in group_layouts(resolved, g, 4)]
    assert {lay.quant for lay in layouts} == {None, "quantized_gather", "quantized_storage"}  # biases stay plain
    # The frozen 130x300 weight: 2x3 tiles of 128x128 int8 codes and 6 scales, 2 tiles per rank sent to 3 others.
    storage = next(lay for lay in layouts if lay.quant == "quantized_storage")
    assert storage.all_gather_bytes() == {"all_gather_quant_codes": 3 * 2 * 128 * 128, "all_gather_quant_scales": 3 * 2 * 4}
    run = dry_run(model, resolved, 4, workload=Workload(seq_len=4, precision="32-true", clip_grad=False),
                  hardware=load_profile("h200"), activations={})
    assert {"all_gather", "all_gather_quant_codes", "all_gather_quant_scales"} <= run.vescale.collectives.keys()


def test_the_plan_table_says_where_whole_blocks_cost_much_padding() -> None:
    """A quantized AllGather keeps its 128x128 blocks whole; where that costs more than 3% padding the table marks the
    group, shows the planner's lower bound and prints a warning (the format is never changed silently)."""

    class Blocks(nn.Module):
        def __init__(self, rows: int) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(256, rows, bias=False)])

    plan = {"rules": [{"match": "blocks.*", "group": True}, {"match": "blocks.*", "quantization": "fp8_block"}]}
    with torch.device("meta"):
        # 300x256: bands of 128, 128 and 44 rows; at 2 ranks a cut between bands leaves 128 of 300 rows on one side.
        resolved = resolve_plan(Blocks(300), plan)
    table = resolved.table(2)
    assert "lower bound" in table.splitlines()[1]
    row = next(line for line in table.splitlines() if line.startswith("blocks.0"))
    assert " !" in row
    assert "warning: group blocks.0: keeping the 128x128 blocks of its trained fp8_e4m3 weights whole" in table
    (lay,) = group_layouts(resolved, resolved.groups[0], 2)
    pad = lay.padding_elements / lay.real_numel
    assert pad > 0.03 and f"costs {pad:.2%} padding on 2 ranks" in table
    assert lay.lower_bound_padding_elements <= lay.padding_elements
    run = dry_run(Blocks(300).to_empty(device="meta"), resolved, 2, workload=Workload(seq_len=4, precision="32-true",
                  clip_grad=False), hardware=load_profile("h200"), activations={})
    assert any(n.startswith("warning: group blocks.0: keeping the 128x128 blocks") for n in run.notes)
    # 1024 rows split between bands at 2 ranks: no padding, no warning; nor on one rank.
    with torch.device("meta"):
        even = resolve_plan(Blocks(1024), plan)
    assert "warning" not in even.table(2) and "warning" not in resolved.table(1)


def test_hsdp_shards_over_the_shard_group_and_all_reduces_across_replicas() -> None:
    with torch.device("meta"):
        model = build("llama", "tiny")
    resolved = resolve_plan(model)
    kw = dict(workload=Workload(seq_len=16, precision="bf16-mixed"), hardware=load_profile("h200"), activations={})
    hsdp, flat = dry_run(model, resolved, 8, replicate=4, **kw), dry_run(model, resolved, 2, **kw)
    assert (hsdp.mesh, hsdp.world_size, hsdp.replicate) == ("2-D HSDP (replicate=4, shard=2)", 8, 4)
    for field in ("params", "grads", "optimizer", "gathered_peak", "peak"):
        assert getattr(hsdp.vescale, field) == getattr(flat.vescale, field), field
    ar = hsdp.vescale.collectives.pop("all_reduce_replicate")
    assert hsdp.vescale.collectives == flat.vescale.collectives
    # One AllReduce per gradient buffer of its reduced fp32 piece (the shard size): 2 * (R - 1) / R of it.
    pieces = [lay.plan.shard_size for g in resolved.groups for lay in group_layouts(resolved, g, 2)]
    assert ar == sum(2 * 3 * S * 4 // 4 for S in pieces)
    assert hsdp.vescale.replicate_seconds > 0 and hsdp.vescale.step_seconds > flat.vescale.step_seconds
    with pytest.raises(PlanError, match="replicate=3 does not divide world_size=8"):
        dry_run(model, resolved, 8, replicate=3, **kw)


def test_muon_all_to_alls_get_a_column_only_with_muon(capsys) -> None:
    assert main(["model=llama_tiny", "world_size=4", "plan=llama", "optimizer=muon"]) == 0
    out = capsys.readouterr().out
    assert "muon all-to-all/step" in out and "Muon's all-to-alls (muon_gather / muon_scatter)" in out
    assert "are not counted" not in out
    assert main(["model=llama_tiny", "world_size=4", "plan=llama"]) == 0
    assert "muon" not in capsys.readouterr().out.split("per rank:")[1]


def test_muon_matrices_whole_on_one_rank_send_nothing() -> None:
    from lightning_vescale.plan._dry_run import _piece_ranges, muon_bucket_bytes

    # Three 4x4 matrices on 3 ranks of 16 elements each: whole on one rank each (local path) ...
    whole = [(f"m{i}", (4, 4), _piece_ranges(3, 16, 16 * i, 16)) for i in range(3)]
    assert muon_bucket_bytes(whole, 3)[:2] == ([0.0] * 3, [0.0] * 3)
    # ... and shifted by 8 elements, every matrix straddles two ranks: each is gathered to one of them (LPT) and the
    # other half (8 bf16 elements) goes there and back.
    shifted = [(f"m{i}", (4, 4), _piece_ranges(4, 16, 8 + 16 * i, 16)) for i in range(3)]
    gather, scatter, _ = muon_bucket_bytes(shifted, 4)
    assert sum(gather) == sum(scatter) == 3 * 8 * 2

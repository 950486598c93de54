"""The dry run describes the buffers the engine builds: for Llama and MoE presets (3-D expert stacks included) at
element, row, 128-row and whole-matrix granularity, on 2 and 3 ranks, every group's buffer plans (offsets, cut
points, shard sizes: their fingerprints) from ``plan.group_layouts`` equal those of the groups
``lightning_vescale.parallelize`` built. Both come from one function (``group_plan.plan_group_buffers``); before
it, the dry run balanced whole expert matrices without their Newton-Schulz cost and described other offsets.

Only layouts are compared (meta-device models, nothing initialized, no data moved), so one process plays one rank of
a fake process group (``tests.dist_pool.fake_world``) for 2, 3 and 4 ranks. That every rank builds the same plans
(so the pieces of one AllGather line up) is checked with all ranks at once, as threads of one process exchanging
their fingerprints (``tests.dist_pool.threaded_world``)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import lightning_vescale as lv
from lightning_vescale.engine.fully_shard import get_state
from lightning_vescale.models import Llama, llama_config
from lightning_vescale.models.moe import MoE, moe_config
from lightning_vescale.plan._layout import group_layouts
from tests.dist_pool import fake_world, threaded_world

MODELS = {"llama_tiny": lambda: Llama(llama_config("tiny")), "moe_tiny": lambda: MoE(moe_config("tiny"))}
GRANULARITIES = ("element", "row", 128, "matrix")


def _agree(world: int) -> None:
    mismatches = []
    for name, make in MODELS.items():
        per_granularity = set()
        for granularity in GRANULARITIES:
            with torch.device("meta"):
                model = make()
            lv.parallelize(model, None, init_device_mesh("cpu", (world,)), granularity=granularity, init_weights=False)
            resolved = lv.resolved_plan_of(model)
            layouts: list[tuple] = []
            for g in resolved.groups:
                module = model.get_submodule(g.name) if g.name else model
                engine = [p.fingerprint() for p in get_state(module).group.plans]
                predicted = [lay.plan.fingerprint() for lay in group_layouts(resolved, g, world)]
                if engine != predicted:
                    mismatches.append((name, granularity, g.name))
                layouts.append(tuple(engine))
            per_granularity.add(tuple(layouts))
        # The granularities lay the groups out differently: the comparison is not between empty or equal layouts.
        assert len(per_granularity) == len(GRANULARITIES), (name, world)
    assert not mismatches, f"the dry run describes other buffers than the engine builds for {mismatches}"


@pytest.mark.parametrize("world, rank", [(2, 1), (3, 2), (4, 0)])
def test_dry_run_layouts_equal_the_engines(world: int, rank: int) -> None:
    with fake_world(world, rank):
        _agree(world)


def _agree_quantized(world: int) -> None:
    """A plan quantizing a Llama's trained weights (``fp8_block``, layout ``"auto"``): on 3 ranks tile-major masters
    (which pad less there) beside row-band ones (80-row wk/wv: their edge tiles do not pair up), on 2 row bands only
    (which pad less there); the dry run's plans and scale counts are the engine's."""
    from lightning_vescale.models import LlamaConfig

    plan = {"rules": [{"match": "layers.*", "quantization": "fp8_block"}]}
    with torch.device("meta"):
        model = Llama(LlamaConfig(vocab_size=200, dim=320, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden=640,
                                  max_seq_len=32))
    lv.parallelize(model, plan, init_device_mesh("cpu", (world,)), granularity="element", init_weights=False)
    resolved = lv.resolved_plan_of(model)
    tile_major = 0
    for g in resolved.groups:
        module = model.get_submodule(g.name) if g.name else model
        engine = get_state(module).group
        assert [p.fingerprint() for p in engine.plans] == [
            lay.plan.fingerprint() for lay in group_layouts(resolved, g, world)], (world, g.name)
        for buf, lay in zip(engine.buffers.values(), group_layouts(resolved, g, world)):
            if lay.quant == "quantized_gather":
                assert buf.scales_per_rank == lay.scales_per_rank  # type: ignore[attr-defined]
                tile_major += sum(buf.tile_major)  # type: ignore[attr-defined]
    assert (tile_major > 0) == (world == 3), (world, tile_major)


@pytest.mark.parametrize("world, rank", [(2, 1), (3, 0)])
def test_dry_run_layouts_equal_the_engines_with_tile_major_quantized_weights(world: int, rank: int) -> None:
    with fake_world(world, rank):
        _agree_quantized(world)


def _fingerprints_of_every_rank(rank: int, world: int) -> dict[str, list]:
    """This rank's buffer-plan fingerprints for each model and granularity, and those every rank sent it."""
    import torch.distributed as dist

    mine = {}
    for name, make in MODELS.items():
        for granularity in GRANULARITIES:
            with torch.device("meta"):
                model = make()
            lv.parallelize(model, None, init_device_mesh("cpu", (world,)), granularity=granularity, init_weights=False)
            resolved = lv.resolved_plan_of(model)
            mine[f"{name}/{granularity}"] = [
                [p.fingerprint() for p in get_state(model.get_submodule(g.name) if g.name else model).group.plans]
                for g in resolved.groups]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    return {"rank": dist.get_rank(), "mine": mine, "everyone": everyone}


def test_every_rank_builds_the_same_buffer_plans() -> None:
    world = 3
    results = threaded_world(world, _fingerprints_of_every_rank)
    assert [r["rank"] for r in results] == list(range(world))  # each thread was its own rank
    for rank, result in enumerate(results):
        assert result["mine"], rank
        assert all(other == result["mine"] for other in result["everyone"]), f"rank {rank} saw other plans"
    assert results[0]["mine"]["llama_tiny/element"] != results[0]["mine"]["llama_tiny/matrix"]

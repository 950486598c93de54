"""The MPMD cost model on the meta device: the pipeline formula, the bubble fraction, and the choice."""

from __future__ import annotations

import pytest
import torch

from lightning_vescale.models.vlm import VLM, synthetic_vlm_batch, vlm_config
from lightning_vescale.pipeline import choose_layout, predict_mpmd, predict_uniform
from lightning_vescale.plan._hardware import load_profile


def plan(vision: int, language: int, microbatches: int) -> dict:
    return {"name": f"{vision}+{language}/{microbatches}", "schedule": "1f1b", "microbatches": microbatches,
            "stages": [{"name": "vision", "modules": ["encoder", "projector"], "ranks": vision},
                       {"name": "language", "modules": ["decoder"], "ranks": language, "plan": "llama"}]}


@pytest.fixture(scope="module")
def vlm():
    config = vlm_config("small")
    with torch.device("meta"):
        model = VLM(config)
    images, tokens, _ = synthetic_vlm_batch(config, 24, 16, 0)
    return model, (images, tokens)


def test_pipeline_time_and_bubble_follow_the_schedule_formula(vlm):
    model, inputs = vlm
    cost = predict_mpmd(model, plan(1, 3, 4), inputs, load_profile("h200"))
    t = [s.microbatch_seconds for s in cost.stages]
    once = cost.stages[0].gather_seconds  # gather_once: each stage gathers once per step, the first one delays all
    pipeline = sum(t) + 3 * max(t) + once + max(s.reduce_seconds for s in cost.stages)
    assert cost.step_seconds == pytest.approx(pipeline + max(s.optimizer_seconds for s in cost.stages))
    assert [s.bubble_fraction for s in cost.stages] == pytest.approx([1 - 4 * x / pipeline for x in t])
    assert cost.bubble_fraction == pytest.approx((cost.stages[0].bubble_fraction + 3 * cost.stages[1].bubble_fraction) / 4)
    # The encoder's stage computes far less than the decoder's (the case MPMD is for), and is idle more.
    assert cost.stages[0].compute_seconds < cost.stages[1].compute_seconds / 5
    assert cost.stages[0].bubble_fraction > cost.stages[1].bubble_fraction
    more = predict_mpmd(model, plan(1, 3, 8), inputs, load_profile("h200"))
    assert more.stages[1].bubble_fraction < cost.stages[1].bubble_fraction  # more micro-batches, less bubble
    # Gathering per micro-batch instead: no parameters held through the step, the AllGathers priced M times.
    regather = predict_mpmd(model, {**plan(1, 3, 4), "gather_once": False}, inputs, load_profile("h200"))
    decoder, again = cost.stages[1], regather.stages[1]
    assert decoder.unsharded_bytes > 0 and decoder.collective_seconds == 0 and decoder.gather_seconds > 0
    assert again.unsharded_bytes == 0 and again.gather_seconds == 0 and again.collective_seconds > 0
    assert regather.step_seconds > cost.step_seconds


def test_the_fastest_predicted_layout_is_chosen_and_mpmd_only_when_faster(vlm):
    model, inputs = vlm
    hardware = load_profile("cpu")
    best, costs = choose_layout(model, inputs, 4, hardware, [plan(1, 3, 4), plan(2, 2, 3), plan(1, 2, 4)])
    assert [c.step_seconds for c in costs] == sorted(c.step_seconds for c in costs)
    assert len(costs) == 3  # 1 + 2 ranks does not fit 4 and is not priced
    uniform = predict_uniform(model, inputs, 4, hardware)
    assert (best is None) == (costs[0].name == "uniform") == (uniform.step_seconds <= min(c.step_seconds for c in costs))
    # On this machine's calibrated profile, as measured (benchmarks/results/mpmd.md): encoder and decoder on 2 ranks
    # each is faster than uniform sharding, the decoder on 3 ranks (a team, 1 sample per rank and micro-batch) slower.
    assert best is not None and best.name == "2+2/3"
    assert [c.name for c in costs] == ["mpmd:2+2/3", "uniform", "mpmd:1+3/4"]


def test_a_batch_the_pipelines_cannot_split_is_refused(vlm):
    model, _ = vlm
    images, tokens, _ = synthetic_vlm_batch(vlm_config("small"), 10, 16, 0)
    with pytest.raises(ValueError, match="use a multiple of 12"):
        predict_mpmd(model, plan(1, 3, 4), (images, tokens), load_profile("cpu"))

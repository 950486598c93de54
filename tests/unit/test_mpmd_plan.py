"""MPMD plans without a process group: the syntax, and every bad input refused before training with a message
that names the problem and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_vescale.models.llama import LlamaConfig
from lightning_vescale.models.vlm import VLM, VLMConfig, synthetic_vlm_batch, vlm_config
from lightning_vescale.pipeline import (
    MPMDPlan,
    check_stage_shapes,
    is_mpmd_plan,
    run_chain,
)
from lightning_vescale.pipeline._runtime import check_stage_plans
from lightning_vescale.plan import PlanError


def plan_dict(**changes) -> dict:
    plan = {"name": "vlm", "schedule": "gpipe", "microbatches": 2, "stages": [
        {"name": "vision", "modules": ["encoder", "projector"], "ranks": 1},
        {"name": "language", "modules": ["decoder"], "ranks": 3, "plan": "llama"}]}
    plan.update(changes)
    return plan


def test_plan_syntax_round_trips_and_places_unequal_groups_on_consecutive_ranks():
    plan = MPMDPlan.from_dict(plan_dict())
    assert is_mpmd_plan(plan_dict()) and not is_mpmd_plan({"rules": []})
    assert plan.world_size == 4 and plan.num_pipelines == 1
    assert plan.rank_ranges() == [range(1), range(1, 4)]
    assert plan.stages[1].plan.name == "llama"
    assert MPMDPlan.from_dict(plan.to_dict()) == plan
    two_by_two = MPMDPlan.from_dict(plan_dict(stages=[{"modules": ["a"], "ranks": 2}, {"modules": ["b"], "ranks": 4}]))
    assert two_by_two.num_pipelines == 2


def test_ranks_that_do_not_add_up_to_the_world_size_are_refused():
    with pytest.raises(PlanError, match=r"add up to 1 \(vision\) \+ 3 \(language\) = 4, but the world has 3 ranks"):
        MPMDPlan.from_dict(plan_dict()).check_world_size(3)


def test_a_module_in_two_stages_is_refused():
    stages = [{"name": "a", "modules": ["encoder", "projector"], "ranks": 1},
              {"name": "b", "modules": ["projector", "decoder"], "ranks": 1}]
    with pytest.raises(PlanError, match="module 'projector' is assigned to stage 'a' and to stage 'b'"):
        MPMDPlan.from_dict(plan_dict(stages=stages))


def test_a_parameter_shared_by_two_stages_is_refused():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
            self.b.weight = self.a.weight

    plan = MPMDPlan.from_dict(plan_dict(stages=[{"name": "x", "modules": ["a"], "ranks": 1},
                                                 {"name": "y", "modules": ["b"], "ranks": 1}]))
    with pytest.raises(PlanError, match="parameter b.weight is shared by stages 'x' and 'y'"):
        plan.check_model(Tied())


def test_unknown_and_uncovered_modules_are_refused():
    model = VLM(vlm_config("tiny"))
    typo = plan_dict(stages=[{"modules": ["encodr", "projector"], "ranks": 1}, {"modules": ["decoder"], "ranks": 1}])
    with pytest.raises(PlanError, match=r"no top-level sub-module 'encodr' \(did you mean 'encoder'\?\)"):
        MPMDPlan.from_dict(typo).check_model(model)
    missing = plan_dict(stages=[{"modules": ["encoder"], "ranks": 1}, {"modules": ["decoder"], "ranks": 1}])
    with pytest.raises(PlanError, match="projector hold.s. parameters but no stage runs them"):
        MPMDPlan.from_dict(missing).check_model(model)


@pytest.mark.parametrize("bad, message", [
    ({"schedule": "zero_bubble"}, "schedule must be one of gpipe, 1f1b"),
    ({"microbatches": 0}, "microbatches must be a positive number"),
    ({"schedule": "1f1b", "microbatches": 1}, "1f1b needs at least as many micro-batches as stages"),
    ({"stages": [{"modules": ["encoder"], "ranks": 4}]}, "needs at least two stages"),
    ({"stage": []}, r"unknown key\(s\) 'stage' \(did you mean 'stages'\?\)"),
    ({"stages": [{"modules": ["a"], "ranks": 0}, {"modules": ["b"], "ranks": 1}]}, "'ranks' must be a positive"),
    ({"stages": [{"modules": ["a"], "rank": 1}, {"modules": ["b"], "ranks": 1}]}, r"did you mean 'ranks'"),
    ({"stages": [{"modules": ["a"], "ranks": 1, "plan": {"rules": [{"match": "x", "grup": True}]}},
                 {"modules": ["b"], "ranks": 1}]}, r"stage #1 .'stage0'.: .*did you mean 'group'"),
])
def test_bad_plan_values_are_refused_naming_the_field(bad, message):
    with pytest.raises(PlanError, match=message):
        MPMDPlan.from_dict(plan_dict(**bad))


def test_a_stage_plan_that_matches_nothing_in_its_stage_is_refused_before_any_group():
    plan = MPMDPlan.from_dict(plan_dict(stages=[
        {"name": "vision", "modules": ["encoder", "projector"], "ranks": 1, "plan": "llama"},
        {"name": "language", "modules": ["decoder"], "ranks": 1, "plan": "llama"}]))
    with pytest.raises(PlanError, match="stage 'vision': plan 'llama' cannot be applied"):
        check_stage_plans(VLM(vlm_config("tiny")), plan)


def test_a_stage_plan_placing_state_off_the_device_is_refused_rather_than_ignored():
    plan = MPMDPlan.from_dict(plan_dict(stages=[
        {"name": "vision", "modules": ["encoder", "projector"], "ranks": 1},
        {"name": "language", "modules": ["decoder"], "ranks": 1,
         "plan": {"rules": [{"match": "*", "tier": {"optimizer_states": "disk"}}]}}]))
    with pytest.raises(PlanError, match=r"stage 'language': its plan places state on \['disk'\] tiers"):
        check_stage_plans(VLM(vlm_config("tiny")), plan)


def test_stage_activations_that_do_not_fit_are_refused_naming_both_stages():
    config = vlm_config("tiny")
    model = VLM(config)
    model.decoder = VLM(VLMConfig(decoder=LlamaConfig(vocab_size=64, dim=40, n_layers=1, n_heads=4, n_kv_heads=2,
                                                      ffn_hidden=64, max_seq_len=64))).decoder  # width 40, not 48
    images, tokens, _ = synthetic_vlm_batch(config, 2, 5, 0)
    plan = MPMDPlan.from_dict(plan_dict())
    with pytest.raises(PlanError, match=r"stage 'language' \(decoder\) cannot take the activations after stage "
                                        r"'vision': \[\(2, 16, 48\) float32, \(2, 5\) int64\]"):
        check_stage_shapes(model, plan, (images, tokens))


def test_the_chain_of_stages_is_the_model_forward_and_the_shapes_cross_the_boundaries():
    config = vlm_config("tiny")
    torch.manual_seed(0)
    model = VLM(config)
    images, tokens, _ = synthetic_vlm_batch(config, 2, 5, 0)
    chained = run_chain([model.encoder, model.projector, model.decoder], (images, tokens))
    assert len(chained) == 1 and torch.equal(chained[0], model(images, tokens))
    boundaries = check_stage_shapes(model, MPMDPlan.from_dict(plan_dict()), (images, tokens))
    (_, vision_out), (_, language_out) = boundaries
    assert [tuple(v.shape) for v in vision_out] == [(2, 16, 48), (2, 5)]
    assert tuple(language_out[0].shape) == (2, 5, 64)
    assert all(p.device.type == "cpu" for p in model.parameters())  # the check copied nothing to meta in place


def test_synthetic_vlm_data_is_deterministic_and_needs_the_image():
    config = vlm_config("tiny")
    a, b = synthetic_vlm_batch(config, 4, 5, 3), synthetic_vlm_batch(config, 4, 5, 3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    images, tokens, target = a
    assert torch.equal(tokens[:, 1:], target[:, :-1])
    assert not torch.equal(synthetic_vlm_batch(config, 4, 5, 4)[0], images)


def test_team_commands_round_trip_as_integers_and_fall_back_to_objects(tmp_path) -> None:
    """The step's commands travel as a few integers; anything else (here a command with a complex dtype) as a
    pickled object, which must not fail on the leader's side."""
    import torch.distributed as dist

    from lightning_vescale.pipeline._team import BACKWARD, END, FORWARD, Team, _decode, _encode

    forward = (FORWARD, 3, [((2, 5), torch.float32, True), ((2,), torch.int64, False)])
    for cmd in (forward, (BACKWARD, 1), (END,)):
        assert _decode(_encode(cmd)) == cmd
    odd = (FORWARD, 0, [((2,), torch.complex64, False)])
    assert _encode(odd) is None
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        team = Team(dist.group.WORLD)
        assert team.command(odd) == odd and team.command(forward) == forward
    finally:
        dist.destroy_process_group()

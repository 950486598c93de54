"""Declarative plans: the glob dialect, validation of plan files, resolution to one policy per parameter and
its errors, the table and YAML. Pure: no process group."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import yaml

from lightning_vescale.engine.planner import TensorSpec, granularity_numel, plan_buffer
from lightning_vescale.models.families import FAMILIES
from lightning_vescale.parallel.parallelize import resolve_for
from lightning_vescale.plan import Plan, PlanError, default_plan, load_plan, plan_from_modules, resolve_plan
from lightning_vescale.plan._glob import glob_matches
from lightning_vescale.plan._layout import group_layouts
from tests.toy_models import MLP, TinyTransformer


def meta(family: str, preset: str) -> nn.Module:
    with torch.device("meta"):
        return FAMILIES[family].model_cls(FAMILIES[family].preset(preset))


@pytest.mark.parametrize(
    "pattern, name, expected",
    [
        ("layers.*", "layers.0", True),
        ("layers.*", "layers.0.attention", False),  # fnmatch's '*' would cross the dot
        ("**.weight", "weight", True),
        ("**.weight", "layers.0.attention.wq.weight", True),
        ("**.layers.*", "model.layers.3", True),
        ("**.layers.*", "layers.3", True),
        ("**.layers.*", "model.layers.3.ffn", False),
        ("layers.**", "layers", True),
        ("layers.**", "layers.0.ffn.w1", True),
        ("layers.**", "layersx", False),
        ("a.**.b", "a.b", True),
        ("a.**.b", "a.x.y.b", True),
        ("layers.[0-3].*", "layers.2.ffn", True),
        ("layers.[0-3].*", "layers.12.ffn", False),
        ("**.w?", "ffn.w1", True),
        ("", "", True),
        ("**", "", True),
        ("*", "", False),
        ("", "layers", False),
    ],
)
def test_glob(pattern: str, name: str, expected: bool) -> None:
    assert glob_matches(pattern, name) is expected


def test_plan_rejects_unknown_keys_and_values() -> None:
    with pytest.raises(PlanError, match=r"rule #2 \(match: 'x'\): unknown key\(s\) 'granularty' \(did you mean 'granularity'\?\)"):
        Plan.from_dict({"rules": [{"match": "a", "group": True}, {"match": "x", "granularty": "row"}]})
    with pytest.raises(PlanError, match=r"plan: unknown key\(s\) 'rule'"):
        Plan.from_dict({"rule": []})
    with pytest.raises(PlanError, match=r"rule #1 \(match: 'x'\): granularity must be one of .* got 'rows'"):
        Plan.from_dict({"rules": [{"match": "x", "granularity": "rows"}]})
    with pytest.raises(PlanError, match=r"unknown dtype 'bf17'"):
        Plan.from_dict({"rules": [{"match": "x", "param_dtype": "bf17"}]})
    with pytest.raises(PlanError, match=r"rule #1 \(match: 'x'\) sets nothing"):
        Plan.from_dict({"rules": [{"match": "x"}]})
    with pytest.raises(PlanError, match=r"rule #1 has no 'match'"):
        Plan.from_dict({"rules": [{"group": True}]})
    with pytest.raises(PlanError, match=r"version 2 is not supported"):
        Plan.from_dict({"version": 2, "rules": []})
    with pytest.raises(PlanError, match=r"'\*\*' must be a whole name segment"):
        Plan.from_dict({"rules": [{"match": "layers**", "group": True}]})
    with pytest.raises(PlanError, match=r"fallback: unknown key\(s\) 'group'"):
        Plan.from_dict({"fallback": {"group": True}, "rules": []})


TIER_PLAN = {"name": "tiers", "rules": [
    {"match": "blocks.*", "group": True},
    {"match": "blocks.0", "tier": "disk"},
    {"match": "blocks.1", "tier": {"optimizer_states": "disk"}},
    {"match": "blocks.1.**", "tier": {"params": "host", "grads": "host"}},  # combines with rule #3 per class
]}


def test_tiers_resolve_per_class_print_and_round_trip() -> None:
    resolved = resolve_plan(MLP(), TIER_PLAN)
    assert resolved.policy("blocks.0.up.weight").tier_setting == "disk"
    assert dict(resolved.policy("blocks.1.down.bias").tier) == {"params": "host", "grads": "host",
                                                                "optimizer_states": "disk"}
    assert resolved.policy("blocks.1.up.weight").sources["tier"] == "params rule #4; grads rule #4; optimizer_states rule #3"
    assert resolved.policy("out.weight").tier == {} and resolved.policy("out.weight").tier_of("params") is None
    table = resolved.table(params=True)
    assert "params=host,grads=host,optimizer_states=disk" in table and "tier" in table.splitlines()[1]
    plan = Plan.from_dict(TIER_PLAN)
    assert Plan.from_dict(yaml.safe_load(plan.to_yaml())) == plan
    data = yaml.safe_load(resolved.to_yaml())
    assert data["params"]["blocks.0.up.weight"]["tier"] == "disk" and "tier" not in data["params"]["out.weight"]
    assert plan.tier_settings() == [("rule #2 (match: 'blocks.0')", dict.fromkeys(("params", "grads", "optimizer_states"),
                                                                                 "disk")),
                                    ("rule #3 (match: 'blocks.1')", {"optimizer_states": "disk"}),
                                    ("rule #4 (match: 'blocks.1.**')", {"params": "host", "grads": "host"})]
    with pytest.raises(PlanError, match=r"rule #1 \(match: 'x'\): tier must be one of device, host, disk"):
        Plan.from_dict({"rules": [{"match": "x", "tier": "nvme"}]})
    with pytest.raises(PlanError, match=r"tier: unknown key\(s\) 'param' \(did you mean 'params'\?\)"):
        Plan.from_dict({"rules": [{"match": "x", "tier": {"param": "disk"}}]})


def test_tiers_that_split_a_buffer_are_a_conflict_naming_the_rules_and_the_group() -> None:
    plan = {"rules": [{"match": "blocks.*", "group": True}, {"match": "blocks.0.up", "tier": "disk"},
                      {"match": "blocks.0.down", "tier": {"params": "host", "optimizer_states": "disk"}}]}
    with pytest.raises(PlanError) as err:
        resolve_plan(MLP(), plan)
    message = str(err.value)
    assert ("conflict on the params tier of group 'blocks.0' (float32, trainable): blocks.0.up.weight gets disk from "
            "rule #2 (match: 'blocks.0.up') but blocks.0.down.weight gets host from rule #3 (match: 'blocks.0.down')"
            in message)
    assert "conflict on the grads tier of group 'blocks.0'" in message and "gets none (the memory policy's)" in message
    # Optimizer states are placed per parameter: no conflict.
    plan["rules"][2]["tier"] = {"params": "disk", "grads": "disk", "optimizer_states": "device"}
    assert resolve_plan(MLP(), plan).policy("blocks.0.down.weight").tier_of("optimizer_states") == "device"


def test_a_disk_tier_without_a_disk_dir_stops_before_anything_starts(tmp_path) -> None:
    from lightning_vescale.lightning import VeScaleStrategy
    from lightning_vescale.memory import MemoryPolicy, check_plan_tiers

    with pytest.raises(ValueError, match=r"VeScaleStrategy: the plan 'tiers' puts state on the disk tier \(rule #2 "
                                         r"\(match: 'blocks.0'\) puts grads, optimizer_states, params on disk; rule #3 .*"
                                         r"no memory policy is given: pass MemoryPolicy\(disk_dir="):
        VeScaleStrategy(plan=TIER_PLAN).check_plan()  # Trainer.fit calls it before launching any process
    with pytest.raises(ValueError, match="the memory policy names no disk_dir"):
        VeScaleStrategy(plan=TIER_PLAN, memory=MemoryPolicy(optimizer_states="host"))
    check_plan_tiers(TIER_PLAN, MemoryPolicy(disk_dir=str(tmp_path / "swap")), "here")
    check_plan_tiers({"rules": [{"match": "x", "tier": {"params": "host"}}]}, None, "here")  # no disk: fine


def test_default_plan_groups_every_block_innermost_first() -> None:
    model = meta("llama", "tiny")
    resolved = resolve_plan(model)
    assert default_plan(model).to_dict()["rules"] == [
        {"match": "tok_embeddings", "group": True},
        {"match": "layers.*", "group": True},
    ]
    assert [g.name for g in resolved.groups] == ["layers.1", "layers.0", "tok_embeddings", ""]
    assert resolved.groups[-1].is_root
    assert {p.group for p in resolved.params.values()} == {"layers.0", "layers.1", "tok_embeddings", ""}
    assert resolved.policy("layers.0.attention.wq.weight").group == "layers.0"
    assert resolved.policy("tok_embeddings.weight").group == "tok_embeddings"
    assert resolved.policy("output.weight").group == ""
    assert len(resolved.params) == len(list(model.parameters()))


def test_default_plan_keeps_a_visibly_tied_embedding_in_the_root() -> None:
    model = nn.Module()
    model.tok_embeddings = nn.Embedding(16, 8)
    model.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
    model.output = nn.Linear(8, 16, bias=False)
    model.output.weight = model.tok_embeddings.weight
    assert [r["match"] for r in default_plan(model).to_dict()["rules"]] == ["layers.*"]


def test_rule_matching_nothing_names_the_rule_and_close_names() -> None:
    plan = {"rules": [{"match": "layers.*", "group": True}, {"match": "layers.*.atention.**", "granularity": "row"}]}
    with pytest.raises(PlanError, match=r"rule #2 \(match: 'layers.\*.atention.\*\*'\) matches no module or parameter "
                                        r"of Llama.*close names: layers.0.attention"):
        resolve_plan(meta("llama", "tiny"), plan)


def test_plan_for_another_model_names_every_rule_that_matches_nothing() -> None:
    with pytest.raises(PlanError, match=r"(?s)to Llama \(2 problem\(s\)\).*rule #2 .*experts.*rule #5 .*router"):
        resolve_plan(meta("llama", "tiny"), load_plan("moe"))


def test_conflicting_rules_are_an_error_naming_both() -> None:
    plan = {"rules": [{"match": "**.weight", "granularity": "row"}, {"match": "layers.0.**", "granularity": "tensor"}]}
    with pytest.raises(PlanError, match=r"conflict on parameter 'layers.0.attention_norm.weight': rule #1 .* sets "
                                        r"granularity='row' but rule #2 .* sets granularity='tensor'.*override: true"):
        resolve_plan(meta("llama", "tiny"), plan)


def test_override_lets_the_later_rule_win_and_equal_values_do_not_conflict() -> None:
    plan = {"rules": [{"match": "**.weight", "granularity": "row"},
                      {"match": "layers.0.**", "granularity": "tensor", "override": True},
                      {"match": "layers.1.ffn_norm", "granularity": "row"}]}
    resolved = resolve_plan(meta("llama", "tiny"), plan)
    assert resolved.policy("layers.0.feed_forward.w1.weight").granularity == "tensor"
    assert resolved.policy("layers.0.feed_forward.w1.weight").sources["granularity"] == "rule #2"
    assert resolved.policy("layers.1.ffn_norm.weight").granularity == "row"
    assert resolved.policy("layers.1.ffn_norm.weight").sources["granularity"] == "rule #1"


def test_required_field_uncovered_lists_the_parameters() -> None:
    plan = {"require": ["optimizer"], "rules": [{"match": "layers.*", "group": True},
                                                 {"match": "layers.**", "optimizer": "muon"}]}
    with pytest.raises(PlanError, match=r"requires every parameter to get optimizer from a rule, but no rule covers 3: "
                                        r"tok_embeddings.weight, norm.weight, output.weight"):
        resolve_plan(meta("llama", "tiny"), plan)


def test_group_settings_need_a_group_module() -> None:
    with pytest.raises(PlanError, match=r"rule #1 .* sets prefetch \(per group\) but matches only parameters"):
        resolve_plan(meta("llama", "tiny"), {"rules": [{"match": "**.weight", "prefetch": 2}]})
    with pytest.raises(PlanError, match=r"sets reshard_after_forward \(per group\) but none of the modules it matches "
                                        r"is a group"):
        resolve_plan(meta("llama", "tiny"), {"rules": [{"match": "layers.*.attention", "reshard_after_forward": False}]})
    with pytest.raises(PlanError, match=r"ModuleList is never called.*make its elements groups \('layers.\*'\)"):
        resolve_plan(meta("llama", "tiny"), {"rules": [{"match": "layers", "group": True}]})


def test_group_settings_apply_to_their_groups() -> None:
    plan = {"fallback": {"prefetch": 2}, "rules": [
        {"match": "layers.*", "group": True}, {"match": "layers.1", "reshard_after_forward": False, "prefetch": 0},
        {"match": "", "param_dtype": "bf16"}]}
    resolved = resolve_plan(meta("llama", "tiny"), plan)
    one, zero, root = resolved.group("layers.1"), resolved.group("layers.0"), resolved.group("")
    assert (one.reshard_after_forward, one.prefetch) == (False, 0)
    assert (zero.reshard_after_forward, zero.prefetch, zero.sources["prefetch"]) == (True, 2, "plan fallback")
    assert (root.param_dtype, zero.param_dtype) == ("bfloat16", None)


def test_tie_across_groups_is_an_error_and_within_a_group_is_not() -> None:
    model = TinyTransformer()  # head.weight is tok.weight
    resolved = resolve_plan(model)  # both uses in the root group
    assert resolved.policy("tok.weight").aliases == ("head.weight",)
    with pytest.raises(PlanError, match=r"parameter tok.weight is tied across groups: tok.weight \(group 'tok'\), "
                                        r"head.weight \(group '<root>'\)"):
        resolve_plan(model, {"rules": [{"match": "layers.*", "group": True}, {"match": "tok", "group": True}]})


def test_muon_granularity_follows_the_plans_routing() -> None:
    model = meta("moe", "tiny")
    plan = {"fallback": {"granularity": "muon"}, "rules": [
        {"match": "layers.*", "group": True}, {"match": "layers.0.attention.wq.weight", "optimizer": "adamw"}]}
    resolved = resolve_plan(model, plan)
    assert resolved.policy("layers.1.attention.wq.weight").granularity == "matrix"  # a Muon matrix: whole
    assert resolved.policy("layers.0.attention.wq.weight").granularity == "element"  # routed to AdamW by the plan
    assert resolved.policy("layers.0.feed_forward.experts.w1_EDF").granularity == "matrix"  # each expert whole
    assert resolved.policy("tok_embeddings.weight").granularity == "element"
    assert resolved.policy("layers.0.attention.wq.weight").optimizer == "adamw"


def test_a_granularity_that_is_not_one_names_the_rule() -> None:
    plan = {"rules": [{"match": "layers.*.attention.wk.weight", "granularity": "rows"}]}
    with pytest.raises(PlanError, match=r"rule #1 \(match: 'layers.\*.attention.wk.weight'\): granularity must be one "
                                        r"of element, row, matrix, tensor, muon, elements:<n> \(blocks of n elements, "
                                        r"AdamW8bit's\) or a positive number of rows, got 'rows'"):
        resolve_plan(meta("llama", "tiny"), plan)
    # A block of rows that does not divide a matrix's rows keeps a shorter last block (issue 16): accepted.
    plan = {"rules": [{"match": "layers.*.attention.wk.weight", "granularity": 24}]}
    assert resolve_plan(meta("llama", "tiny"), plan).policy("layers.0.attention.wk.weight").granularity == 24


def test_precedence_rule_attribute_fallback_caller_library() -> None:
    model = MLP()
    model.blocks[0].up.weight._vescale_granularity = "row"
    plan = {"fallback": {"granularity": "tensor"}, "rules": [{"match": "out.weight", "granularity": "row"}]}
    resolved = resolve_plan(model, plan, defaults={"granularity": 1, "prefetch": 3})
    sources = {n: (p.granularity, p.sources["granularity"]) for n, p in resolved.params.items()}
    assert sources["out.weight"] == ("row", "rule #1")
    assert sources["blocks.0.up.weight"] == ("row", "parameter attribute _vescale_granularity")
    assert sources["inp.weight"] == ("tensor", "plan fallback")
    assert resolve_plan(model, {"rules": []}, defaults={"granularity": 1}).policy("inp.weight").granularity == 1
    assert resolve_plan(model, {"rules": []}).policy("inp.weight").sources["granularity"] == "library default"
    assert resolved.groups[0].prefetch == 3


def test_caller_granularity_mapping_uses_the_models_names() -> None:
    # The strategies' granularity mapping matches the model's own names, and a glob that matches none is refused.
    resolved = resolve_for(MLP(), None, granularity={"blocks.*.up.weight": "row"})
    assert resolved.policy("blocks.1.up.weight").granularity == "row"
    assert resolved.policy("blocks.1.down.weight").granularity == "element"
    with pytest.raises(ValueError, match=r"granularity pattern\(s\) \['up.weight'\] match no parameter of MLP"):
        resolve_for(MLP(), None, granularity={"up.weight": "row"})


def test_auto_wrap_policy_becomes_group_rules() -> None:
    model = MLP()
    plan = plan_from_modules(model, [model.blocks[0], model.blocks[1], model.blocks[2], model.out])
    assert plan.to_dict()["rules"] == [{"match": "blocks.*", "group": True}, {"match": "out", "group": True}]
    assert [g.name for g in resolve_plan(model, plan).groups] == ["out", "blocks.2", "blocks.1", "blocks.0", ""]


def test_plan_yaml_round_trip() -> None:
    plan = load_plan("moe")
    again = Plan.from_dict(yaml.safe_load(plan.to_yaml()))
    assert again == plan
    resolved = resolve_plan(meta("moe", "tiny"), plan)
    data = yaml.safe_load(resolved.to_yaml())
    assert set(data["params"]) == set(resolved.params)
    assert data["params"]["layers.0.feed_forward.experts.w1_EDF"]["optimizer"] == "muon"
    assert data["groups"]["layers.0.feed_forward.experts"]["params"][0] == "layers.0.feed_forward.experts.w1_EDF"
    assert Plan.from_dict(data["plan"]) == plan


def test_table_per_group_with_the_planners_padding() -> None:
    model = meta("llama", "tiny")
    resolved = resolve_plan(model, {"rules": [{"match": "layers.*", "group": True},
                                              {"match": "layers.*.**", "granularity": "row"}]})
    text = resolved.table(7)
    assert "layers.0" in text and "<root>" in text and "7 ranks" in text
    block = resolved.group("layers.0")
    specs = [TensorSpec(n.removeprefix("layers.0."), p.shape, granularity_numel(p.shape, "row"))
             for n, p in ((n, resolved.params[n]) for n in block.params)]
    alone = plan_buffer(specs, 7, alignment=4)
    (layout,) = group_layouts(resolved, block, 7)
    assert layout.plan.padding == alone.padding and layout.plan.shard_size == alone.shard_size
    assert f"{alone.padding / sum(s.numel for s in specs):.2%}" in text.splitlines()[4]


def test_load_plan_by_name_and_unknown_name() -> None:
    assert load_plan("llama").name == "llama"
    with pytest.raises(PlanError, match=r"no plan named 'lama': give a YAML file or one of .*llama.*moe"):
        load_plan("lama")


@pytest.mark.parametrize("family, preset, plan", [
    ("llama", "tiny", "llama"), ("llama", "70b", "llama"), ("moe", "tiny", "moe"), ("qwen3_moe", "tiny", "moe"),
    ("deepseek_v3", "tiny", "deepseek_v3"), ("deepseek_v3", "671b", "deepseek_v3"),
])
def test_shipped_plans_resolve_on_their_families(family: str, preset: str, plan: str) -> None:
    resolved = resolve_plan(meta(family, preset), load_plan(plan))
    n_layers = FAMILIES[family].preset(preset).n_layers
    assert sum(g.module_type == "TransformerBlock" for g in resolved.groups) == n_layers
    assert all(p.optimizer in ("muon", "adamw") for p in resolved.params.values())

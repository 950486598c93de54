"""Tensor parallelism declared in plans (``tp:`` rules) and the checks that run before any process group:
resolution, the table, bad styles and shapes, the strategies' arguments and the recipe's settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from lightning_vescale.lightning import VeScaleStrategy
from lightning_vescale.lightning._common import tensor_parallel_sampler_kwargs
from lightning_vescale.models import Llama, llama_config
from lightning_vescale.parallel.tensor_parallel import check_tensor_parallel
from lightning_vescale.plan import PlanError, load_plan, resolve_plan
from lightning_vescale.recipe.schema import validate

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def _llama(**overrides) -> Llama:
    config = llama_config("tiny")
    for k, v in overrides.items():
        setattr(config, k, v)
    with torch.device("meta"):
        return Llama(config)


def _plan(*rules: dict) -> dict:
    return {"rules": [{"match": "layers.*", "group": True}, *rules]}


def test_llama_plan_splits_attention_and_mlp_projections():
    resolved = resolve_plan(_llama(), load_plan("llama"))
    tp = resolved.tensor_parallel
    assert tp["layers.0.attention.wq"] == "colwise" and tp["layers.0.attention.wo"] == "rowwise"
    assert tp["layers.1.feed_forward.w3"] == "colwise" and tp["layers.1.feed_forward.w2"] == "rowwise"
    assert len(tp) == 2 * 7 and "tok_embeddings" not in tp and "output" not in tp
    assert resolved.to_dict()["tensor_parallel"] == dict(tp)


def test_table_shows_each_groups_tp_styles():
    table = resolve_plan(_llama(), load_plan("llama")).table()
    header, _, first = table.splitlines()[1:4]
    assert header.split()[-1] == "tp" and first.startswith("layers.1")
    assert "colwise x5, rowwise x2" in first


def test_unknown_tp_style_is_refused():
    with pytest.raises(PlanError, match=r"tp must be one of colwise, rowwise, sequence, heads, split_tokens, replicate \(or .*\), got .column."):
        load_plan(_plan({"match": "**.wq", "tp": "column"}))


def test_tp_on_a_parameter_names_the_module_to_match():
    with pytest.raises(PlanError, match=r"sets tp \(per module\) but matches only parameters"):
        resolve_plan(_llama(), _plan({"match": "**.attention.wq.weight", "tp": "colwise"}))


def test_colwise_on_a_block_is_refused():
    with pytest.raises(PlanError, match=r"module layers.0 \(TransformerBlock\) gets tp: colwise"):
        resolve_plan(_llama(), _plan({"match": "layers.0", "tp": "colwise"}))


def test_conflicting_tp_styles_need_override():
    conflict = _plan({"match": "**.attention.w*", "tp": "colwise"}, {"match": "**.attention.wo", "tp": "rowwise"})
    with pytest.raises(PlanError, match=r"conflict on module 'layers.0.attention.wo'.*tp='colwise'"):
        resolve_plan(_llama(), conflict)
    conflict["rules"][-1]["override"] = True
    assert resolve_plan(_llama(), conflict).tensor_parallel["layers.0.attention.wo"] == "rowwise"


def test_tp_is_no_fallback_field():
    with pytest.raises(PlanError, match=r"fallback: unknown key\(s\) 'tp'"):
        load_plan({"fallback": {"tp": "colwise"}, "rules": [{"match": "layers.*", "group": True}]})


def test_heads_not_divisible_by_tp_name_the_module_and_fix():
    model = _llama()
    styles = resolve_plan(model, load_plan("llama")).tensor_parallel
    check_tensor_parallel(model, styles, 2)  # 4 heads, 2 kv heads, dim 64, ffn 128
    with pytest.raises(ValueError, match=r"layers.0.attention \(Attention\) has n_kv_heads=2, not divisible by tp=4"):
        check_tensor_parallel(model, styles, 4)
    with pytest.raises(ValueError, match=r"layers.0.attention.wq \(Linear, tp: colwise\) has out_features=64, not "
                                         r"divisible by tp=3.*Choose a tensor-parallel size that divides them"):
        check_tensor_parallel(model, styles, 3)


def test_sampler_gives_one_tp_group_one_shard_of_the_data():
    shards = [tensor_parallel_sampler_kwargs(8, rank, 2) for rank in range(8)]
    assert [s["rank"] for s in shards] == [0, 0, 1, 1, 2, 2, 3, 3] and {s["num_replicas"] for s in shards} == {4}


def test_strategy_takes_tensor_parallel_with_expert_parallel_if_both_divide_the_world():
    from lightning_vescale.parallel.spmd import check_expert_parallel_size

    strategy = VeScaleStrategy(tensor_parallel_size=2, expert_parallel_size=2)
    assert (strategy.tensor_parallel_size, strategy.expert_parallel_size) == (2, 2)
    check_expert_parallel_size(2, 8, 2)
    with pytest.raises(ValueError, match=r"expert_parallel_size=2 times tensor_parallel_size=2 does not divide the "
                                         r"world size 6.*\('dp', 'ep', 'tp'\) mesh"):
        check_expert_parallel_size(2, 6, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int, got 0"):
        VeScaleStrategy(tensor_parallel_size=0)


@pytest.fixture(scope="module")
def hydra_configs():
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        yield


@pytest.mark.usefixtures("hydra_configs")
def test_recipe_takes_a_tensor_parallel_size():
    cfg = validate(compose("train", overrides=["trainer.devices=4", "strategy.tensor_parallel_size=2", "plan=llama"]))
    assert cfg.strategy.tensor_parallel_size == 2


@pytest.mark.usefixtures("hydra_configs")
@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.devices=4", "strategy.tensor_parallel_size=3", "plan=llama"],
     r"strategy.tensor_parallel_size=3 does not divide the world size 4 .*use one of 1, 2, 4"),
    (["trainer.devices=4", "strategy.tensor_parallel_size=4", "plan=llama"],
     r"does not divide model=llama_tiny's n_kv_heads=2"),
    (["trainer.devices=4", "strategy.tensor_parallel_size=2"], r"needs a plan whose tp rules .*add plan=llama"),
])
def test_recipe_refuses_bad_tensor_parallel_settings(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(compose("train", overrides=overrides))


def test_dry_run_sizes_a_tensor_parallel_mesh(capsys):
    from lightning_vescale.plan.__main__ import main

    assert main(["model=llama_70b", "world_size=16384", "tp=8", "hardware=h200"]) == 0
    out = capsys.readouterr().out
    assert "(tp=8 without plan=: using plan 'llama', whose tp rules split the model)" in out
    assert "mesh: 2-D (dp=2048, tp=8)" in out and "all-reduce tp/step" in out
    assert "llama_70b (70.55B parameters)" in out, "the parameter count is the whole model's, not one tp rank's"


def test_dry_run_tp_errors_name_the_fix(capsys):
    from lightning_vescale.plan.__main__ import main

    assert main(["model=llama_tiny", "world_size=4", "plan=llama", "tp=3"]) == 2
    assert "tp=3 does not divide world_size=4" in capsys.readouterr().err
    assert main(["model=llama_tiny", "world_size=4", "plan=llama_offload", "tp=2"]) == 2  # a plan without tp rules
    assert "splits no module over tp: give a plan with tp rules (e.g. plan=llama)" in capsys.readouterr().err
    assert main(["model=llama_tiny", "world_size=8", "plan=llama", "tp=4"]) == 2
    assert "n_kv_heads=2, not divisible by tp=4" in capsys.readouterr().err


def test_sequence_parallel_plan_states_each_projections_layouts():
    resolved = resolve_plan(_llama(), load_plan("llama_sp"))
    tp = resolved.tensor_parallel
    assert tp["layers.0.attention_norm"] == "sequence" and tp["norm"] == "sequence"
    assert tp["layers.0.attention.wq"] == {"style": "colwise", "input": "sequence"}
    assert tp["tok_embeddings"] == {"style": "rowwise", "input": "replicate", "output": "sequence"}
    assert "colwise(in=sequence) x5, sequence x2, rowwise(out=sequence) x2" in resolved.table()


def test_tp_layouts_are_checked():
    with pytest.raises(PlanError, match=r"tp input / output must be one of replicate, sequence, split, got \{'input': 'seq'\}"):
        load_plan(_plan({"match": "**.wq", "tp": {"style": "colwise", "input": "seq"}}))
    with pytest.raises(PlanError, match=r"tp as a mapping needs style: colwise, rowwise or split_tokens"):
        load_plan(_plan({"match": "**.norm", "tp": {"style": "sequence"}}))


def test_dry_run_sizes_sequence_parallel(capsys):
    from lightning_vescale.plan.__main__ import main

    assert main(["model=llama_tiny", "world_size=4", "plan=llama_sp", "tp=2"]) == 0
    out = capsys.readouterr().out
    assert "all-gather tp/step" in out and "reduce-scatter tp/step" in out


def test_sequence_parallel_activations_norms_at_one_tp_share_and_a_copy_per_gather():
    from lightning_vescale.plan._activations import SequenceParallel, activation_profile
    from lightning_vescale.plan._tensor_parallel import sequence_parallel, tensor_parallel_view

    model = _llama()  # tiny: 2 layers, dim 64, vocabulary 256
    local, _ = tensor_parallel_view(model, resolve_plan(model, load_plan("llama_sp")), 2)
    sp = sequence_parallel(local)
    assert sp is not None and sp.sequence == {"norm", *(f"layers.{i}.{n}" for i in range(2)
                                                         for n in ("attention_norm", "ffn_norm"))}
    assert sp.gather_output == {"output"} and len(sp.gather_input) == 2 * 5 + 1

    def count(sequence_parallel=None, **parts) -> float:
        return activation_profile(local, compute_dtype=torch.float32,
                                  sequence_parallel=sequence_parallel or SequenceParallel(2, **parts))[""]

    whole = activation_profile(local, compute_dtype=torch.float32)[""]
    norms_whole = whole - count(SequenceParallel(10**9, sequence=sp.sequence))
    assert norms_whole > 0 and count(sequence=sp.sequence) == pytest.approx(whole - norms_whole / 2)
    # Per token: q, k and v each save a gathered copy of the attention input, w1 and w3 of the feed-forward input,
    # where the tp rank's model without sequence parallelism saves one of each (fp32, dim 64): 3 more per layer.
    assert count(gather_input=sp.gather_input) - whole == 2 * 3 * 64 * 4
    # The head's logits gathered to the whole vocabulary (256, not the tp rank's 128): the loss's log-probabilities.
    assert count(gather_output=sp.gather_output) - whole == (256 - 128) * 4
    assert count(sp) == pytest.approx(whole - norms_whole / 2 + 2 * 3 * 64 * 4 + (256 - 128) * 4)


def test_dry_run_refuses_layouts_nothing_measured(capsys):
    from lightning_vescale.plan._tensor_parallel import tensor_parallel_view

    model = _llama()
    plan = _plan({"match": "**.attention.wq", "tp": {"style": "colwise", "output": "sequence"}})
    with pytest.raises(PlanError, match=r"layers.0.attention.wq: tp \{style: colwise, input: replicate, output: sequence\}"
                                        r" is a layout the dry run does not size"):
        tensor_parallel_view(model, resolve_plan(model, plan), 2)


def test_whole_parameters_beside_split_projections_are_refused():
    """Qwen3's per-head norms need tp: heads (the moe plan gives it); DeepSeek-V3's latent attention split by heads
    would leave wq_a / wkv_a whole beside split projections, their gradients covering one rank's heads."""
    import dataclasses

    from lightning_vescale.models.families import FAMILIES
    from lightning_vescale.plan import Plan

    def meta(family: str):
        with torch.device("meta"):
            return FAMILIES[family].model_cls(FAMILIES[family].preset("tiny"))

    qwen = meta("qwen3_moe")
    resolved = resolve_plan(qwen, load_plan("moe"))
    assert resolved.tensor_parallel["layers.0.attention.q_norm"] == "heads"
    check_tensor_parallel(qwen, resolved.tensor_parallel, 2)
    without_heads = {n: s for n, s in resolved.tensor_parallel.items() if s != "heads"}
    with pytest.raises(ValueError, match=r"layers.0.attention.q_norm \(RMSNorm\) holds whole parameters inside "
                                         r"layers.0.attention.*tp: heads for a per-head norm"):
        check_tensor_parallel(qwen, without_heads, 2)
    deepseek = meta("deepseek_v3")
    plan = load_plan("deepseek_v3")
    split = Plan.from_dict({"rules": [{"match": "**.layers.*.attention.w*_b", "tp": "colwise"},
                                      {"match": "**.layers.*.attention.wo", "tp": "rowwise"}]})
    resolved = resolve_plan(deepseek, dataclasses.replace(plan, rules=plan.rules + split.rules))
    with pytest.raises(ValueError, match=r"layers.0.attention.wq_a \(Linear\) holds whole parameters"):
        check_tensor_parallel(deepseek, resolved.tensor_parallel, 2)


def test_dry_run_of_a_moe_family_without_a_plan_of_its_own_takes_the_moe_plan(capsys):
    from lightning_vescale.plan.__main__ import main

    assert main(["model=qwen3_moe_tiny", "world_size=4", "tp=2"]) == 0
    out = capsys.readouterr().out
    assert "(tp=2 without plan=: using plan 'moe', whose tp rules split the model)" in out
    assert "mesh: 2-D (dp=2, tp=2)" in out

"""Granularity by name: globs over the model's own names, checked at once; parameters swapped after the
mapping was built (expert parallelism replaces each expert stack by this rank's block) keep their names."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import lightning_vescale as lv
from lightning_vescale.optim import muon_granularity


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4, 6, 5))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 6)
        self.experts = Experts()


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.norm = nn.Parameter(torch.ones(5))


def test_globs_match_model_names_first_match_wins() -> None:
    model = Model()
    model.norm._vescale_granularity = "tensor"
    gran = lv.granularity_by_pattern(model, {"layers.0.*": "row", "layers.*.experts.*": 16, "*.bias": "element"})
    # fully_shard passes names relative to the module it shards; the model-level name decides.
    assert gran("w1", model.layers[0].experts.w1) == "row"  # the first glob matching wins
    assert gran("w1", model.layers[1].experts.w1) == 16
    assert gran("proj.weight", model.layers[1].proj.weight) == "element"  # no glob: the default
    assert gran("norm", model.norm) == "tensor"  # no glob: the parameter's own declaration
    assert sorted(gran.matched) == ["layers.*.experts.*", "layers.0.*"]


def test_a_glob_matching_nothing_is_named() -> None:
    with pytest.raises(ValueError, match=r"pattern\(s\) \['layers\.\*\.mlp\.\*'\] match no parameter of Model"):
        lv.granularity_by_pattern(Model(), {"layers.*.experts.*": 16, "layers.*.mlp.*": "row"})
    with pytest.raises(TypeError, match="keys must be name globs"):
        lv.granularity_by_pattern(Model(), {16: "row"})


def test_swapped_parameters_keep_their_model_names() -> None:
    model = Model()
    gran = lv.granularity_by_pattern(model, {"layers.*.experts.*": 16})
    muon = muon_granularity(model)
    experts = model.layers[1].experts
    experts.w1 = nn.Parameter(experts.w1.detach()[2:].clone())  # as apply_expert_parallel does
    assert gran("w1", experts.w1) == 16
    assert muon("w1", experts.w1) == "matrix"  # still an expert stack (by its name), whole per expert


def test_a_tied_parameter_answers_to_each_of_its_names() -> None:
    model = nn.Module()
    model.embed = nn.Embedding(7, 5)
    model.head = nn.Linear(5, 7, bias=False)
    model.head.weight = model.embed.weight
    gran = lv.granularity_by_pattern(model, {"head.weight": "row"})  # the second name of the tied weight
    assert gran("weight", model.embed.weight) == "row"

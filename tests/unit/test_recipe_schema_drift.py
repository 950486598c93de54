"""The recipe schema's configs against the components they configure: every field is an argument of the component
(Hydra passes them as keyword arguments), defaults are the component's unless the recipe chooses its own (listed
here, with the reason), and the recipe's checks accept what the component accepts. A new argument or rule of a
component fails here until the schema takes it, or a line here says why it does not.

``MemoryConfig`` against ``MemoryPolicy``: tests/unit/test_memory_policy.py.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import pytest
import torch

from lightning_vescale.recipe.schema import (
    AdamW8bitConfig,
    AdamWConfig,
    DataConfig,
    DDPStrategyConfig,
    ModelParallelStrategyConfig,
    MuonConfig,
    QuantConfig,
    VeScaleStrategyConfig,
)


def _fields(config_cls: type) -> dict[str, Any]:
    """A schema's fields and their defaults (``_target_``, the component's name, left out)."""
    out = {}
    for f in dataclasses.fields(config_cls):
        if f.name != "_target_":
            out[f.name] = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
    return out


def _arguments(component: Callable) -> dict[str, Any]:
    """A component's keyword arguments and their defaults (``inspect.Parameter.empty``: required)."""
    return {name: p.default for name, p in inspect.signature(component).parameters.items()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _refuses(build: Callable[[], Any]) -> bool:
    try:
        build()
    except ValueError:
        return True
    return False


def _check_mirror(config_cls: type, component: Callable, *, own_defaults: set[str], not_exposed: set[str]) -> None:
    fields, arguments = _fields(config_cls), _arguments(component)
    assert set(fields) <= set(arguments), f"{config_cls.__name__} has keys {component.__name__} does not take"
    assert set(arguments) - set(fields) == not_exposed, f"{component.__name__} arguments the schema does not hold"
    for name, value in fields.items():
        if name not in own_defaults:
            want = arguments[name]
            assert (tuple(value) == tuple(want)) if isinstance(want, tuple) else value == want, name


# ---------------------------------------------------------------------------------------------------------
# Optimizers


def test_adamw_config_holds_torch_adamw_arguments():
    # The recipe's defaults are its own (a language-model AdamW: lr 3e-3, betas (0.9, 0.95), weight decay 0.1).
    _check_mirror(AdamWConfig, torch.optim.AdamW, own_defaults={"lr", "betas", "weight_decay"},
                  not_exposed={"params", "amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused"})


def test_adamw8bit_config_holds_adamw8bit_arguments_and_defaults():
    from lightning_vescale.optim import AdamW8bit

    _check_mirror(AdamW8bitConfig, AdamW8bit, own_defaults={"lr", "betas", "weight_decay"},  # AdamWConfig's
                  not_exposed={"params", "maximize"})


@pytest.mark.parametrize("block_size,min_8bit_size", [(256, 1024), (1, 0), (0, 1024), (-4, 1024), (256, -1)])
def test_adamw8bit_config_refuses_what_adamw8bit_refuses(block_size, min_8bit_size):
    from lightning_vescale.optim import AdamW8bit

    p = torch.nn.Parameter(torch.zeros(4))
    assert _refuses(lambda: AdamW8bitConfig(block_size=block_size, min_8bit_size=min_8bit_size)) == _refuses(
        lambda: AdamW8bit([p], block_size=block_size, min_8bit_size=min_8bit_size))


def test_muon_config_holds_build_optimizer_arguments_and_defaults():
    from lightning_vescale.optim import build_optimizer

    # lr is required by the factory; muon_lr and weight_decay are the recipe's choices for the tiny models.
    _check_mirror(MuonConfig, build_optimizer, own_defaults={"lr", "muon_lr", "weight_decay"},
                  not_exposed={"model", "adamw_eps", "ns_coefficients", "eps", "muon_patterns", "adamw_patterns",
                               "expert_patterns", "cost_model"})


@pytest.mark.parametrize("kwargs", [{"adjust_lr_fn": None}, {"adjust_lr_fn": "original"},
                                    {"adjust_lr_fn": "match_rms_adamw"}, {"adjust_lr_fn": "sqrt"}, {"mode": "auto"},
                                    {"mode": "local"}, {"mode": "gather"}, {"mode": "owner"}])
def test_muon_config_takes_the_values_muon_takes(kwargs):
    from lightning_vescale.optim import Muon

    matrix = torch.nn.Parameter(torch.zeros(4, 4))
    assert _refuses(lambda: MuonConfig(**kwargs)) == _refuses(lambda: Muon([matrix], **kwargs))


# ---------------------------------------------------------------------------------------------------------
# Block-quantized weights


def test_quant_config_defaults_are_the_components():
    from lightning_vescale.quant import BlockFormat, quantize_all_gather, quantize_frozen_weights
    from lightning_vescale.quant.lora import LoRAConfig

    quant = QuantConfig(mode="qlora")
    assert quant.block_format() == BlockFormat()
    assert quant.lora_config() == LoRAConfig()
    for component in (quantize_all_gather, quantize_frozen_weights):
        assert tuple(quant.targets) == _arguments(component)["targets"]
    # exclude is the recipe's: embeddings, the head and MoE routers stay unquantized (the functions exclude none).


@pytest.mark.parametrize("kwargs", [{}, {"format": "int8"}, {"format": "int4"}, {"block_size": 0},
                                    {"block_size": 64}, {"lora_rank": 0}, {"lora_alpha": 0.0}, {"lora_targets": []}])
def test_quant_config_refuses_what_the_components_refuse(kwargs):
    from lightning_vescale.quant import BlockFormat
    from lightning_vescale.quant.lora import LoRAConfig

    fmt = {"kind": kwargs.get("format", "fp8_e4m3"), "block_size": kwargs.get("block_size", 128)}
    lora = {"rank": kwargs.get("lora_rank", 8), "alpha": kwargs.get("lora_alpha", 16.0),
            "targets": tuple(kwargs.get("lora_targets", ("*attention.w*",)))}
    assert _refuses(lambda: QuantConfig(mode="qlora", **kwargs)) == _refuses(
        lambda: (BlockFormat(**fmt), LoRAConfig(**lora)))


def test_quant_config_runs_the_components_checks(monkeypatch):
    """A rule added to BlockFormat or LoRAConfig stops a recipe before the run, with no copy in the schema."""
    from lightning_vescale.quant import BlockFormat
    from lightning_vescale.quant.lora import LoRAConfig

    def refuse(self):
        raise ValueError(f"a new rule of {type(self).__name__}")

    QuantConfig(mode="gather")
    monkeypatch.setattr(BlockFormat, "__post_init__", refuse)
    with pytest.raises(ValueError, match="a new rule of BlockFormat"):
        QuantConfig(mode="gather")
    monkeypatch.undo()
    monkeypatch.setattr(LoRAConfig, "__post_init__", refuse)
    QuantConfig(mode="gather")  # no adapters
    with pytest.raises(ValueError, match="a new rule of LoRAConfig"):
        QuantConfig(mode="qlora")


# ---------------------------------------------------------------------------------------------------------
# Strategies


def test_vescale_strategy_config_holds_the_strategys_arguments_and_defaults():
    from lightning_vescale.lightning import VeScaleStrategy

    # restore_rng_states: a resumed recipe run equals the uninterrupted one (the strategy keeps Lightning's False).
    # plan and memory are top-level recipe sections; the rest are objects a YAML file cannot hold.
    _check_mirror(VeScaleStrategyConfig, VeScaleStrategy, own_defaults={"restore_rng_states"},
                  not_exposed={"plan", "memory", "auto_wrap_policy", "mp_policy", "accelerator", "parallel_devices",
                               "cluster_environment", "checkpoint_io", "precision_plugin"})


_SIZES = [None, "auto", 1, 2, 0, -1, "two"]


@pytest.mark.parametrize("replicate_size", _SIZES)
@pytest.mark.parametrize("expert_parallel_size", [1, 2, 0])
@pytest.mark.parametrize("tensor_parallel_size", [1, 2, 0])
def test_vescale_strategy_config_accepts_what_the_strategy_accepts(replicate_size, expert_parallel_size,
                                                                   tensor_parallel_size):
    from lightning_vescale.lightning import VeScaleStrategy

    kwargs = dict(replicate_size=replicate_size, expert_parallel_size=expert_parallel_size,
                  tensor_parallel_size=tensor_parallel_size)
    assert _refuses(lambda: VeScaleStrategyConfig(**kwargs)) == _refuses(lambda: VeScaleStrategy(**kwargs))


@pytest.mark.parametrize("granularity", ["element", "row", "matrix", "tensor", "muon", 3, "elements:256",
                                         "elements:0", "rows", 0, True])
def test_vescale_strategy_config_takes_the_granularities_a_plan_takes(granularity):
    from lightning_vescale.plan import Plan

    rule = {"rules": [{"match": "**", "granularity": granularity}]}
    assert _refuses(lambda: VeScaleStrategyConfig(granularity=granularity)) == _refuses(lambda: Plan.from_dict(rule))


def test_lightning_strategy_configs_hold_their_strategys_arguments():
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    ddp = set(_fields(DDPStrategyConfig)) - {"find_unused_parameters"}  # a DistributedDataParallel argument (**kwargs)
    assert ddp <= set(_arguments(DDPStrategy))
    # data_parallel_size null: the recipe's world size; tensor_parallel_size 1: the recipe applies FSDP2 only;
    # timeout null: Lightning's default (the recipe passes seconds only when set). process_group_backend is not a
    # key yet (Lightning picks gloo on CPU, nccl on CUDA; adding it would change saved run configs).
    _check_mirror(ModelParallelStrategyConfig, ModelParallelStrategy,
                  own_defaults={"data_parallel_size", "tensor_parallel_size", "timeout"},
                  not_exposed={"process_group_backend"})


# ---------------------------------------------------------------------------------------------------------
# Data


def test_data_config_holds_the_datamodules_arguments_and_defaults():
    from lightning_vescale.data.datamodule import TextDataModule

    # path is required (???) so data=text_file without data.path names it; seed is the run's top-level seed.
    _check_mirror(DataConfig, TextDataModule, own_defaults={"path"}, not_exposed={"seed"})


@pytest.mark.parametrize("kwargs", [{}, {"tokenizer": "wordpiece"}, {"bpe_vocab_size": 255}, {"seq_len": 0},
                                    {"batch_size": 0}, {"val_fraction": 0.0}, {"val_fraction": 1.0},
                                    {"stride": 0}, {"num_workers": -1}])
def test_data_config_refuses_what_the_datamodule_refuses(kwargs):
    from lightning_vescale.data.datamodule import TextDataModule

    assert _refuses(lambda: DataConfig(path=None, **kwargs)) == _refuses(lambda: TextDataModule(None, **kwargs))

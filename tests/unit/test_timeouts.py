"""The process-group timeout: the strategies' argument, its defaults, and ``strategy.timeout`` in the recipes."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from lightning_vescale.lightning._common import CPU_TIMEOUT, process_group_timeout
from lightning_vescale.recipe import build_strategy
from lightning_vescale.recipe.schema import validate

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def test_default_is_minutes_on_cpu_and_torchs_default_on_accelerators() -> None:
    assert process_group_timeout(None, torch.device("cpu")) == CPU_TIMEOUT == timedelta(minutes=5)
    assert process_group_timeout(None, torch.device("cuda", 0)) == timedelta(minutes=30)


def test_seconds_and_timedeltas_are_accepted_and_bad_values_refused() -> None:
    assert process_group_timeout(7.5, torch.device("cpu")) == timedelta(seconds=7.5)
    assert process_group_timeout(timedelta(seconds=3), torch.device("cpu")) == timedelta(seconds=3)
    with pytest.raises(ValueError, match="timeout must be positive, got 0"):
        process_group_timeout(0, torch.device("cpu"))
    with pytest.raises(TypeError, match="timeout must be a number of seconds or a datetime.timedelta, got '5m'"):
        process_group_timeout("5m", torch.device("cpu"))


def test_the_strategies_refuse_a_bad_timeout_when_constructed() -> None:
    from lightning_vescale.lightning import VeScaleFabricStrategy, VeScaleStrategy

    for cls in (VeScaleStrategy, VeScaleFabricStrategy):
        with pytest.raises(ValueError, match="timeout must be positive"):
            cls(timeout=-1)


@pytest.mark.parametrize("strategy", ["vescale", "vescale_hsdp", "ddp", "fsdp2"])
def test_recipe_strategy_timeout_reaches_the_strategy(strategy: str) -> None:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = validate(compose("train", overrides=[f"strategy={strategy}", "strategy.timeout=42"]))
        default = validate(compose("train", overrides=[f"strategy={strategy}"]))
    assert build_strategy(cfg)._timeout == timedelta(seconds=42)
    # null: the strategy's own default (vescale resolves it by device when it creates the process group).
    assert build_strategy(default)._timeout == (None if strategy.startswith("vescale") else timedelta(minutes=30))

"""``_target_`` from the command line: only allowed modules, every target checked, built through ``instantiate``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from lightning_vescale.recipe.module import build_optimizer_from_config
from lightning_vescale.recipe.schema import TrainConfig, validate

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
HERE = __name__  # "tests.unit.test_recipe_targets": a user's own package, for the trusted_target_modules tests


def sgd_for(model: torch.nn.Module, *, lr: float, weight_decay: float, **ignored: object) -> torch.optim.Optimizer:
    """A user's optimizer factory (the AdamW option's betas and eps are ignored)."""
    return torch.optim.SGD(model.parameters(), lr=lr, weight_decay=weight_decay)


@pytest.fixture(scope="module", autouse=True)
def hydra_configs():
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        yield


def load(*overrides: str) -> TrainConfig:
    return validate(compose("train", overrides=list(overrides)))


@pytest.mark.parametrize(
    "override",
    [
        "optimizer._target_=os.system",
        "optimizer._target_=builtins.exec",
        "optimizer._target_=shutil.rmtree",
        "strategy._target_=subprocess.Popen",
        "optimizer._target_=torch.load",  # torch, but not torch.optim
        f"optimizer._target_={HERE}.sgd_for",  # the user's package, not named as trusted
    ],
)
def test_targets_outside_the_allowed_modules_are_refused(override: str) -> None:
    key = override.split("=")[0]
    with pytest.raises(ValueError, match=rf"{key}=.* is not in an allowed module\. Name a target from torch\.optim, "
                                         r"lightning_vescale, .*trusted_target_modules=.*allow_any_target=true"):
        load(override)


def test_an_import_re_exported_by_an_allowed_module_is_refused() -> None:
    # The path starts with lightning_vescale, but the object is shutil.rmtree.
    with pytest.raises(ValueError, match=r"resolves to <function rmtree.*defined in module 'shutil'"):
        load("optimizer._target_=lightning_vescale.checkpoint._directory.shutil.rmtree")


def test_a_nested_target_is_refused() -> None:
    # instantiate builds nested _target_ nodes too, here inside the strategy's granularity mapping.
    with pytest.raises(ValueError, match=r"strategy\.granularity\._target_='os\.system' is not in an allowed module"):
        load("strategy.granularity={_target_: os.system, _args_: [true]}")


def test_trusted_modules_and_the_lift_flag_allow_the_users_targets() -> None:
    cfg = load(f"optimizer._target_={HERE}.sgd_for", f"trusted_target_modules=[{HERE}]")
    assert isinstance(build_optimizer_from_config(cfg.optimizer, torch.nn.Linear(2, 2)), torch.optim.SGD)
    assert load(f"optimizer._target_={HERE}.sgd_for", "allow_any_target=true").allow_any_target


def test_building_goes_through_instantiate_and_its_blocklist() -> None:
    # Even without the config check (a mapping built in Python), Hydra's blocklist applies: os.remove is not called.
    with pytest.raises(ImportError, match=r"optimizer\._target_='os\.remove' cannot be built .*blocklisted"):
        build_optimizer_from_config({"_target_": "os.remove", "lr": 1.0}, torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    "target",
    [
        "lightning_vescale.export.export_hf",  # replaces output_dir with overwrite=true
        "lightning_vescale.convert.convert",
        "lightning_vescale.checkpoint.save_full",
        "torch.optim.swap_in_optimizer_params_and_state",
    ],
)
def test_functions_of_the_allowed_packages_that_a_config_does_not_build_are_refused(target: str) -> None:
    with pytest.raises(ValueError, match=rf"optimizer\._target_='{target}' is not something a config may build: "
                                         r".*optimizer, LR scheduler, strategy, data module or plan class.*"
                                         r"trusted_target_modules"):
        load(f"optimizer._target_={target}")


def test_a_nested_target_of_the_package_that_would_delete_a_directory_is_refused(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    with pytest.raises(ValueError, match=r"strategy\.granularity\._target_='lightning_vescale\.export\.export_hf' is "
                                         r"not something a config may build"):
        load(f"strategy.granularity={{_target_: lightning_vescale.export.export_hf, source: {tmp_path}, "
             f"output_dir: {victim}, overwrite: true}}")
    assert (victim / "keep.txt").read_text() == "precious"


@pytest.mark.parametrize(
    "override",
    [
        "optimizer._target_=torch.optim.SGD",  # an Optimizer subclass
        "optimizer._target_=lightning_vescale.optim.build_optimizer",  # the optimizer factory
        "strategy=ddp",  # a Lightning Strategy subclass
        "strategy.granularity={_target_: lightning_vescale.plan.load_plan, _args_: [llama]}",  # nested, allowed
    ],
)
def test_what_a_config_is_meant_to_build_passes(override: str) -> None:
    load(override)

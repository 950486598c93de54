"""The recipes' command line, checked before Hydra's app and before Lightning is imported: one message, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_vescale.recipe.cli import check_command_line

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "configs"


def error_of(*argv: str, config: str = "train", capsys) -> str:
    with pytest.raises(SystemExit) as info:
        check_command_line(CONFIG_DIR, config, list(argv))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["trainer.max_step=20"], "trainer.max_step: there is no key 'max_step' in trainer (did you mean trainer.max_steps?)"),
        (["seeed=1"], "there is no key 'seeed' at the top level (did you mean seed?)"),
        (["modle=llama_tiny"], "(did you mean model?)"),
        (["model=moe_tiny", "model.num_expert=3"], "(did you mean model.num_experts or model.num_expert_groups?)"),
        (["plan=moe", "plan.fallback.prefetchh=2"], "(did you mean plan.fallback.prefetch?)"),
    ],
)
def test_a_misspelled_key_names_the_closest_key(argv, message, capsys):
    err = error_of(*argv, capsys=capsys)
    assert message in err
    assert "+trainer.max_step" not in err  # Hydra's hint would add the misspelled key


def test_an_unknown_option_names_the_closest_options(capsys):
    err = error_of("model=llama_tinyy", capsys=capsys)
    assert "model=llama_tinyy: there is no option 'llama_tinyy' in configs/model/ (did you mean model=llama_tiny" in err
    assert "the options are deepseek_v3_671b, " in err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["optimizer.lr=abc"], "optimizer.lr=abc: optimizer.lr must be a number, got 'abc'"),
        (["trainer.max_steps=many"], "trainer.max_steps=many: trainer.max_steps must be an integer, got 'many'"),
        (["trainer.max_steps=[1"], "cannot read the override 'trainer.max_steps=[1'"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_key(argv, message, capsys):
    assert message in error_of(*argv, capsys=capsys)


def test_a_good_command_line_passes_and_other_ranks_skip_the_check(monkeypatch):
    check_command_line(CONFIG_DIR, "train", ["trainer.max_steps=20", "hydra.run.dir=/tmp/x"])
    check_command_line(CONFIG_DIR, "train", ["--cfg", "job", "trainer.max_step=20"])  # Hydra's flags: Hydra's
    monkeypatch.setenv("LOCAL_RANK", "1")  # a process Lightning started for rank 1: rank 0 checked
    check_command_line(CONFIG_DIR, "train", ["trainer.max_step=20"])


def test_help_lists_groups_and_every_field_with_type_value_and_description(capsys):
    with pytest.raises(SystemExit) as info:
        check_command_line(CONFIG_DIR, "train", ["--help", "memory=budget"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "schema/" not in out  # the internal schema/* groups are not options
    assert "  model: deepseek_v3_671b, " in out and "[llama_tiny]" in out
    assert "  memory: [budget], checkpoint, offload_disk" in out and "  quant: " in out
    assert "  trainer.max_steps: int = 300\n      Optimizer steps to train" in out
    assert "  model.dim: Optional[int] = null (the preset's: 64)\n      Model (residual stream) width D." in out
    assert "  memory.budget: Optional[str] = 6GiB\n" in out


@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.max_step=20", "trainer.max_step: there is no key 'max_step' in trainer (did you mean "
                                "trainer.max_steps?)"),  # found while composing
        ("strategy.replicate_size=3", "strategy.replicate_size=3 does not divide the 2 processes"),  # by preflight
    ],
)
def test_a_mistake_on_the_recipe_command_line_stops_before_lightning_is_imported(tmp_path, override, message):
    # The cost of a mistake is the check, not Lightning's import: the process exits 2 without having imported it.
    probe = (
        "import runpy, sys\n"
        f"sys.argv = [{str(ROOT / 'recipes' / 'train.py')!r}, {override!r}, 'output_root={tmp_path}']\n"
        "try:\n"
        "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    print('exit', e.code, 'lightning' in sys.modules, 'transformers' in sys.modules)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.strip() == "exit 2 False False", (proc.stdout, proc.stderr)
    assert f"train.py: error: {message}" in proc.stderr
    assert not any(tmp_path.iterdir())


def test_the_schemas_own_targets_are_defined_in_the_allowed_modules():
    # They pass the target check without being imported (a strategy would import Lightning): check them here.
    import hydra.utils

    from lightning_vescale.recipe.targets import BUILTIN_TARGETS, DEFAULT_TARGET_MODULES

    for target in BUILTIN_TARGETS:
        obj = hydra.utils.get_object(target)
        assert callable(obj) and obj.__module__.startswith(DEFAULT_TARGET_MODULES), (target, obj.__module__)


def test_the_readme_names_every_config_group_and_where_the_config_is_kept():
    import re

    readme = (ROOT / "README.md").read_text()
    listed = re.search(r"Groups live in `configs/` \(([^)]*)\)", readme).group(1)
    groups = sorted(g.strip("`/ \n") for g in listed.split(","))
    assert groups == sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_dir()), groups
    # A run keeps its composed config in .hydra/config.yaml (Hydra's), not in a config.yaml of its own.
    assert not re.search(r"(?<![./])config\.yaml", readme.replace("configs/", ""))

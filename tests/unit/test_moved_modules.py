"""Modules that moved into ``lightning_vescale.engine`` / ``state_dict`` still import by their old path, warning."""

import importlib
import sys

import pytest


def test_an_old_module_path_gives_the_new_module_with_a_deprecation_warning() -> None:
    import lightning_vescale.engine.placement as new

    sys.modules.pop("lightning_vescale.placement", None)
    with pytest.warns(DeprecationWarning, match="lightning_vescale.engine.placement"):
        old = importlib.import_module("lightning_vescale.placement")
    assert old is new


def test_importing_an_old_path_keeps_the_package_functions() -> None:
    import lightning_vescale as lv

    sys.modules.pop("lightning_vescale.collectives", None)
    with pytest.warns(DeprecationWarning, match="engine.collectives"):
        importlib.import_module("lightning_vescale.collectives")
    assert callable(lv.fully_shard) and callable(lv.parallelize)


def test_an_unknown_module_is_still_not_found() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("lightning_vescale.no_such_module")

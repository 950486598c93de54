"""Register ``strategy="vescale"`` with Lightning without importing Lightning.

Lightning finds strategies only through its registries, filled when ``lightning`` is imported, and has no
entry point for strategies. ``import lightning_vescale`` must stay cheap (torch only), so it does not import
Lightning to register; instead:

* if Lightning is already imported, :mod:`lightning_vescale.lightning` (which registers) is imported now;
* otherwise a finder on ``sys.meta_path`` waits for the ``lightning`` package: when Lightning's own
  ``__init__`` has finished (it imports the Trainer and Fabric, so their registries exist), it imports
  :mod:`lightning_vescale.lightning`, and removes itself.

Either way, ``Trainer(strategy="vescale")`` works after ``import lightning_vescale`` in any order.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Optional, Sequence

__all__ = ["install"]

_PACKAGE = "lightning"


def _register() -> None:
    importlib.import_module("lightning_vescale.lightning")


class _RegisterAfterExec(importlib.abc.Loader):
    """Wraps Lightning's loader: runs it, then registers the strategies."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _register()

    def __getattr__(self, name: str) -> Any:  # is_package, get_code, get_resource_reader ...
        return getattr(self._loader, name)


class _LightningFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None):
        if fullname != _PACKAGE:
            return None
        _uninstall()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _RegisterAfterExec(spec.loader)
        return spec


_FINDER = _LightningFinder()


def _uninstall() -> None:
    while _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def install() -> None:
    """Register now if Lightning is loaded (and done loading), else when it is imported."""
    loaded = sys.modules.get(_PACKAGE)
    if loaded is not None:
        if hasattr(loaded, "Trainer"):  # fully imported (not this package imported from inside Lightning's import)
            _register()
        return
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)

"""Which ``_target_`` a recipe config may name: an allowlist of modules, checked before anything is imported.

A recipe's config comes from the command line (``optimizer._target_=...``), so a ``_target_`` is code
chosen by whoever writes the command. Hydra's ``instantiate`` refuses a few dangerous callables
(``os.system``, ``builtins.exec``, ``shutil.rmtree``, ...); the recipes go further and accept only
targets defined in an allowed module:

* :data:`DEFAULT_TARGET_MODULES` (``torch.optim``, ``lightning_vescale`` and Lightning's strategies);
* the user's own packages, named in the config (``trusted_target_modules=[my_pkg]``);
* anything, with ``allow_any_target=true`` (Hydra's own blocklist still applies).

A target passes when its dotted path starts with an allowed module *and* the object it resolves to is
defined in one (so ``lightning_vescale.checkpoint.shutil.rmtree``, a re-exported import, is refused).
Every ``_target_`` of the config is checked, nested ones included (``instantiate`` builds those too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import hydra.utils
from omegaconf import DictConfig, ListConfig, OmegaConf

__all__ = ["BUILTIN_TARGETS", "DEFAULT_TARGET_MODULES", "check_config_targets", "check_target"]

DEFAULT_TARGET_MODULES = ("torch.optim", "lightning_vescale", "lightning.pytorch.strategies")
"""Modules whose classes and functions a recipe's ``_target_`` may name without further configuration."""

BUILTIN_TARGETS = frozenset({
    "torch.optim.AdamW", "lightning_vescale.optim.build_optimizer", "lightning_vescale.lightning.VeScaleStrategy",
    "lightning.pytorch.strategies.DDPStrategy", "lightning.pytorch.strategies.ModelParallelStrategy",
})
"""The targets of the recipes' own schemas, allowed without importing them (a strategy imports Lightning, which a
config check should not pay for); a unit test resolves each and checks where it is defined."""


def _in_modules(dotted: str, modules: Sequence[str]) -> bool:
    return any(dotted == m or dotted.startswith(m + ".") for m in modules)


def check_target(key: str, target: Any, modules: Sequence[str]) -> None:
    """Raise ``ValueError`` unless ``target`` is a class or function defined in one of ``modules``.

    Args:
        key: where the target is in the config (``"optimizer._target_"``), for the message.
        target: the dotted import path.
        modules: allowed module prefixes (``"torch.optim"`` allows ``torch.optim.adamw.AdamW``).
    """
    fix = (
        f"Name a target from {', '.join(modules)}; to allow your own package add it to "
        f"trusted_target_modules=[<package>], or lift the check with allow_any_target=true."
    )
    if not isinstance(target, str) or not _in_modules(target, modules):
        raise ValueError(f"{key}={target!r} is not in an allowed module. {fix}")
    if target in BUILTIN_TARGETS:
        return
    try:
        obj = hydra.utils.get_object(target)
    except Exception as err:  # hydra wraps ImportError / AttributeError in its own exception types
        raise ValueError(f"{key}={target!r} cannot be imported ({type(err).__name__}: {err}); fix the path") from None
    defined_in = getattr(obj, "__module__", None)
    if not callable(obj) or not isinstance(defined_in, str) or not _in_modules(defined_in, modules):
        raise ValueError(
            f"{key}={target!r} resolves to {obj!r}, defined in module {defined_in!r}, which is not allowed. {fix}"
        )


def _targets(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    """``(key, target)`` for every ``_target_`` in a config tree of dataclasses, mappings and lists."""
    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=False)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        node = {f.name: getattr(node, f.name) for f in dataclasses.fields(node)}
    if isinstance(node, Mapping):
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            if key == "_target_":
                yield where, value
            else:
                yield from _targets(value, where)
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _targets(value, f"{path}[{i}]")


def check_config_targets(config: Any, *, trusted_modules: Sequence[str] = (), allow_any: bool = False) -> None:
    """Check every ``_target_`` in ``config`` (a recipe config) against the allowlist; see the module notes.

    Args:
        config: a dataclass, mapping or ``DictConfig`` tree.
        trusted_modules: the user's own modules, allowed next to :data:`DEFAULT_TARGET_MODULES`.
        allow_any: skip the check (trusted configs only).

    Raises:
        ValueError: a target outside the allowed modules; the message names its key and how to allow it.
    """
    if allow_any:
        return
    modules = (*DEFAULT_TARGET_MODULES, *trusted_modules)
    for key, target in _targets(config, ""):
        check_target(key, target, modules)

"""Which ``_target_`` a recipe config may name: what is meant to be built from a config, nothing else.

A recipe's config comes from the command line (``optimizer._target_=...``), so a ``_target_`` is code
chosen by whoever writes the command, and Hydra's ``instantiate`` builds nested ``_target_`` nodes too
(``strategy.granularity={_target_: ...}``). Hydra refuses a few dangerous callables (``os.system``,
``builtins.exec``, ``shutil.rmtree``, ...); the recipes accept only:

* from :data:`DEFAULT_TARGET_MODULES` (``torch.optim``, ``lightning_vescale`` and Lightning's strategies), the
  things a config builds (:data:`ALLOWED_KINDS`): optimizers, LR schedulers, strategies, data modules and plans
  (subclasses of their base classes), and the callables of :data:`ALLOWED_CALLABLES` (optimizer and model
  factories, plan loading, policies). Any other function of those packages is refused, e.g.
  ``lightning_vescale.export.export_hf``, which replaces a directory;
* anything defined in the user's own packages, named in the config (``trusted_target_modules=[my_pkg]``);
* anything, with ``allow_any_target=true`` (Hydra's own blocklist still applies).

A target passes when its dotted path starts with an allowed module, the object it resolves to is defined in
one (so ``lightning_vescale.checkpoint.shutil.rmtree``, a re-exported import, is refused) and, for the default
modules, it is one of the kinds above. Every ``_target_`` of the config is checked, nested ones included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Optional

import hydra.utils
from omegaconf import DictConfig, ListConfig, OmegaConf

__all__ = [
    "ALLOWED_CALLABLES", "ALLOWED_KINDS", "BUILTIN_TARGETS", "DEFAULT_TARGET_MODULES", "check_config_targets",
    "check_target",
]

DEFAULT_TARGET_MODULES = ("torch.optim", "lightning_vescale", "lightning.pytorch.strategies")
"""Modules whose buildable classes and factories (:data:`ALLOWED_KINDS`, :data:`ALLOWED_CALLABLES`) a recipe's
``_target_`` may name without further configuration."""

ALLOWED_KINDS = {
    "torch.optim.Optimizer": "optimizer",
    "torch.optim.lr_scheduler.LRScheduler": "LR scheduler",
    "lightning.pytorch.strategies.Strategy": "strategy",
    "lightning.fabric.strategies.Strategy": "strategy",
    "lightning.pytorch.core.LightningDataModule": "data module",
    "lightning_vescale.plan.Plan": "plan",
}
"""Base classes whose subclasses (in :data:`DEFAULT_TARGET_MODULES`) a ``_target_`` may build, with their kind."""

ALLOWED_CALLABLES = (
    "lightning_vescale.optim.build_optimizer",
    "lightning_vescale.plan.load_plan",
    "lightning_vescale.MixedPrecisionPolicy",
    "lightning_vescale.memory.MemoryPolicy",
    "lightning_vescale.models.Llama",
    "lightning_vescale.models.MoE",
    "lightning_vescale.models.Qwen3MoE",
    "lightning_vescale.models.DeepSeekV3",
    "lightning_vescale.models.llama_config",
    "lightning_vescale.models.moe_config",
    "lightning_vescale.models.qwen3_moe_config",
    "lightning_vescale.models.deepseek_v3_config",
)
"""Other callables of :data:`DEFAULT_TARGET_MODULES` a ``_target_`` may name: the optimizer factory, plan loading,
the policies, the models and their config factories."""


def _buildable_kind(obj: Any) -> Optional[str]:
    """The kind of ``obj`` if a config may build it (see :data:`ALLOWED_KINDS`, :data:`ALLOWED_CALLABLES`)."""
    if isinstance(obj, type):
        for base, kind in ALLOWED_KINDS.items():
            if issubclass(obj, hydra.utils.get_object(base)):
                return kind
    if any(obj is hydra.utils.get_object(path) for path in ALLOWED_CALLABLES):
        return "factory"
    return None


BUILTIN_TARGETS = frozenset({
    "torch.optim.AdamW", "lightning_vescale.optim.build_optimizer", "lightning_vescale.lightning.VeScaleStrategy",
    "lightning.pytorch.strategies.DDPStrategy", "lightning.pytorch.strategies.ModelParallelStrategy",
})
"""The targets of the recipes' own schemas, allowed without importing them (a strategy imports Lightning, which a
config check should not pay for); a unit test resolves each and checks where it is defined."""


def _in_modules(dotted: str, modules: Sequence[str]) -> bool:
    return any(dotted == m or dotted.startswith(m + ".") for m in modules)


def check_target(key: str, target: Any, modules: Sequence[str], trusted: Sequence[str] = ()) -> None:
    """Raise ``ValueError`` unless ``target`` is a class or function defined in one of ``modules`` and, unless
    defined in one of ``trusted``, something a config is meant to build (see the module notes).

    Args:
        key: where the target is in the config (``"optimizer._target_"``), for the message.
        target: the dotted import path.
        modules: allowed module prefixes (``"torch.optim"`` allows ``torch.optim.adamw.AdamW``).
        trusted: the user's own modules among ``modules``, whose every class and function is allowed.
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
    if not _in_modules(defined_in, trusted) and _buildable_kind(obj) is None:
        raise ValueError(
            f"{key}={target!r} is not something a config may build: from {', '.join(DEFAULT_TARGET_MODULES)} a "
            f"_target_ must be an optimizer, LR scheduler, strategy, data module or plan class, or one of "
            f"{', '.join(p.rsplit('.', 1)[1] for p in ALLOWED_CALLABLES)} (nothing else of these packages runs from a "
            f"config). If it is your own code, put it in your package and add it to trusted_target_modules=[<package>]"
            f", or lift the check with allow_any_target=true (trusted configs only)."
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
        check_target(key, target, modules, trusted_modules)

"""lightning-vescale: sharded training on RaggedShard placements.

Public face: ``fully_shard`` and its policies, ``parallelize`` and declarative plans, the planner, the byte
counters and clipping. Importing it needs only torch: the Lightning strategies (``strategy="vescale"``) live in
:mod:`lightning_vescale.lightning`, registered with Lightning as soon as Lightning is imported (before or after
this package), and ``lightning_vescale.VeScaleStrategy`` / ``VeScaleFabricStrategy`` load it on first use.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any

from lightning_vescale._lightning_hook import install as _install_lightning_hook
from lightning_vescale.engine.clip_grad import clip_grad_norm_
from lightning_vescale.engine.collectives import CommStats, comm_stats
from lightning_vescale.engine.fully_shard import VeScaleModule, fully_shard, granularity_by_pattern
from lightning_vescale.engine.meta_init import init_sharded_weights
from lightning_vescale.engine.placement import RaggedShard
from lightning_vescale.engine.planner import BufferPlan, TensorSpec, plan_buffer
from lightning_vescale.engine.policies import MixedPrecisionPolicy
from lightning_vescale.engine.tensor import RaggedLayout, RaggedTensor
from lightning_vescale.parallel.parallelize import parallelize, resolved_plan_of
from lightning_vescale.plan import Plan, PlanError, load_plan, resolve_plan

__all__ = [
    "BufferPlan",
    "CommStats",
    "MixedPrecisionPolicy",
    "RaggedLayout",
    "Plan",
    "PlanError",
    "RaggedShard",
    "RaggedTensor",
    "TensorSpec",
    "VeScaleFabricStrategy",
    "VeScaleModule",
    "VeScaleStrategy",
    "clip_grad_norm_",
    "comm_stats",
    "fully_shard",
    "granularity_by_pattern",
    "init_sharded_weights",
    "load_plan",
    "parallelize",
    "plan_buffer",
    "resolve_plan",
    "resolved_plan_of",
]

_install_lightning_hook()

_LAZY = {"VeScaleStrategy", "VeScaleFabricStrategy"}


def __getattr__(name: str) -> Any:
    # The Lightning strategies import Lightning (seconds, >100 MB): only when asked for.
    if name in _LAZY:
        import lightning_vescale.lightning as integration

        return getattr(integration, name)
    raise AttributeError(f"module 'lightning_vescale' has no attribute {name!r}")


# Modules that lived at the top level before the engine got its package (0.x): importing them by the old path
# still works, with a DeprecationWarning naming the new one. (``fully_shard`` and ``parallelize`` are left out:
# importing a submodule of that name would replace the function the package exports.)
_MOVED = {
    "_api": "engine.policies", "_groups": "engine.process_groups", "_init": "engine.meta_init",
    "_optim_states": "engine.optim_states", "_param_group": "engine.param_group", "clip_grad": "engine.clip_grad",
    "collectives": "engine.collectives", "dbuffer": "engine.dbuffer", "group_plan": "engine.group_plan",
    "placement": "engine.placement", "planner": "engine.planner", "tensor": "engine.tensor",
    "_dtype_kinds": "state_dict.dtype_kinds", "state_dict_report": "state_dict.report",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``lightning_vescale.<old>`` to the module's new home (the same module object)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        old = fullname.removeprefix(__name__ + ".")
        if fullname.startswith(__name__ + ".") and old in _MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: Any) -> Any:
        new = f"{__name__}.{_MOVED[spec.name.removeprefix(__name__ + '.')]}"
        warnings.warn(f"{spec.name} moved to {new}; import it from there", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: Any) -> None:
        pass  # the module is already executed at its new path


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModuleFinder())  # before any finder that could still see an old file

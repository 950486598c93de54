"""lightning-vescale: sharded training on RaggedShard placements.

Public face: ``fully_shard`` and its policies, ``parallelize`` and declarative plans, the planner, the byte
counters and clipping. Importing it needs only torch: the Lightning strategies (``strategy="vescale"``) live in
:mod:`lightning_vescale.lightning`, registered with Lightning as soon as Lightning is imported (before or after
this package), and ``lightning_vescale.VeScaleStrategy`` / ``VeScaleFabricStrategy`` load it on first use.
"""

from typing import Any

from lightning_vescale._api import MixedPrecisionPolicy
from lightning_vescale._init import init_sharded_weights
from lightning_vescale._lightning_hook import install as _install_lightning_hook
from lightning_vescale.clip_grad import clip_grad_norm_
from lightning_vescale.collectives import CommStats, comm_stats
from lightning_vescale.fully_shard import VeScaleModule, fully_shard, granularity_by_pattern
from lightning_vescale.parallelize import parallelize, resolved_plan_of
from lightning_vescale.placement import RaggedShard
from lightning_vescale.plan import Plan, PlanError, load_plan, resolve_plan
from lightning_vescale.planner import BufferPlan, TensorSpec, plan_buffer
from lightning_vescale.tensor import RaggedLayout, RaggedTensor

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

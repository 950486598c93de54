"""lightning-vescale: sharded training on RaggedShard placements.

Public face: ``fully_shard`` and its policies, the planner, the byte counters and clipping.
"""

from lightning_vescale._api import MixedPrecisionPolicy
from lightning_vescale._init import init_sharded_weights
from lightning_vescale.clip_grad import clip_grad_norm_
from lightning_vescale.collectives import CommStats, comm_stats
from lightning_vescale.fully_shard import (
    VeScaleModule,
    fully_shard,
    granularity_by_pattern,
)
from lightning_vescale.placement import RaggedShard
from lightning_vescale.planner import BufferPlan, TensorSpec, plan_buffer
from lightning_vescale.tensor import RaggedLayout, RaggedTensor

__all__ = [
    "BufferPlan",
    "CommStats",
    "MixedPrecisionPolicy",
    "RaggedLayout",
    "RaggedShard",
    "RaggedTensor",
    "TensorSpec",
    "VeScaleModule",
    "clip_grad_norm_",
    "comm_stats",
    "fully_shard",
    "granularity_by_pattern",
    "init_sharded_weights",
    "plan_buffer",
]

# Lightning finds strategies only through its registries: importing the package registers
# strategy="vescale" / "vescale_hsdp" with the Trainer and with Fabric.
from lightning_vescale.lightning import VeScaleFabricStrategy, VeScaleStrategy  # noqa: E402

__all__ += ["VeScaleFabricStrategy", "VeScaleStrategy"]

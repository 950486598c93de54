"""lightning-vescale: sharded training on RaggedShard placements."""

from lightning_vescale.planner import BufferPlan, TensorSpec, plan_buffer

__all__ = ["BufferPlan", "TensorSpec", "plan_buffer"]

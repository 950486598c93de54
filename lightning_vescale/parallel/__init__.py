"""Model-agnostic parallelism applied from outside the model files."""

from lightning_vescale.parallel.expert_parallel import (
    ExpertParallelGroupedExperts,
    all_to_all_single_autograd,
    apply_expert_parallel,
    fully_shard_expert_parallel,
    register_expert_bias_update,
)

__all__ = [
    "ExpertParallelGroupedExperts",
    "all_to_all_single_autograd",
    "apply_expert_parallel",
    "fully_shard_expert_parallel",
    "register_expert_bias_update",
]

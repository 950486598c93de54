"""``parallelize(model, plan, mesh)``: shard a model as a plan says, SPMD or MPMD.

An MPMD plan (a mapping with ``stages``, see :mod:`lightning_vescale.pipeline`) places the model's top-level
sub-modules on groups of ranks and pipelines them; any other plan shards the whole model over one mesh
(:func:`lightning_vescale.parallel.spmd.parallelize_spmd`). The integrations' helpers around the SPMD applier
(meshes, precision strings, materialization, optimizer remapping) are re-exported here under the names the
strategies use.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_vescale.parallel.spmd import (  # noqa: F401 - the integrations' names for them
    CPU_TIMEOUT,
    SUPPORTED_PRECISION,
    add_output_casts,
    broadcast_module_states,
    build_expert_parallel_mesh,
    build_mesh,
    build_tensor_parallel_mesh,
    check_expert_parallel_size,
    check_tensor_parallel_size,
    describe_precision,
    materialize,
    mp_policy_for_precision,
    no_gradient_sync,
    parallelize_spmd,
    param_mapping,
    process_group_timeout,
    remap_optimizer,
    resolved_plan_of,
    set_gradient_sync,
    validate_precision,
)
from lightning_vescale.plan import (  # noqa: F401 - the integrations' names for them
    AutoWrapPolicy,
    PlanLike,
    check_expert_parallel_ready,
    has_experts,
    is_mpmd_plan,
    is_sharded,
    resolve_for,
    select_blocks,
    top_level_roots,
)

__all__ = ["parallelize"]


def parallelize(model: nn.Module, plan: PlanLike = None, mesh: Optional[DeviceMesh] = None, **kwargs: Any) -> nn.Module:
    """Shard ``model`` in place as ``plan`` says.

    With an MPMD plan, returns this rank's :class:`~lightning_vescale.pipeline.MPMDModel` (``kwargs`` go to
    :func:`~lightning_vescale.pipeline.parallelize_mpmd`); otherwise shards over ``mesh`` and returns ``model``
    (``kwargs``: see :func:`~lightning_vescale.parallel.spmd.parallelize_spmd`, which documents every step).
    """
    if is_mpmd_plan(plan):
        from lightning_vescale.pipeline import parallelize_mpmd

        if mesh is not None:
            raise TypeError("an MPMD plan places its stages on meshes of its own: drop mesh=")
        return parallelize_mpmd(model, plan, **kwargs)
    return parallelize_spmd(model, plan, mesh, **kwargs)

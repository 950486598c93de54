"""MPMD (HyperMPMD): different top-level sub-modules on different groups of ranks, each sharded with its own plan,
pipelined with ``torch.distributed.pipelining`` (GPipe or 1F1B).

An MPMD plan (see ``_spec``) lists stages: the top-level sub-modules each runs, on how many ranks (unequal
counts allowed), and each stage's own sharding plan. :func:`lightning_vescale.parallelize` with such a plan
(or :func:`parallelize_mpmd`) builds the stages' sub-meshes, shards each stage with ``fully_shard`` on its
sub-mesh, and returns this rank's :class:`MPMDModel`::

    mpmd = lv.parallelize(model, {"schedule": "1f1b", "microbatches": 4, "stages": [
        {"name": "vision", "modules": ["encoder", "projector"], "ranks": 1},
        {"name": "language", "modules": ["decoder"], "ranks": 3, "plan": "llama"}]}, example_inputs=(images, tokens))
    opt = torch.optim.AdamW(mpmd.parameters())      # this stage's parameters: one optimizer per group
    loss = mpmd.step(images, tokens_in, target=tokens_out)
    mpmd.clip_grad_norm_(1.0)                        # the norm over all stages
    opt.step(); opt.zero_grad()

Modules: ``_spec`` (the plan), ``_team`` (a stage wider than its pipelines: [Note: teams]), ``_runtime``
(groups, schedules, the step, clipping), ``_checkpoint`` (save from all stages, reload into other layouts),
``_cost`` (predicted step time and bubble fraction next to uniform sharding; :func:`choose_layout`).
"""

from lightning_vescale.pipeline._checkpoint import load_full_into, load_mpmd, read_mpmd_full_state_dict, save_mpmd
from lightning_vescale.pipeline._cost import (
    LayoutCost,
    StageCost,
    candidate_plans,
    choose_layout,
    predict_mpmd,
    predict_uniform,
)
from lightning_vescale.pipeline._runtime import (
    MPMDModel,
    check_batch,
    check_stage_shapes,
    lm_loss,
    parallelize_mpmd,
    run_chain,
)
from lightning_vescale.pipeline._spec import SCHEDULES, MPMDPlan, StageSpec, is_mpmd_plan

__all__ = [
    "SCHEDULES",
    "LayoutCost",
    "MPMDModel",
    "MPMDPlan",
    "StageCost",
    "StageSpec",
    "candidate_plans",
    "check_batch",
    "check_stage_shapes",
    "choose_layout",
    "is_mpmd_plan",
    "lm_loss",
    "load_full_into",
    "load_mpmd",
    "parallelize_mpmd",
    "predict_mpmd",
    "predict_uniform",
    "read_mpmd_full_state_dict",
    "run_chain",
    "save_mpmd",
]

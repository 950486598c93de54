"""The MPMD recipe's settings (``mpmd``): a vision-language model with its sub-models on different groups of ranks.

``python recipes/train.py experiment=vlm_mpmd`` trains :class:`~lightning_vescale.models.vlm.VLM` on synthetic
images (generated deterministically, see :func:`~lightning_vescale.models.vlm.synthetic_vlm_batch`) as the
``mpmd.plan`` says (by default the encoder and projector on 1 rank, the decoder sharded over 3), with
``torch.distributed.pipelining``. The Lightning Trainer drives one SPMD module per process, which an MPMD run
is not, so this is a plain loop: Lightning Fabric only launches the processes (``trainer.devices``) and creates
the process group. Settings read from the rest of the config: ``seed``, ``name``, ``output_root``,
``optimizer``, ``scheduler``, ``trainer.{accelerator, devices, num_nodes, max_steps, gradient_clip_val,
log_every_n_steps, checkpoint_every_n_steps}``; the text ``data`` and the Lightning ``strategy`` do not apply.

A run writes ``summary.json`` (losses, step times, the plan) and, unless ``trainer.checkpoint_every_n_steps=0``,
``checkpoints/final`` (one sharded checkpoint per stage, see :mod:`lightning_vescale.pipeline`). The loop is
:mod:`lightning_vescale.recipe.mpmd_run` (the config is part of the schema, the loop part of the runner).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["LAYOUTS", "MPMDConfig"]

LAYOUTS = ("plan", "auto", "uniform")

@dataclass
class MPMDConfig:
    """An MPMD run (``mpmd:`` in the config; ``experiment=vlm_mpmd``)."""

    model: str = "small"
    """The VLM preset (``lightning_vescale.models.vlm.VLM_CONFIGS``: ``tiny``, ``small``)."""
    batch_size: int = 12
    """Images (with their captions) per step, over all pipelines."""
    seq_len: int = 16
    """Caption tokens per image."""
    plan: Any = field(default_factory=dict)
    """The MPMD plan (stages, ranks, their sharding plans, schedule, micro-batches; see
    :mod:`lightning_vescale.pipeline`); with ``layout: auto`` the template of the candidates (its stages' modules
    and sharding plans)."""
    layout: str = "plan"
    """``plan``: train ``plan`` as written; ``auto``: the layout the cost model predicts fastest on this machine's
    profile (``hardware``) among uniform sharding and every split of the ranks, schedule and micro-batch count of
    ``plan``'s stages (:func:`~lightning_vescale.pipeline.candidate_plans`); ``uniform``: the whole model sharded
    over every rank (each block a group), the baseline."""
    hardware: str = "auto"
    """The cost model's hardware profile for ``layout: auto`` (``auto``: ``cpu`` without CUDA, else ``h200``)."""

    def __post_init__(self) -> None:
        from lightning_vescale.models.vlm import vlm_config
        from lightning_vescale.pipeline import MPMDPlan

        arch = vlm_config(self.model)  # an unknown preset is a ValueError naming the valid ones
        if self.layout not in LAYOUTS:
            raise ValueError(f"mpmd.layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.batch_size < 1 or self.seq_len < 1:
            raise ValueError(f"mpmd.batch_size and mpmd.seq_len must be >= 1, got {self.batch_size}, {self.seq_len}")
        if arch.num_patches + self.seq_len > arch.decoder.max_seq_len:
            raise ValueError(f"mpmd.seq_len={self.seq_len} plus the {arch.num_patches} image patches exceed the "
                             f"decoder's max_seq_len={arch.decoder.max_seq_len}; lower mpmd.seq_len")
        from lightning_vescale.pipeline import check_batch

        if self.layout == "plan":
            try:
                check_batch(MPMDPlan.from_dict(_plain(self.plan)), self.batch_size)
            except ValueError as err:
                raise ValueError(f"mpmd.batch_size: {err}") from None
        elif self.layout == "auto":
            MPMDPlan.from_dict(_plain(self.plan))  # the template's stages must be a valid plan

    def mpmd_plan(self) -> Any:
        from lightning_vescale.pipeline import MPMDPlan

        return MPMDPlan.from_dict(_plain(self.plan))

    def check_world_size(self, world_size: int) -> None:
        """The written plan must fill ``world_size`` ranks; uniform sharding (also ``auto``'s fallback) must split the
        batch evenly over them."""
        if self.layout == "plan":
            self.mpmd_plan().check_world_size(world_size)
        elif self.batch_size % world_size:
            raise ValueError(f"mpmd.layout={self.layout}: uniform sharding gives every one of the {world_size} ranks an "
                             f"equal part of the batch, but mpmd.batch_size={self.batch_size} does not divide by it")

    def choose(self, world_size: int, profile: str) -> tuple[Optional[Any], list[Any]]:
        """``(plan, costs)``: the layout to train (None: uniform sharding) and, for ``auto``, every priced candidate
        (fastest first; the cost model on the meta device, seconds)."""
        import torch

        from lightning_vescale.models.vlm import VLM, synthetic_vlm_batch, vlm_config
        from lightning_vescale.pipeline import candidate_plans, choose_layout
        from lightning_vescale.plan import load_profile

        if self.layout == "plan":
            return self.mpmd_plan(), []
        if self.layout == "uniform":
            return None, []
        arch = vlm_config(self.model)
        with torch.device("meta"):
            model = VLM(arch)
        images, tokens, _ = synthetic_vlm_batch(arch, self.batch_size, self.seq_len, 0)
        candidates = [c.to_dict() for c in candidate_plans(_plain(self.plan), world_size, self.batch_size)]
        return choose_layout(model, (images, tokens), world_size, load_profile(profile), candidates)


def _plain(node: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node

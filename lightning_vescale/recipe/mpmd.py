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
from typing import Any

__all__ = ["MPMDConfig"]

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
    :mod:`lightning_vescale.pipeline`)."""

    def __post_init__(self) -> None:
        from lightning_vescale.models.vlm import vlm_config
        from lightning_vescale.pipeline import MPMDPlan

        arch = vlm_config(self.model)  # an unknown preset is a ValueError naming the valid ones
        if self.batch_size < 1 or self.seq_len < 1:
            raise ValueError(f"mpmd.batch_size and mpmd.seq_len must be >= 1, got {self.batch_size}, {self.seq_len}")
        if arch.num_patches + self.seq_len > arch.decoder.max_seq_len:
            raise ValueError(f"mpmd.seq_len={self.seq_len} plus the {arch.num_patches} image patches exceed the "
                             f"decoder's max_seq_len={arch.decoder.max_seq_len}; lower mpmd.seq_len")
        from lightning_vescale.pipeline import check_batch

        try:
            check_batch(MPMDPlan.from_dict(_plain(self.plan)), self.batch_size)
        except ValueError as err:
            raise ValueError(f"mpmd.batch_size: {err}") from None

    def mpmd_plan(self) -> Any:
        from lightning_vescale.pipeline import MPMDPlan

        return MPMDPlan.from_dict(_plain(self.plan))


def _plain(node: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node

"""Checkpointing an expert-parallel model is refused (nothing written) until its experts can be saved whole."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from lightning_vescale import checkpoint as ckpt
from lightning_vescale.models import MoE, moe_config
from lightning_vescale.parallel import apply_expert_parallel
from tests.dist_utils import run_distributed


def _refuses(rank: int, world: int, path: str) -> None:
    torch.manual_seed(0)
    model = MoE(moe_config("tiny"))
    ckpt.save(os.path.join(path, "before"), model)  # the same model without EP checkpoints fine
    apply_expert_parallel(model, dist.group.WORLD)
    with pytest.raises(NotImplementedError, match="expert-parallel models are not supported yet"):
        ckpt.save(os.path.join(path, "ep"), model)
    assert not os.path.exists(os.path.join(path, "ep")), "a refused save must write nothing"


def test_expert_parallel_checkpoint_is_refused(tmp_path) -> None:
    run_distributed(_refuses, 2, str(tmp_path))
    assert (tmp_path / "before" / ".metadata").is_file()

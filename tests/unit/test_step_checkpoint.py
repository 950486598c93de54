"""The recipes' StepCheckpoint leaves a usable ``last.ckpt`` whenever the run is killed (issue 25).

With ``checkpoint_keep=1`` Lightning's ``ModelCheckpoint`` deletes the previous checkpoint before it relinks
``last.ckpt``, and relinks by removing the link first: a kill in either gap leaves no checkpoint to resume.
A "kill" here is an exception raised at that point of the save, in one process on the default strategy.
"""

from __future__ import annotations

import os

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_vescale.recipe.callbacks import StepCheckpoint


class Killed(BaseException):
    """The process dies here (nothing after this point of the save runs)."""


def trainer_with(tmp_path) -> tuple[Trainer, StepCheckpoint]:
    callback = StepCheckpoint(dirpath=tmp_path / "checkpoints", filename="step-{step:06d}", auto_insert_metric_name=False,
                              every_n_train_steps=2, save_top_k=1, save_last="link", enable_version_counter=False)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[callback], limit_val_batches=0)
    return trainer, callback


def test_a_kill_right_after_the_old_checkpoint_is_deleted_leaves_last_ckpt_usable(tmp_path, monkeypatch) -> None:
    trainer, _ = trainer_with(tmp_path)
    remove = type(trainer.strategy).remove_checkpoint

    def remove_then_die(self, filepath) -> None:
        remove(self, filepath)
        raise Killed

    monkeypatch.setattr(type(trainer.strategy), "remove_checkpoint", remove_then_die)
    with pytest.raises(Killed):
        trainer.fit(BoringModel())
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert os.path.exists(last), f"last.ckpt names {os.readlink(last)!r}, which was deleted"
    assert os.path.basename(os.path.realpath(last)) == "step-000004.ckpt"


def test_a_kill_while_last_ckpt_is_relinked_keeps_the_previous_link(tmp_path, monkeypatch) -> None:
    trainer, _ = trainer_with(tmp_path)
    links = []
    symlink = os.symlink

    def symlink_or_die(src, dst, *args, **kwargs) -> None:
        links.append(src)
        if len(links) == 2:
            raise Killed  # the second relink (to step 4) never happens
        symlink(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "symlink", symlink_or_die)
    with pytest.raises(Killed):
        trainer.fit(BoringModel())
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert os.path.exists(last), "a kill while relinking left no last.ckpt"
    assert os.path.basename(os.path.realpath(last)) == "step-000002.ckpt"

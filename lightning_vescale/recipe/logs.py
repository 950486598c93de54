"""A recipe run's logs: its loggers (CSV, TensorBoard when installed), Lightning's console output in the run's
format, and warnings printed once (by rank zero)."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning.pytorch.loggers import Logger

__all__ = ["loggers_for", "quiet_other_ranks", "tidy_lightning_output"]


def loggers_for(run_dir: Path) -> list[Logger]:
    """A CSV logger in ``run_dir/csv`` and, when TensorBoard is installed, one in ``run_dir/tb``."""
    from lightning.pytorch.loggers import CSVLogger
    from lightning_utilities.core.imports import RequirementCache

    loggers: list[Logger] = [CSVLogger(run_dir, name="csv", version="")]
    if RequirementCache("tensorboard") or RequirementCache("tensorboardX"):
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(run_dir, name="tb", version=""))
    return loggers


def tidy_lightning_output() -> None:
    """Each Lightning message once, in the run's log format, and none of its noise.

    Lightning, imported after Hydra configured logging (the recipes import it only once the config is checked),
    keeps a console handler of its own on the ``lightning`` logger and also propagates to the root's: drop its
    own, so a message prints once and is kept in the run's log file. Lightning's advertisement for its cloud
    logger and the deprecation warning its ``_pytree`` raises on torch 2.13 print on every run, about nothing the
    user can change: dropped.
    """
    if logging.getLogger().hasHandlers():
        lightning_log = logging.getLogger("lightning")
        for handler in list(lightning_log.handlers):
            lightning_log.removeHandler(handler)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
    rank_zero_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoLitLoggerTip) for f in rank_zero_log.filters):
        rank_zero_log.addFilter(_NoLitLoggerTip())


class _NoLitLoggerTip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in str(record.msg)


def quiet_other_ranks(rank: int) -> None:
    """Print warnings once: ranks other than zero drop Python warnings and this package's and Lightning's log
    records below ERROR (every rank would repeat rank zero's)."""
    if rank != 0:
        warnings.simplefilter("ignore")
        logging.getLogger("lightning_vescale").setLevel(logging.ERROR)
        for name in ("lightning", "lightning.fabric", "lightning.pytorch"):  # each sets its own level
            logging.getLogger(name).setLevel(logging.ERROR)

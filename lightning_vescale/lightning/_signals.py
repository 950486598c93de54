"""SIGTERM under a distributed Trainer: the signal handler runs no collective; the ranks agree at a step boundary.

[Note: why Lightning's SIGTERM handling can hang]
Lightning's handler (``_SignalConnector._sigterm_notifier_fn``) broadcasts a tensor from inside the signal
handler, i.e. wherever the main thread happened to be when the signal arrived. With an engine that issues
its collectives from the main thread (the AllGathers of ``fully_shard`` in forward and backward), one rank
then waits in that broadcast while another waits in an AllGather: both hang until the process-group
timeout. A rank also stops on its own ``received_sigterm`` flag at the end of a batch, which another rank
may not have yet.

Here the handler only records the signal (and forwards it to the processes the launcher started, as
Lightning does); outside ``fit`` it stops at the next batch, as Lightning does. :func:`agree_on_sigterm` is the one collective: an all-reduce (MAX) of the flags, called at
the same point of the same batch on every rank (the start of a batch that ends an optimizer step). Only
after that does ``trainer.received_sigterm`` become true, on every rank at once; Lightning's loops then stop
after that step on all ranks together, and callbacks can save a checkpoint of it first (a collective too).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message

from lightning_vescale.engine.collectives import named_collective

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

__all__ = ["agree_on_sigterm", "install_deferred_sigterm"]


class _DeferredSigtermConnector(_SignalConnector):
    """Lightning's signal connector, with a SIGTERM handler that only records the signal."""

    def __init__(self, trainer: pl.Trainer) -> None:
        super().__init__(trainer)
        self.pending = False
        self._agreed_batch: Optional[int] = None

    def register_signal_handlers(self) -> None:
        self.pending = False
        self._agreed_batch = None
        super().register_signal_handlers()

    def _sigterm_notifier_fn(self, signum: Any, _: Any) -> None:
        message = f"Received SIGTERM: {signum}; stopping after this step"
        log.info(rank_prefixed_message(message, self.trainer.local_rank))
        if not self.pending:
            launcher = self.trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)  # os.kill on the processes it started: no collective
        self.pending = True
        if self.trainer.state.fn != TrainerFn.FITTING:
            self.received_sigterm = True  # validate/test/predict: stop at the next batch, as Lightning does

    def agree(self) -> bool:
        """Collective: whether any rank received SIGTERM; if so, every rank's ``received_sigterm`` becomes true."""
        if self.received_sigterm:
            return True
        batch = self.trainer.fit_loop.total_batch_idx
        if batch == self._agreed_batch:
            return False  # already agreed for this batch (the strategy and a callback both ask)
        self._agreed_batch = batch
        stop = self.pending
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([int(stop)], dtype=torch.int32, device=self.trainer.strategy.root_device)
            with named_collective("all_reduce (SIGTERM agreement)"):  # a stopped peer's timeout names it
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        if stop:
            self.received_sigterm = True
        return stop


def install_deferred_sigterm(trainer: pl.Trainer) -> None:
    """Replace the Trainer's signal connector before it registers its handlers (in ``setup``; idempotent)."""
    if not isinstance(trainer._signal_connector, _DeferredSigtermConnector):
        trainer._signal_connector = _DeferredSigtermConnector(trainer)


def agree_on_sigterm(trainer: pl.Trainer) -> bool:
    """At the start of a training batch, on every rank: agree whether to stop after this optimizer step.

    Only batches that end an optimizer step take part, so a run never stops between the micro-batches of
    one step (their accumulated gradients are not in a checkpoint). Returns whether the run stops.
    """
    connector = trainer._signal_connector
    if not isinstance(connector, _DeferredSigtermConnector):
        return trainer.received_sigterm
    epoch_loop = trainer.fit_loop.epoch_loop
    should_accumulate = getattr(epoch_loop, "_should_accumulate", None)
    if should_accumulate is not None and should_accumulate():
        return connector.received_sigterm
    return connector.agree()

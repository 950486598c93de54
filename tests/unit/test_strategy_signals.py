"""The deferred SIGTERM connector in one process: the handler records, the agreement at a step boundary stops."""

from __future__ import annotations

import signal

from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn

from lightning_vescale.lightning._signals import _DeferredSigtermConnector, install_deferred_sigterm


def _trainer() -> Trainer:
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    install_deferred_sigterm(trainer)
    install_deferred_sigterm(trainer)  # idempotent
    assert isinstance(trainer._signal_connector, _DeferredSigtermConnector)
    return trainer


def test_during_fit_the_handler_only_records_and_the_agreement_stops():
    trainer = _trainer()
    trainer.state.fn = TrainerFn.FITTING
    connector = trainer._signal_connector
    connector._sigterm_notifier_fn(signal.SIGTERM, None)
    assert connector.pending and not trainer.received_sigterm  # nothing stops mid-step
    assert connector.agree() and trainer.received_sigterm  # at the step boundary (one process: no collective)


def test_outside_fit_sigterm_stops_at_the_next_batch():
    trainer = _trainer()
    trainer.state.fn = TrainerFn.VALIDATING
    trainer._signal_connector._sigterm_notifier_fn(signal.SIGTERM, None)
    assert trainer.received_sigterm

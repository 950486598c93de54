"""Callbacks of the recipes: step statistics, a compact progress bar, step-based checkpoints and the run summary.

* :class:`StepStats` times every optimizer step and closes the engine's byte counters
  (``lightning_vescale.comm_stats.step()``), logging ``tok/s`` (tokens of all ranks per second) and
  ``comm/step`` (bytes this rank sent in the step's collectives) to the progress bar, and the bytes per
  collective kind to the loggers, and, when the memory manager moves state (``memory=...``), its ledger: bytes per
  state class and tier, current and the step's peak (``mem/<class>/<tier>`` and ``.../peak`` to the loggers, one
  ``mem`` field in the progress bar and log line). It keeps the per-step history the summary and the plot use.
* :class:`RecipeProgressBar` is Lightning's TQDM bar with readable units (for a terminal); :class:`LineProgress`
  prints one line every N steps instead (for a log file or a scheduler's output, where the bar's carriage
  returns would turn every update into a line).
* :class:`StepCheckpoint` is ``ModelCheckpoint`` every N steps that also saves the final step, and the last
  step before a SIGTERM stops the run.
* :class:`NonFiniteGuard` stops the run (or skips the step) on every rank when a step's loss or gradients are
  not finite on any rank, before the optimizer step.
* :class:`StopOnSignal` makes SIGTERM stop every rank after the same step (see
  ``lightning_vescale/lightning/_signals.py``), whatever the strategy.
* :class:`PlanReport` logs the sharding plan the strategy resolved (one line per group) and writes it, with every
  parameter's policy and where it came from, to ``plan.yaml`` in the run directory.
* :class:`RunSummary` writes ``loss_curve.png`` (matplotlib, Agg) and ``summary.json`` at the end, and logs
  the summary: steps, first/final/min training loss, last validation loss, tokens/s, bytes/step, peak memory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from lightning.pytorch.utilities import rank_zero_only

from lightning_vescale.checkpoint import add_checksums
from lightning_vescale.engine.collectives import comm_stats
from lightning_vescale.lightning import agree_on_sigterm, install_deferred_sigterm
from lightning_vescale.memory.ledger import memory_stats
from lightning_vescale.recipe.numbers import format_bytes, format_loss

__all__ = [
    "LineProgress",
    "NonFiniteError",
    "NonFiniteGuard",
    "PlanReport",
    "RecipeProgressBar",
    "RunSummary",
    "StepCheckpoint",
    "StepStats",
    "StopOnSignal",
    "format_bytes",
    "peak_memory_bytes",
]

logger = logging.getLogger(__name__)


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """This process's peak memory and how it was measured.

    CUDA: ``torch.cuda.max_memory_allocated`` (tensor memory). CPU: the peak resident set size
    (``ru_maxrss``: the whole process, including Python and the libraries, not only tensors).
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (rss if sys.platform == "darwin" else rss * 1024), "cpu_peak_rss"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class StepStats(Callback):
    """Per optimizer step: wall time, tokens/s and the bytes of the engine's collectives.

    Args:
        tokens_per_batch: tokens in one micro-batch of one process (``batch_size * seq_len``).

    Attributes (per completed optimizer step, in order): ``steps``, ``losses`` (this rank's mean training
    loss over the step's micro-batches), ``step_times`` (seconds), ``comm_bytes`` (this rank's bytes),
    ``val_losses`` (``(step, val_loss)`` after each validation). A step's time runs from its first
    micro-batch's start to its last one's end (data loading, validation and checkpoint saving between steps
    are not counted); validation's bytes and the one-off ``setup`` collectives are kept out of the steps'.
    """

    def __init__(self, tokens_per_batch: int) -> None:
        self.tokens_per_batch = tokens_per_batch
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.step_times: list[float] = []
        self.comm_bytes: list[int] = []
        self.comm_kinds: dict[str, int] = {}
        self.val_losses: list[tuple[int, float]] = []
        self.skipped_steps: list[int] = []
        self.setup_bytes = 0
        self.counts_bytes = False
        self._step_start: Optional[float] = None
        self._micro_losses: list[torch.Tensor] = []
        self._last_step = -1

    def tokens_per_step(self, trainer: Trainer) -> int:
        return self.tokens_per_batch * trainer.accumulate_grad_batches * trainer.world_size

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        comm_stats.step()  # drop setup traffic (plan checks, initial broadcasts) from the first step
        self._last_step = trainer.global_step

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._step_start is None:
            self._step_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = getattr(pl_module, "last_loss", None)
        if loss is None and isinstance(outputs, dict):
            loss = outputs["loss"] * trainer.accumulate_grad_batches
        if loss is not None:
            self._micro_losses.append(loss.detach().float())
        if trainer.global_step == self._last_step:
            return  # an accumulation micro-batch: the step is not over
        self._last_step = trainer.global_step
        elapsed = time.perf_counter() - (self._step_start or time.perf_counter())
        self._step_start = None
        by_kind = comm_stats.step()
        self.setup_bytes += by_kind.pop("setup", 0)  # one-off plan checks, not per-step traffic
        step_bytes = sum(by_kind.values())
        self.counts_bytes = self.counts_bytes or step_bytes > 0
        for kind, num in by_kind.items():
            self.comm_kinds[kind] = self.comm_kinds.get(kind, 0) + num
        self.steps.append(trainer.global_step)
        self.losses.append(torch.stack(self._micro_losses).mean().item() if self._micro_losses else math.nan)
        self._micro_losses.clear()
        self.step_times.append(elapsed)
        self.comm_bytes.append(step_bytes)
        tokens_per_s = self.tokens_per_step(trainer) / max(elapsed, 1e-9)
        pl_module.log("tok/s", tokens_per_s, prog_bar=True, rank_zero_only=True)
        if self.counts_bytes:
            pl_module.log("comm/step", float(step_bytes), prog_bar=True, rank_zero_only=True)
            for kind, num in by_kind.items():
                pl_module.log(f"comm/{kind}_bytes", float(num), rank_zero_only=True)
        ledger = memory_stats.snapshot()
        memory_stats.step()
        for key, (current, peak) in ledger.items():  # empty unless the memory manager moves state
            pl_module.log(f"mem/{key}", float(current), prog_bar=True, rank_zero_only=True)
            pl_module.log(f"mem/{key}/peak", float(peak), prog_bar=True, rank_zero_only=True)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        comm_stats.step()  # validation's AllGathers are not a training step's traffic
        if trainer.sanity_checking:
            return
        val = trainer.callback_metrics.get("val_loss")
        if val is not None:
            self.val_losses.append((trainer.global_step, float(val)))


_TIER_NAMES = {"device": "dev", "host": "host", "disk": "disk"}


def format_ledger(metrics: dict[str, Any]) -> Optional[str]:
    """The ``mem/<class>/<tier>`` (current) and ``.../peak`` metrics (removed from ``metrics``) as one field:
    ``params dev 0 B/12.6 MiB disk 64.0 MiB/64.0 MiB | grads ...`` (current/peak of the step, per tier)."""
    keys = [k for k in metrics if k.startswith("mem/")]
    if not keys:
        return None
    values = {k: float(metrics.pop(k)) for k in keys}
    by_class: dict[str, list[str]] = {}
    for key in sorted(k for k in values if not k.endswith("/peak")):
        _, cls, tier = key.split("/", 2)
        current, peak = values[key], values.get(key + "/peak", values[key])
        if current or peak:
            by_class.setdefault(cls, []).append(
                f"{_TIER_NAMES.get(tier, tier)} {format_bytes(current)}/{format_bytes(peak)}")
    return " | ".join(f"{cls} {' '.join(parts)}" for cls, parts in by_class.items()) or None


def _readable(metrics: dict[str, Any]) -> dict[str, Any]:
    """The progress metrics as text: losses with four decimals, tokens/s as a whole number, bytes in KiB/MiB."""
    metrics.pop("v_num", None)
    ledger = format_ledger(metrics)
    if ledger is not None:
        metrics["mem"] = ledger
    for key in ("loss", "val_loss"):
        if key in metrics:
            metrics[key] = format_loss(float(metrics[key]))
    if "tok/s" in metrics:
        metrics["tok/s"] = f"{float(metrics['tok/s']):,.0f}"
    if "comm/step" in metrics:
        metrics["comm/step"] = format_bytes(float(metrics["comm/step"]))
    return metrics


class RecipeProgressBar(TQDMProgressBar):
    """One TQDM bar over the whole run, in optimizer steps out of ``max_steps`` (not batches of an epoch): ``loss``,
    ``tok/s`` (all ranks), ``comm/step`` (bytes this rank sent), ``mem`` (the memory manager's ledger, when it
    moves state) and ``val_loss``, in readable units; closed once, at the end of training. For a terminal."""

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        return _readable(super().get_metrics(trainer, pl_module))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.train_progress_bar = Tqdm(
            desc="train", total=trainer.max_steps, initial=trainer.global_step, unit="step",
            position=2 * self.process_position, disable=self.is_disabled, leave=True, dynamic_ncols=True,
            file=sys.stdout, smoothing=0, bar_format=self.BAR_FORMAT,
        )

    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        pass  # the bar counts optimizer steps across epochs

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        bar = self.train_progress_bar
        step = trainer.global_step
        if bar.disable or step == bar.n:
            return  # an accumulation micro-batch: no step ended
        if self._should_update(step, trainer.max_steps) or step >= trainer.max_steps:
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar
        if step >= trainer.max_steps:
            bar.close()  # its last line stays; what follows (validation, the summary) prints below it

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        pass  # closed once, at the last step

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        bar = self.train_progress_bar
        if not bar.disable:  # stopped before max_steps (SIGTERM)
            bar.n = trainer.global_step
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            bar.close()


class LineProgress(ProgressBar):
    """Progress as log lines (rank zero): one every ``every_n_steps`` optimizer steps and at the last step,
    and one after each validation, e.g.::

        step 40/300  loss 2.3140  tok/s 61,234  comm/step 562 KiB  elapsed 12.3 s

    The recipes use it when stdout is not a terminal.
    """

    def __init__(self, every_n_steps: int) -> None:
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self._enabled = True
        self._start = 0.0
        self._last_step = -1

    def enable(self) -> None:
        self._enabled = True

    def disable(self) -> None:
        self._enabled = False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = time.perf_counter()
        self._last_step = trainer.global_step

    def _line(self, trainer: Trainer, pl_module: LightningModule, keys: tuple[str, ...]) -> str:
        metrics = _readable(self.get_metrics(trainer, pl_module))
        parts = [f"step {trainer.global_step}/{trainer.max_steps}"]
        for key in keys:
            value = metrics.get(key)
            if value is not None:
                parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
        return "  ".join(parts)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if not self._enabled or step == self._last_step:
            return  # disabled (ranks other than zero), or an accumulation micro-batch
        self._last_step = step
        if step % self.every_n_steps == 0 or step >= trainer.max_steps:
            line = self._line(trainer, pl_module, ("loss", "tok/s", "comm/step", "mem"))
            logger.info("%s  elapsed %.1f s", line, time.perf_counter() - self._start)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._enabled and not trainer.sanity_checking and trainer.state.fn == "fit":
            logger.info("%s", self._line(trainer, pl_module, ("val_loss",)))


class StepCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` every ``every_n_train_steps`` steps (``step-000100.ckpt``, ``last.ckpt``), plus the
    final step when the run does not end on a multiple of N (``save_final``), plus the last completed step when
    SIGTERM stops the run (``save_on_signal``; needs :class:`StopOnSignal` or ``strategy="vescale"`` so every
    rank saves at the same step). ``every_n_train_steps=0``: no periodic checkpoints.

    Unlike ``ModelCheckpoint``, a kill at any moment leaves a ``last.ckpt`` that names a complete checkpoint:
    the new checkpoint is written, then ``last.ckpt`` is replaced in one ``rename`` (never removed first), and
    only then are the checkpoints beyond ``save_top_k`` deleted. A sharded directory that another library wrote
    without checksums (Lightning's ``ModelParallelStrategy``) gets its ``checksums.json`` before it is linked,
    so export and ``init_from`` can verify it."""

    def __init__(self, *, save_final: bool = True, save_on_signal: bool = False, **kwargs: Any) -> None:
        if not kwargs.get("every_n_train_steps"):
            kwargs.update(every_n_train_steps=0, every_n_epochs=0)  # no periodic saving (not Lightning's default)
        super().__init__(**kwargs)
        self.save_final = save_final
        self.save_on_signal = save_on_signal
        self._to_remove: list[str] = []

    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        if os.path.isdir(filepath) and not os.path.isfile(os.path.join(filepath, "checksums.json")):
            trainer.strategy.barrier()  # every rank's files are written
            if trainer.is_global_zero:
                add_checksums(filepath)
            trainer.strategy.barrier()

    def _remove_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        self._to_remove.append(filepath)  # deleted once last.ckpt names the new checkpoint (_save_last_checkpoint)

    def _save_last_checkpoint(self, trainer: Trainer, monitor_candidates: dict[str, Any]) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        pending, self._to_remove = self._to_remove, []
        linked = os.path.realpath(self.last_model_path) if self.last_model_path else None
        for path in pending:
            if os.path.realpath(path) != linked:
                super()._remove_checkpoint(trainer, path)

    @staticmethod
    def _link_checkpoint(trainer: Trainer, filepath: str, linkpath: str) -> None:
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            if os.path.isdir(linkpath) and not os.path.islink(linkpath):
                shutil.rmtree(linkpath)  # a copy an older run left instead of a link
            tmp = f"{linkpath}.tmp-link-{os.getpid()}"
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
            os.symlink(os.path.relpath(filepath, os.path.dirname(linkpath)), tmp)
            os.replace(tmp, linkpath)  # atomic: last.ckpt names the old checkpoint or the new one, never nothing
        trainer.strategy.barrier()

    def _save_now(self, trainer: Trainer) -> None:
        monitor_candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, monitor_candidates)
        self._save_last_checkpoint(trainer, monitor_candidates)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.save_on_signal and trainer.received_sigterm and self._last_global_step_saved != trainer.global_step:
            self._save_now(trainer)  # every rank: the flag is agreed (StopOnSignal), so this collective is too
            if trainer.is_global_zero:
                saved = self.last_model_path or self.best_model_path
                logger.info("SIGTERM: saved %s; continue with resume=true", saved)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.save_final:
            return  # ModelCheckpoint.on_train_end would write last.ckpt
        final_step_unsaved = self._last_global_step_saved != trainer.global_step and trainer.global_step > 0
        # fast_dev_run: set on the Trainer by Lightning's debugging-flag connector, not declared in its class
        if final_step_unsaved and not (trainer.fast_dev_run or trainer.sanity_checking):  # type: ignore[attr-defined]
            self._save_now(trainer)
        super().on_train_end(trainer, pl_module)


class NonFiniteError(RuntimeError):
    """A step's loss or gradients were not finite on some rank; the run stopped before its optimizer step."""


class NonFiniteGuard(Callback):
    """Every rank stops (``action="stop"``) or skips the optimizer step (``"skip"``) when the step's loss or
    gradients are not finite on any rank, before the optimizer step, so NaN never reaches the weights.

    Each rank notes whether any micro-batch's loss was non-finite (``on_before_backward``, no sync) and, before
    the optimizer step, whether its own gradient pieces are (no collective); one all-reduce of these flags per
    step tells every rank the same answer and which ranks it came from. A skipped step leaves the weights and the
    optimizer states as they were (the gradients are dropped, so the optimizer steps nothing), still counts as a
    step (the schedule and the data move on) and is recorded in ``skipped`` (and logged as ``skipped_steps``).

    Args:
        action: ``"stop"`` (raise :class:`NonFiniteError` on every rank) or ``"skip"``.
        stats: the run's :class:`StepStats`, whose ``skipped_steps`` the summary reports.
    """

    def __init__(self, action: str = "stop", stats: Optional[StepStats] = None) -> None:
        if action not in ("stop", "skip"):
            raise ValueError(f"action must be 'stop' or 'skip', got {action!r}")
        self.action = action
        self.stats = stats
        self.skipped: list[int] = []
        self._bad_loss: Optional[torch.Tensor] = None

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss.detach()).all()
        self._bad_loss = bad if self._bad_loss is None else self._bad_loss | bad

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        from lightning_vescale.engine.clip_grad import local_grads_finite

        params = [p for group in optimizer.param_groups for p in group["params"]]
        flags = torch.zeros(trainer.world_size, 2, dtype=torch.int32, device=trainer.strategy.root_device)
        flags[trainer.global_rank, 0] = int(bool(self._bad_loss)) if self._bad_loss is not None else 0
        flags[trainer.global_rank, 1] = int(not local_grads_finite(params))
        self._bad_loss = None
        if _distributed():
            from lightning_vescale.engine.collectives import named_collective

            with named_collective("all_reduce (non-finite check)"):
                dist.all_reduce(flags)  # the one collective: every rank gets every rank's flags
        if not bool(flags.any()):
            return
        step = trainer.global_step + 1
        found = "; ".join(
            f"non-finite {what} on rank(s) {ranks}" for what, col in (("loss", 0), ("gradients", 1))
            if (ranks := flags[:, col].nonzero().flatten().tolist())
        )
        if self.action == "stop":
            raise NonFiniteError(
                f"step {step}: {found}. Stopped on every rank before the optimizer step, so the weights (and any "
                f"checkpoint) are those of step {step - 1}. Look for the cause (learning rate, data, precision); "
                f"resume=true continues from the last checkpoint, and trainer.on_non_finite=skip skips such steps "
                f"instead of stopping"
            )
        optimizer.zero_grad(set_to_none=True)  # nothing to step: the weights and states stay as they are
        self.skipped.append(step)
        if self.stats is not None:
            self.stats.skipped_steps.append(step)
        if trainer.is_global_zero:
            logger.warning("step %d: %s; skipped its optimizer step (%d skipped so far)", step, found, len(self.skipped))
        pl_module.log("skipped_steps", float(len(self.skipped)), rank_zero_only=True)


class StopOnSignal(Callback):
    """SIGTERM stops every rank after the same optimizer step, for any strategy.

    The Trainer's SIGTERM handler is replaced (in ``setup``) by one that only records the signal, and the ranks
    agree on it at the start of each batch that ends an optimizer step (one tiny all-reduce); see
    ``lightning_vescale/lightning/_signals.py``. Lightning then raises ``SIGTERMException`` after that step on
    every rank, after :class:`StepCheckpoint` saved it.
    """

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        install_deferred_sigterm(trainer)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        agree_on_sigterm(trainer)


class PlanReport(Callback):
    """Log the resolved sharding plan at the start of training and keep it as ``plan.yaml`` in the run directory
    (only under ``strategy=vescale``; other strategies have no plan)."""

    def __init__(self, run_dir: Union[str, Path]) -> None:
        self.run_dir = Path(run_dir)

    @rank_zero_only
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        resolved = getattr(trainer.strategy, "resolved_plan", None)
        if resolved is None:
            return
        logger.info("sharding plan (%d ranks):\n%s", trainer.world_size, resolved.table(trainer.world_size))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "plan.yaml").write_text(resolved.to_yaml())


class RunSummary(Callback):
    """At the end of training: the loss curve (PNG), a summary (JSON) and a log line of it.

    Args:
        stats: the :class:`StepStats` callback of the same run.
        output_dir: where ``loss_curve.png`` and ``summary.json`` go.
        extra: fields added to the summary as they are (model name, strategy, config...).
        warmup_steps: steps left out of the tokens/s mean (start-up and first-step costs).
    """

    def __init__(
        self, stats: StepStats, output_dir: Union[str, Path], *, extra: Optional[dict] = None, warmup_steps: int = 3
    ) -> None:
        self.stats = stats
        self.output_dir = Path(output_dir)
        self.extra = dict(extra or {})
        self.warmup_steps = warmup_steps
        self.summary: Optional[dict[str, Any]] = None
        self._start_time = 0.0
        self._start_step = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start_time = time.perf_counter()
        self._start_step = trainer.global_step

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        s = self.stats
        wall = time.perf_counter() - self._start_time
        # Average the per-step losses over ranks (each saw its own data) in one collective.
        losses = torch.tensor(s.losses, dtype=torch.float64)
        peak, peak_kind = peak_memory_bytes(pl_module.device)
        peak_t = torch.tensor([float(peak)], dtype=torch.float64)
        if _distributed():
            dist.all_reduce(losses)
            losses /= dist.get_world_size()
            dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
        losses_list = losses.tolist()
        timed = s.step_times[self.warmup_steps :] if len(s.step_times) > self.warmup_steps else s.step_times
        tokens_per_step = s.tokens_per_step(trainer)
        finite = [x for x in losses_list if math.isfinite(x)]
        summary = {
            **self.extra,
            "steps": trainer.global_step,
            "steps_this_run": len(s.steps),
            "resumed_from_step": self._start_step,
            "world_size": trainer.world_size,
            "tokens_per_step": tokens_per_step,
            "first_loss": losses_list[0] if losses_list else None,
            "final_loss": losses_list[-1] if losses_list else None,
            "final_loss_mean_last_10": sum(losses_list[-10:]) / len(losses_list[-10:]) if losses_list else None,
            "min_loss": min(finite) if finite else None,
            "loss_is_finite": len(finite) == len(losses_list),
            "skipped_steps": list(s.skipped_steps),
            "val_loss": s.val_losses[-1][1] if s.val_losses else None,
            "val_losses": [{"step": st, "val_loss": v} for st, v in s.val_losses],
            "tokens_per_s": tokens_per_step * len(timed) / sum(timed) if timed and sum(timed) > 0 else None,
            "step_time_s": sum(timed) / len(timed) if timed else None,
            "wall_time_s": wall,
            "comm_bytes_per_step": (sum(s.comm_bytes) / len(s.comm_bytes)) if s.counts_bytes else None,
            "comm_bytes_per_step_by_kind": (
                {k: v / max(1, len(s.comm_bytes)) for k, v in sorted(s.comm_kinds.items())} if s.counts_bytes else None
            ),
            "comm_setup_bytes": s.setup_bytes,
            "peak_memory_bytes": int(peak_t.item()),
            "peak_memory_kind": peak_kind,
            "losses": [{"step": st, "loss": x} for st, x in zip(s.steps, losses_list)],
        }
        self.summary = summary
        self._write(summary)

    @rank_zero_only
    def _write(self, summary: dict[str, Any]) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot = self._plot(summary)
        bytes_line = (
            format_bytes(summary["comm_bytes_per_step"]) + "/step per rank"
            if summary["comm_bytes_per_step"] is not None
            else "n/a (this strategy's collectives are not counted)"
        )

        def fmt(x: Optional[float], spec: str = ".4f") -> str:
            return "n/a" if x is None else format_loss(x) if spec == ".4f" else format(x, spec)

        lines = [
            "run summary",
            f"  steps          {summary['steps']} ({summary['steps_this_run']} in this run, "
            f"world size {summary['world_size']})",
            f"  loss           first {fmt(summary['first_loss'])}  final {fmt(summary['final_loss'])}  "
            f"min {fmt(summary['min_loss'])}  (mean of last 10: {fmt(summary['final_loss_mean_last_10'])})",
            f"  val loss       {fmt(summary['val_loss'])}",
            f"  throughput     {fmt(summary['tokens_per_s'], ',.0f')} tokens/s, "
            f"{fmt(summary['step_time_s'], '.3f')} s/step",
            f"  communication  {bytes_line}",
            f"  peak memory    {format_bytes(summary['peak_memory_bytes'])} "
            f"({summary['peak_memory_kind']}, max over ranks)",
            f"  wall time      {summary['wall_time_s']:.1f} s",
            f"  written        {self.output_dir / 'summary.json'}" + (f", {plot}" if plot else ""),
        ]
        logger.info("\n".join(lines))

    def _plot(self, summary: dict[str, Any]) -> Optional[Path]:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            logger.warning("matplotlib is not installed: no loss curve (pip install matplotlib)")
            return None
        steps = [p["step"] for p in summary["losses"]]
        losses = [p["loss"] for p in summary["losses"]]
        fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
        ax.plot(steps, losses, label="train loss (mean over ranks)", linewidth=1.2)
        if summary["val_losses"]:
            ax.plot(
                [p["step"] for p in summary["val_losses"]], [p["val_loss"] for p in summary["val_losses"]],
                "o-", label="validation loss",
            )
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross-entropy (nats/token)")
        title = " ".join(str(summary[k]) for k in ("model", "strategy") if k in summary)
        ax.set_title(title or "loss")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = self.output_dir / "loss_curve.png"
        fig.savefig(path)
        plt.close(fig)
        return path

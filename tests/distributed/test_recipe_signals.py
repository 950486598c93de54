"""SIGTERM ends a 2-rank recipe run on every rank after saving it, and ``resume=true`` continues exactly.

A reference run trains 60 steps uninterrupted. The same run is then started, stopped by a real SIGTERM, resumed
with ``resume=true``, stopped again, and resumed to the end: each stop must end every process of the run (exit
code 143, nothing left behind) with a checkpoint of the last completed step, and the resumed runs must see
exactly the batches of the uninterrupted one (mid-epoch: an epoch is 185 steps), so their losses are equal.
The first stop signals the whole process group (as ``timeout`` and schedulers do), the second only the
launching process (as ``kill <pid>`` does; it forwards the signal to the rank it started).

The four runs are one sequence (each resume continues the previous stop), run once for the module by a
module-scoped fixture; each test checks one behaviour of it (the losses are compared exactly, as logged).
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple, Optional

import pytest

from tests.recipe_zygote import ROOT, ForkedProcess, kill_group, start

pytestmark = pytest.mark.slow  # recipe runs as subprocesses (Hydra, Lightning's launcher): tens of seconds each

MAX_STEPS = 60
# Liveness bounds, not timings: a run that hangs is killed here instead of blocking the suite.
START_TIMEOUT_S = 240
EXIT_TIMEOUT_S = 90
ONE_WORKER = pytest.mark.xdist_group(name="test_recipe_signals.sequence")
"""The tests of the fixture's sequence of runs: on one pytest-xdist worker, so it runs once."""


def _start(output_root: Path, log: Path, *overrides: str) -> ForkedProcess:
    """The run in a process group of its own (``start_new_session``; Lightning's launcher starts rank 1 in it),
    stdout and stderr to ``log``."""
    cmd = [sys.executable, str(ROOT / "recipes" / "train.py"), "experiment=smoke", f"trainer.max_steps={MAX_STEPS}",
           "trainer.checkpoint_every_n_steps=0", "trainer.val_every_n_steps=25", f"output_root={output_root}",
           *overrides]
    with open(log, "w") as out, open(os.devnull) as devnull:
        return start(cmd, fds=(devnull.fileno(), out.fileno(), out.fileno()))


def _progress_step(log: Path) -> int:
    steps = re.findall(rf" - step (\d+)/{MAX_STEPS}  loss", log.read_text())
    return int(steps[-1]) if steps else 0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill_group(proc: ForkedProcess) -> None:
    kill_group(proc.pid)
    proc.wait()


class Stop(NamedTuple):
    """How a run ended after SIGTERM: the launcher's exit code, whether a rank outlived it, its log, the step it
    reported stopping after (None if it reported none) and its run directory."""

    code: int
    alive: bool
    text: str
    step: Optional[int]
    run: Path


def _stop_with_sigterm(proc: ForkedProcess, log: Path, *, after_step: int, whole_group: bool) -> tuple:
    """Send SIGTERM once the run logged ``after_step``; the exit code, whether a rank outlived it, and the log."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while _progress_step(log) < after_step:
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill_group(proc)
            pytest.fail(f"the run ended or stalled before step {after_step}:\n{log.read_text()[-4000:]}")
        time.sleep(0.05)
    if whole_group:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        pytest.fail(f"SIGTERM did not end the run (hang):\n{log.read_text()[-4000:]}")
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while _group_alive(proc.pid) and time.monotonic() < deadline:  # the other rank
        time.sleep(0.1)
    alive = _group_alive(proc.pid)
    _kill_group(proc)
    return code, alive, log.read_text()


def _stopped_after(text: str) -> Optional[int]:
    stopped = re.search(r"stopped by SIGTERM after step (\d+); saved (\S+): continue with resume=true", text)
    return int(stopped.group(1)) if stopped else None


def _csv_losses(run_dir: Path) -> dict[int, str]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return {int(r["step"]): r["loss"] for r in csv.DictReader(f) if r["loss"]}


def _only_run(root: Path, exclude: set[Path] = frozenset()) -> Path:
    runs = [p for p in (root / "llama_tiny").iterdir() if p not in exclude]
    assert len(runs) == 1, runs
    return runs[0]


class Sequence(NamedTuple):
    ref_losses: dict[int, Any]
    ref_csv: dict[int, str]
    first: Stop  # SIGTERM to the process group after step 8
    second: Stop  # resumed, then SIGTERM to the launching process 8 steps later
    third_code: int  # resumed to the end
    third_log: str
    third_summary: Optional[dict[str, Any]]


@pytest.fixture(scope="module")
def sequence(tmp_path_factory) -> Sequence:
    tmp_path = tmp_path_factory.mktemp("signals")
    reference = _start(tmp_path / "ref", tmp_path / "ref.log")
    assert reference.wait(timeout=START_TIMEOUT_S * 2) == 0, (tmp_path / "ref.log").read_text()[-4000:]
    ref_run = _only_run(tmp_path / "ref")
    ref_summary = json.loads((ref_run / "summary.json").read_text())
    ref_losses = {p["step"]: p["loss"] for p in ref_summary["losses"]}
    ref_csv = _csv_losses(ref_run)

    root = tmp_path / "runs"
    code, alive, text = _stop_with_sigterm(_start(root, tmp_path / "1.log"), tmp_path / "1.log", after_step=8,
                                           whole_group=True)
    first = Stop(code, alive, text, _stopped_after(text), _only_run(root))
    if first.step is None:
        pytest.fail(f"the first run reported no stop, nothing to resume:\n{text[-4000:]}")

    proc = _start(root, tmp_path / "2.log", "resume=true")
    code, alive, text = _stop_with_sigterm(proc, tmp_path / "2.log", after_step=first.step + 8, whole_group=False)
    second = Stop(code, alive, text, _stopped_after(text), _only_run(root, {first.run}))
    if second.step is None:
        pytest.fail(f"the second run reported no stop, nothing to resume:\n{text[-4000:]}")

    proc = _start(root, tmp_path / "3.log", "resume=true")
    third_code = proc.wait(timeout=START_TIMEOUT_S * 2)
    third_log = (tmp_path / "3.log").read_text()
    third_summary = None
    if third_code == 0:
        run3 = _only_run(root, {first.run, second.run})
        third_summary = json.loads((run3 / "summary.json").read_text())
    return Sequence(ref_losses, ref_csv, first, second, third_code, third_log, third_summary)


def _assert_stopped_and_saved(stop: Stop) -> None:
    """Every process ended, with SIGTERM's exit code, after saving the last completed step."""
    assert not stop.alive, f"a rank outlived SIGTERM:\n{stop.text[-4000:]}"
    assert stop.code == 143, f"exit code {stop.code}:\n{stop.text[-4000:]}"
    assert stop.step is not None, stop.text[-4000:]
    assert os.path.realpath(stop.run / "checkpoints" / "last.ckpt").endswith(f"step-{stop.step:06d}.ckpt")


@ONE_WORKER
def test_sigterm_to_the_process_group_ends_every_rank_after_saving(sequence: Sequence):
    _assert_stopped_and_saved(sequence.first)


@ONE_WORKER
def test_sigterm_to_the_launching_process_alone_ends_every_rank_after_saving(sequence: Sequence):
    _assert_stopped_and_saved(sequence.second)


@ONE_WORKER
def test_a_resumed_run_trains_on_the_uninterrupted_runs_batches(sequence: Sequence):
    # The stretch the second run trained (after the first stop) saw the uninterrupted run's batches.
    first, second, ref_csv = sequence.first.step, sequence.second.step, sequence.ref_csv
    between = {s: v for s, v in _csv_losses(sequence.second.run).items() if first < s <= second}
    assert between and between == {s: ref_csv[s] for s in between}, (between, ref_csv)


@ONE_WORKER
def test_resume_to_the_end_gives_the_uninterrupted_runs_losses(sequence: Sequence):
    assert sequence.third_code == 0, sequence.third_log[-4000:]
    summary, second, ref_losses = sequence.third_summary, sequence.second.step, sequence.ref_losses
    assert summary["resumed_from_step"] == second and summary["steps"] == MAX_STEPS
    resumed = {p["step"]: p["loss"] for p in summary["losses"]}
    assert sorted(resumed) == list(range(second + 1, MAX_STEPS + 1))
    assert resumed == {s: ref_losses[s] for s in resumed}, "the resumed run saw other batches (or other weights)"

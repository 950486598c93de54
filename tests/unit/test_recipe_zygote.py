"""The tests' recipe runner (``tests/recipe_zygote.py``): a script forked from the zygote behaves as under a fresh
``python script.py``, and the ranks Lightning's launcher starts from it are forked too, in its process group and
onto its output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.recipe_zygote import ZYGOTE_ENV, run_command, start

SCRIPT = f"""
import json, os, sys
print(json.dumps({{"argv": sys.argv, "cwd": os.getcwd(), "name": __name__, "path0": sys.path[0],
                  "flag": os.environ.get("RUNNER_FLAG"), "zygote": bool(os.environ.get("{ZYGOTE_ENV}"))}}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""

LAUNCHER = """
import os, sys
import lightning.pytorch.strategies.launchers.subprocess_script as launcher

child = launcher.subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "rank.py")],
                                  env=dict(os.environ, LOCAL_RANK="1"), cwd=os.getcwd())
print(f"launcher pid {os.getpid()} group {os.getpgrp()} child {type(child).__name__}", flush=True)
sys.exit(10 + child.wait(timeout=60))
"""

RANK = """
import os
print(f"rank {os.environ['LOCAL_RANK']} pid {os.getpid()} group {os.getpgrp()} parent {os.getppid()}", flush=True)
raise SystemExit(3)
"""


def _script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_a_forked_script_gets_the_command_lines_argv_cwd_env_and_exit_code(tmp_path):
    import json

    script = _script(tmp_path, "show.py", SCRIPT)
    proc = run_command([sys.executable, str(script), "7", "x=1"], cwd=tmp_path,
                       env=dict(os.environ, RUNNER_FLAG="yes"), timeout=60)
    assert proc.returncode == 7, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen == {"argv": [str(script), "7", "x=1"], "cwd": str(tmp_path), "name": "__main__",
                    "path0": str(tmp_path), "flag": "yes", "zygote": True}
    assert proc.stderr == "to stderr\n"


def test_a_forked_scripts_uncaught_exception_prints_its_traceback_and_exits_1(tmp_path):
    script = _script(tmp_path, "boom.py", "raise ValueError('no good')\n")
    proc = run_command([sys.executable, str(script)], cwd=tmp_path, timeout=60)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "ValueError: no good" in proc.stderr


def test_lightnings_launcher_forks_its_rank_into_its_group_and_onto_its_output(tmp_path):
    _script(tmp_path, "rank.py", RANK)
    launcher = _script(tmp_path, "launch.py", LAUNCHER)
    proc = run_command([sys.executable, str(launcher)], cwd=tmp_path, timeout=60)
    assert proc.returncode == 13, proc.stdout + proc.stderr  # 10 + the rank's exit code
    lines = {line.split()[0]: line.split() for line in proc.stdout.splitlines()}  # in either order
    _, _, pid, _, group, _, kind = lines["launcher"]
    assert kind == "ForkedProcess" and group == pid  # a group of its own, as start_new_session
    _, local_rank, _, _, _, rank_group, _, parent = lines["rank"]
    assert local_rank == "1" and rank_group == group  # in the launcher's group, on its stdout
    assert parent != pid  # forked from the zygote, not started by the launcher


def test_a_run_past_its_timeout_is_killed_with_its_group(tmp_path):
    script = _script(tmp_path, "hang.py", "import time\ntime.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_command([sys.executable, str(script)], cwd=tmp_path, timeout=1)


def test_a_signal_ends_a_forked_run_as_it_ends_a_process(tmp_path):
    script = _script(tmp_path, "wait.py", "import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    log = tmp_path / "log"
    with open(log, "w") as out, open(os.devnull) as devnull:
        proc = start([sys.executable, str(script)], cwd=tmp_path, fds=(devnull.fileno(), out.fileno(), out.fileno()))
    deadline = time.monotonic() + 60
    while log.read_text() != "up\n" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM


def test_the_stand_in_python_runs_code_forked_and_exits_as_it_did(tmp_path):
    from tests.recipe_zygote import python_command

    python, env = python_command(tmp_path)
    # Lightning is in sys.modules without an import only in a process forked from the zygote.
    code = "import sys; print(sys.argv, __name__, 'lightning.pytorch' in sys.modules); sys.exit(4)"
    proc = subprocess.run([python, "-c", code, "a"], env=dict(os.environ, **env), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 4, proc.stderr
    assert proc.stdout == "['-c', 'a'] __main__ True\n"

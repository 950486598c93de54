"""Recipe runs for the tests, in interpreters forked from one that has already imported torch, Lightning, Hydra and
the package.

A recipe run on 2 CPU processes spends most of its time starting Python: each process imports torch and Lightning
(7-9 s of CPU on the CI machine, Lightning pulling in torchmetrics, scipy and transformers) before a few steps that
take under a second. The tests start dozens of runs. :func:`run_recipe` runs ``recipes/<script>`` the way the
command line does (``__main__``, ``sys.argv``, the environment, the working directory, stdout and stderr to their
own files, exit code) in a process forked from a *zygote*: one server per test process that imported everything
once. When Lightning's launcher starts the other local ranks (``subprocess.Popen([sys.executable, script, ...])``),
those are forked from the zygote too, into the launcher's process group and onto its stdout and stderr, as a real
``Popen`` would put them. Nothing else changes: Hydra composes, the launcher re-launches the app with its hydra
overrides, the ranks meet over gloo.

``run_recipe(..., fresh=True)`` starts a real interpreter instead; the tests that check the path a user's command
takes byte for byte (the main job's run, what is imported before Lightning) use it.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]

PRELOAD = ("torch", "lightning.pytorch", "hydra", "omegaconf", "lightning_vescale", "lightning_vescale.recipe",
           "lightning_vescale.recipe.runner", "lightning_vescale.lightning", "matplotlib", "matplotlib.pyplot")
"""What the zygote imports before it forks: what every recipe process would import first."""

ZYGOTE_ENV = "VESCALE_TEST_ZYGOTE"
"""Set in a forked run: the zygote's socket, so that the launcher's ranks are forked from it as well."""

_HEADER = struct.Struct("!Q")


# --- the server ---------------------------------------------------------------------------------------------------


def serve(path: str) -> None:
    """The zygote: import :data:`PRELOAD`, then fork one child per request on the unix socket at ``path`` and tell
    the requester its pid and, later, its exit code. Ends when its stdin closes (the test process is gone)."""
    import matplotlib

    matplotlib.use("Agg")
    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:  # forking a process with threads is not safe
        raise RuntimeError(f"the zygote has {threading.active_count()} threads after its imports; it must have one")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    children: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([server, sys.stdin], [], [], 0.05)
        if sys.stdin in readable and not sys.stdin.buffer.read1(1):
            return
        if server in readable:
            conn, _ = server.accept()
            request, fds = _receive(conn)
            pid = os.fork()
            if pid == 0:
                server.close()
                for other in children.values():
                    other.close()
                conn.close()
                _run_child(request, fds)  # does not return
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):  # the requester may be gone
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                conn.close()


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while len(data) < _HEADER.size:
        data += conn.recv(1 << 20)
    (size,) = _HEADER.unpack_from(data)
    while len(data) < _HEADER.size + size:
        data += conn.recv(1 << 20)
    return json.loads(data[_HEADER.size:_HEADER.size + size]), list(fds)


def _match_thread_count() -> None:
    """torch's CPU thread pool read ``OMP_NUM_THREADS`` when the zygote imported it; a run with another value gets
    its own, as a fresh interpreter would."""
    import torch

    wanted = os.environ.get("OMP_NUM_THREADS")
    if wanted and wanted.isdigit() and int(wanted) != torch.get_num_threads():
        torch.set_num_threads(int(wanted))


def _run_child(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become the requested process and run its script as ``__main__``."""
    import atexit as child_atexit
    import logging
    import runpy
    import traceback
    import warnings

    code = 1
    try:
        os.setpgid(0, request["pgid"])  # 0: a group of its own (start_new_session); else the launcher's
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if "ignore" in os.environ.get("PYTHONWARNINGS", ""):
            warnings.simplefilter("ignore")
        _match_thread_count()
        args = list(request["argv"][1:])
        _install_launcher_fork()
        try:
            if args[:1] == ["-c"]:  # python -c CODE ARGS
                sys.argv, sys.path[0] = ["-c", *args[2:]], ""
                exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            else:  # python SCRIPT ARGS
                sys.argv = args
                sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as ``python script.py`` sets it
                runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - as the interpreter would: print it, exit 1
            traceback.print_exc()
            code = 1
        child_atexit._run_exitfuncs()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


# --- the client ---------------------------------------------------------------------------------------------------


class ForkedProcess:
    """A process the zygote forked, with the part of :class:`subprocess.Popen`'s interface that the tests and
    Lightning's launcher use (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``)."""

    def __init__(self, conn: socket.socket, pid: int, args: Sequence[str]) -> None:
        self._conn, self.pid, self.args = conn, pid, list(args)
        self.returncode: Optional[int] = None
        self._buffer = b""

    def _read(self, timeout: Optional[float]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([self._conn], [], [], left)
            if not readable:
                return
            chunk = self._conn.recv(64)
            if not chunk:  # the zygote is gone: the child's status is lost with it
                self.returncode = -signal.SIGKILL
                break
            self._buffer += chunk
            if self._buffer.endswith(b"\n"):
                self.returncode = int(self._buffer)
        self._conn.close()

    def poll(self) -> Optional[int]:
        self._read(0.0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


class Zygote:
    """The client of one zygote server (started on first use; it ends with the process that started it)."""

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def start(cls, env: dict[str, str]) -> Zygote:
        folder = tempfile.mkdtemp(prefix="vescale-zygote-")
        path = os.path.join(folder, "socket")
        proc = subprocess.Popen([sys.executable, "-c", f"from tests.recipe_zygote import serve; serve({path!r})"],
                                cwd=ROOT, env=dict(env, PYTHONPATH=_pythonpath(env)), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:  # an import may print before the server is ready
            if line == "ready\n":
                break
        else:
            raise RuntimeError(f"the recipe zygote did not start (exit code {proc.wait()})")
        atexit.register(_stop, proc)
        return cls(path)

    def popen(self, args: Sequence[str], *, cwd: str, env: dict[str, str], fds: Sequence[int], pgid: int = 0) -> ForkedProcess:
        """Fork ``args`` (``[python, script, *argv]``) with ``fds`` as its stdin, stdout and stderr."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        payload = json.dumps({"argv": list(args), "cwd": cwd, "env": env, "pgid": pgid}).encode()
        socket.send_fds(conn, [_HEADER.pack(len(payload)) + payload], list(fds))
        line = b""
        while not line.endswith(b"\n"):
            chunk = conn.recv(64)
            if not chunk:
                raise RuntimeError("the recipe zygote closed the connection before forking")
            line += chunk
        return ForkedProcess(conn, int(line), args)

    def popen_child(self, args: Sequence[str], *, cwd: str, env: dict[str, str]) -> ForkedProcess:
        """Fork ``args`` where a ``Popen`` child of this process would be: on this process's stdin, stdout and
        stderr, in its process group."""
        return self.popen([str(a) for a in args], cwd=cwd, env=env, fds=(0, 1, 2), pgid=os.getpgrp())


def _pythonpath(env: dict[str, str]) -> str:
    return os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)


def _stop(proc: subprocess.Popen) -> None:
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


_zygote: Optional[Zygote] = None


def zygote() -> Zygote:
    """This process's zygote, started on the first call (one thread per process; each run sets its own warnings)."""
    global _zygote
    if _zygote is None:
        _zygote = Zygote.start(dict(os.environ, OMP_NUM_THREADS="1"))
    return _zygote


def recipe_env() -> dict[str, str]:
    """The environment of the recipe runs: one thread per process (2 cores), warnings off."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


# --- in a forked run: Lightning's launcher forks the other ranks from the zygote as well -------------------------


class _LauncherSubprocess:
    """Stands in for the ``subprocess`` module in Lightning's subprocess launchers: ``Popen`` of a Python script
    (the launcher re-running the app for a local rank) forks it from the zygote, into the caller's process group
    and onto its stdin, stdout and stderr; anything else goes to the real module."""

    def __init__(self, path: str) -> None:
        self._zygote = Zygote(path)

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    def Popen(self, args: Any, *rest: Any, **kwargs: Any) -> Any:  # noqa: N802 - subprocess.Popen's name
        script = isinstance(args, (list, tuple)) and len(args) > 1 and args[0] == sys.executable
        plain = not rest and set(kwargs) <= {"env", "cwd"}
        if not (script and plain and str(args[1]).endswith(".py")):
            return subprocess.Popen(args, *rest, **kwargs)
        return self._zygote.popen_child(args, cwd=kwargs.get("cwd") or os.getcwd(),
                                        env=dict(kwargs.get("env") or os.environ))


def _install_launcher_fork() -> None:
    path = os.environ.get(ZYGOTE_ENV)
    if not path:
        return
    stand_in = _LauncherSubprocess(path)
    for name in ("lightning.pytorch.strategies.launchers.subprocess_script",
                 "lightning.fabric.strategies.launchers.subprocess_script"):
        module = sys.modules.get(name) or importlib.import_module(name)
        module.subprocess = stand_in  # type: ignore[attr-defined]


# --- what the tests call ------------------------------------------------------------------------------------------


def run_command(cmd: Sequence[str], *, cwd: Path = ROOT, env: Optional[dict[str, str]] = None, timeout: float = 300,
                fresh: bool = False) -> subprocess.CompletedProcess:
    """Run ``cmd`` (``[sys.executable, script, *args]``) to its end, capturing stdout and stderr as text, like
    ``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)``: forked from the zygote, or with
    ``fresh`` in a new interpreter. On a timeout its process group is killed and ``TimeoutExpired`` raised."""
    env = recipe_env() if env is None else env
    if fresh:
        return subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull) as devnull:
        proc = start(cmd, cwd=cwd, env=env, fds=(devnull.fileno(), out.fileno(), err.fileno()))
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.wait(30)
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(list(cmd), proc.returncode, out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))


def start(cmd: Sequence[str], *, cwd: Path = ROOT, env: Optional[dict[str, str]] = None,
          fds: Sequence[int] = (0, 1, 2)) -> ForkedProcess:
    """Start ``cmd`` forked from the zygote in a process group of its own (``start_new_session``), with ``fds`` as
    its stdin, stdout and stderr; the launcher's ranks join that group."""
    env = dict(recipe_env() if env is None else env)
    env[ZYGOTE_ENV] = zygote().path
    env["PYTHONPATH"] = _pythonpath(env)
    return zygote().popen([str(c) for c in cmd], cwd=str(cwd), env=env, fds=fds)


def python_command(folder: Path) -> tuple[str, dict[str, str]]:
    """An executable in ``folder`` that stands in for ``python`` (``tests/zygote_python.py``), and the environment
    it needs: for scripts that run ``$PYTHON ...`` several times."""
    exe = folder / "python"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{ROOT / "tests" / "zygote_python.py"}" "$@"\n')
    exe.chmod(0o755)
    return str(exe), {ZYGOTE_ENV: zygote().path}


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def run_recipe(script: str, *overrides: str, timeout: float = 300, returncode: int = 0,
               fresh: bool = False) -> subprocess.CompletedProcess:
    """``python recipes/<script> experiment=smoke trainer.enable_progress_bar=false <overrides>``; its exit code
    must be ``returncode`` (an ``AssertionError`` shows the end of its output otherwise)."""
    cmd = [sys.executable, str(ROOT / "recipes" / script), "experiment=smoke", "trainer.enable_progress_bar=false",
           *overrides]
    proc = run_command(cmd, timeout=timeout, fresh=fresh)
    if proc.returncode != returncode:
        raise AssertionError(
            f"{' '.join(cmd)} exited with {proc.returncode}, not {returncode}:\n{proc.stdout[-4000:]}\n"
            f"{proc.stderr[-8000:]}"
        )
    return proc

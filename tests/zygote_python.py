"""``python tests/zygote_python.py ARGS``: ``python ARGS`` (a script or ``-c CODE``) forked from the recipe zygote
whose socket is in ``$VESCALE_TEST_ZYGOTE``, with this process's cwd, environment, stdin/stdout/stderr and process
group; signals sent to it go to the run, and it exits as the run did. For scripts that call ``$PYTHON`` (see
``tests.recipe_zygote.python_command``)."""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.recipe_zygote import ZYGOTE_ENV, Zygote  # noqa: E402 - after the repository is on the path


def main() -> None:
    proc = Zygote(os.environ[ZYGOTE_ENV]).popen_child([sys.executable, *sys.argv[1:]], cwd=os.getcwd(),
                                                      env=dict(os.environ))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: proc.send_signal(signum))
    code = proc.wait()
    if code < 0:  # ended by a signal: end the same way
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()

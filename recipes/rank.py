"""A rank's entry under the ``reshard`` launcher: ``python -m reshard.recipes.rank <job> [overrides]``.

The launcher starts it through :data:`BLOCKED_START`: a ``python -S`` (no ``site``, no ``.pth``
imports) that blocks SIGINT and SIGTERM and replaces itself with this module's interpreter, which
starts with both still blocked (a signal mask and pending signals survive ``exec``). A Ctrl-C
while that interpreter imports ``site`` would otherwise be a "Fatal Python error" and a traceback
per rank.

It also asks for SIGINT when the launcher dies (Linux's parent-death signal, which survives
``exec`` too: the rank stops as at a Ctrl-C), and exits at once where the launcher is gone
already (its parent is not the launcher whose pid :data:`LAUNCHER_PID_ENV` names). torch's agent
starts each rank in a session of its own, so a Ctrl-C that reached the launcher while it was still
starting them (before the agent held every rank it started) left a rank running on, unseen,
after the launcher had exited.

From its first instruction, before torch is imported (seconds), Ctrl-C or SIGTERM (one that came
during the start, held until now, included) ends the rank at once and quietly: an import cut
short has nothing to keep or clean up, and the launcher says the one line. The job's own handlers
(:func:`reshard.recipes.launch.hydra_main`) take over once it starts. ``torchrun -m
reshard.recipes.<job>`` runs the same jobs without this.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

from reshard.recipes.exits import EXIT_INTERRUPTED, LAUNCHER_PID_ENV

STOPS = (signal.SIGINT, signal.SIGTERM)
# ``python -S -c BLOCKED_START <job> [overrides]``: this module, started with STOPS blocked and
# SIGINT due when its parent (the launcher) dies: ``prctl(PR_SET_PDEATHSIG, SIGINT)`` on Linux; a
# parent gone before that (the rank's parent no longer the launcher whose pid the environment
# names) ends it
BLOCKED_START = (
    "import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM}); "
    "linux = sys.platform.startswith('linux'); "
    "linux and __import__('ctypes').CDLL(None).prctl(1, signal.SIGINT); "
    f"launcher = os.environ.get({LAUNCHER_PID_ENV!r}); "
    "launcher and os.getppid() != int(launcher) and os._exit(130); "
    "os.execv(sys.executable, [sys.executable, '-m', 'reshard.recipes.rank', *sys.argv[1:]])"
)


def _leave(signum: int, frame: object) -> None:
    os._exit(EXIT_INTERRUPTED)


def main() -> None:
    for signum in STOPS:
        signal.signal(signum, _leave)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)  # one held since the start is delivered now
    job = sys.argv.pop(1)  # the job's overrides follow, as its own entry reads them
    importlib.import_module(f"reshard.recipes.{job}").main()


if __name__ == "__main__":
    main()

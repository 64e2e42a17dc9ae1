"""A rank's entry under the ``reshard`` launcher: ``python -m reshard.recipes.rank <job> [overrides]``.

From its first instruction, before torch is imported (seconds), Ctrl-C or SIGTERM ends the rank at
once and quietly: an import cut short has nothing to keep or clean up, and the launcher says the
one line. The job's own handlers (:func:`reshard.recipes.launch.hydra_main`) take over once it
starts. ``torchrun -m reshard.recipes.<job>`` runs the same jobs without this.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

from reshard.recipes.exits import EXIT_INTERRUPTED


def _leave(signum: int, frame: object) -> None:
    os._exit(EXIT_INTERRUPTED)


def main() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _leave)
    job = sys.argv.pop(1)  # the job's overrides follow, as its own entry reads them
    importlib.import_module(f"reshard.recipes.{job}").main()


if __name__ == "__main__":
    main()

"""The wall time and the CPU time of a command and every process it starts, reaped or orphaned.

    python bench/cpu_of.py python -m torch.distributed.run --nproc-per-node 2 -m reshard.recipes.generate ...

This process becomes a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``): processes the command
leaves behind (a fork server, a resource tracker) are reparented here and reaped, so their CPU
counts in ``getrusage(RUSAGE_CHILDREN)`` too. Prints ``rc=... wall=... cpu=...`` (seconds).
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit("usage: python bench/cpu_of.py COMMAND [ARGS...]")
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    while True:  # every orphan the command left
        try:
            os.wait()
        except ChildProcessError:
            break
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"rc={proc.returncode} wall={time.perf_counter() - t0:.1f} cpu={usage.ru_utime + usage.ru_stime:.1f}")
    if proc.returncode:
        print(proc.stderr[-2000:], file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

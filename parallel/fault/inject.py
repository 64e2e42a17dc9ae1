"""Failure injection for tests and benches: a rank killed (SIGKILL) or hung at a given step."""

from __future__ import annotations

import os
import signal

import torch.distributed as dist


def inject_kill(kill_at: tuple[int, int], *, hang: bool = False):
    """A ``step_ready`` listener that SIGKILLs rank ``kill_at[0]`` before step ``kill_at[1]`` runs
    (``hang``: stops it there for good instead, every thread, as a process stuck in a kernel)."""

    def hook(index: int, step) -> None:
        if (dist.get_rank(), index) == tuple(kill_at):
            os.kill(os.getpid(), signal.SIGSTOP) if hang else die()

    return hook


def die() -> None:
    """This process ends at once, as in a crash: SIGKILL, no clean-up."""
    os.kill(os.getpid(), signal.SIGKILL)  # fault injection: no cleanup, as a crash

"""Whole-job restarts by torchrun: which attempt this is, and a store prefix of its own per attempt."""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist


def restart_count() -> int:
    """Which attempt of the job this is (torchrun counts restarts)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def job_store(attempt: int):
    """A client of the job's TCP store (``MASTER_ADDR``/``MASTER_PORT``), keys of this attempt."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=30),
    )
    return dist.PrefixStore(f"attempt{attempt}", store)

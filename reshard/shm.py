"""Shared-memory files: created without a name, mapped by every rank, gone when the last mapping goes."""

from __future__ import annotations

import os
import tempfile
import time

import torch.distributed as dist


def shared_path(prefix: str) -> str:
    """A fresh file path in shared memory (``/dev/shm`` when present), the same on every rank."""
    name = [os.path.join(_shm_root(), f"{prefix}-{os.getpid()}-{time.time_ns()}.bin")]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    return name[0]


def _shm_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def map_shared(prefix: str, factory):
    """``factory(path)`` on every rank over one fresh shared-memory file that never has a name.

    Rank 0 creates the file unnamed (``O_TMPFILE``) and maps it first (sizing it); the other
    ranks map the same file through ``/proc/<pid>/fd/<fd>``. No rank can die while a name exists,
    so a crash leaves nothing in ``/dev/shm``; the memory goes back to the system when the last
    mapping goes. Where ``O_TMPFILE`` is missing, a named file is unlinked once all have mapped it
    (collective).
    """
    if not hasattr(os, "O_TMPFILE"):
        return _map_named(prefix, factory)
    fd, ref, obj = None, [None], None
    if dist.get_rank() == 0:
        fd = os.open(_shm_root(), os.O_TMPFILE | os.O_RDWR, 0o600)
        ref = [f"/proc/{os.getpid()}/fd/{fd}"]
        obj = factory(ref[0])
    try:
        dist.broadcast_object_list(ref, src=0)
        obj = obj if obj is not None else factory(ref[0])
        dist.barrier()  # every rank has mapped it before rank 0 closes the descriptor
    finally:
        if fd is not None:
            os.close(fd)
    return obj


def _map_named(prefix: str, factory):
    path = shared_path(prefix)
    obj = factory(path)
    dist.barrier()  # every rank has mapped it
    if dist.get_rank() == 0:
        os.unlink(path)
    return obj

"""Shared-memory files, the one owner of them: created without a name, mapped as tensors, cleaned up.

- **Mapping** (:func:`map_file`): a file as ``nbytes`` bytes (a flat ``uint8`` tensor; view it as
  any dtype and shape), created or grown to that size, its contents kept.
- **Creation without a name**: :func:`map_shared` maps one fresh file on every rank that no
  directory ever lists (``O_TMPFILE``; where that is missing, a named file unlinked once every rank
  mapped it), so a crash leaves nothing behind; :func:`publish` writes a file that appears under
  its name only once complete.
- **Clean-up**: :func:`unlink` removes a name (mappings stay valid, the memory goes with the last).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def shm_root() -> Path:
    """Where shared-memory files go: ``/dev/shm`` when present, else the temporary directory."""
    return Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())


# ---- mapping ------------------------------------------------------------------------------------
def map_file(path: str | os.PathLike, nbytes: int, *, shared: bool = True) -> torch.Tensor:
    """The file at ``path`` mapped as ``nbytes`` bytes: a flat ``uint8`` CPU tensor.

    ``shared=True``: writes reach the file (and every process mapping it); a missing file is
    created and a short one grown to ``nbytes`` (zeros), an existing file's contents are kept.
    ``shared=False``: a private copy-on-write mapping for reading a file of at least ``nbytes``.
    """
    if nbytes == 0:  # nothing to map (mmap refuses zero bytes)
        return torch.empty(0, dtype=torch.uint8)
    if shared:
        _grow(path, nbytes)
    return torch.from_file(str(path), shared=shared, size=nbytes, dtype=torch.uint8)


def _grow(path: str | os.PathLike, nbytes: int) -> None:
    """Create the file at ``path`` if missing and make it at least ``nbytes`` long (zeros past
    its end). ``torch.from_file`` grows a short file itself, but then writes a zero byte at its
    offset 0: over the first byte another process already wrote, where several map one new file
    at once."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < nbytes:
            os.ftruncate(fd, nbytes)  # (a file another process grew meanwhile keeps its size and bytes)
    finally:
        os.close(fd)


# ---- creation without a name --------------------------------------------------------------------
def shared_path(prefix: str) -> str:
    """A fresh file path in shared memory, the same on every rank (collective)."""
    name = [str(shm_root() / f"{prefix}-{os.getpid()}-{time.time_ns()}.bin")]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    return name[0]


@contextlib.contextmanager
def _unnamed(directory: Path) -> Iterator[str]:
    """A new file in ``directory`` that has no name (``O_TMPFILE``), as a path any process of this
    machine can open (``/proc/<pid>/fd/<fd>``) while the context lasts."""
    fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    try:
        yield f"/proc/{os.getpid()}/fd/{fd}"
    finally:
        os.close(fd)


def map_shared(prefix: str, factory: Callable[[str], T]) -> T:
    """``factory(path)`` on every rank over one fresh shared-memory file that never has a name
    (collective); ``factory`` maps it (:func:`map_file`) and returns what holds the mapping.

    Rank 0 creates the file unnamed (``O_TMPFILE``) and maps it first (sizing it); the other
    ranks map the same file through ``/proc/<pid>/fd/<fd>``. No rank can die while a name exists,
    so a crash leaves nothing in ``/dev/shm``; the memory goes back to the system when the last
    mapping goes. Where ``O_TMPFILE`` is missing, a named file is unlinked once all have mapped it.
    """
    if not hasattr(os, "O_TMPFILE"):
        return _map_named(prefix, factory)
    with contextlib.ExitStack() as stack:
        ref, obj = [None], None
        if dist.get_rank() == 0:
            ref = [stack.enter_context(_unnamed(shm_root()))]
            obj = factory(ref[0])
        dist.broadcast_object_list(ref, src=0)
        obj = obj if obj is not None else factory(ref[0])
        dist.barrier()  # every rank has mapped it before rank 0 closes the descriptor
    return obj


def _map_named(prefix: str, factory: Callable[[str], T]) -> T:
    path = shared_path(prefix)
    obj = factory(path)
    dist.barrier()  # every rank has mapped it
    if dist.get_rank() == 0:
        unlink(path)
    return obj


def publish(path: str | os.PathLike, data: torch.Tensor) -> None:
    """A new file ``path`` holding the bytes ``data`` (flat ``uint8``), which appears under its name
    only once complete: written unnamed (``O_TMPFILE``), then linked. ``FileExistsError`` if the
    name exists (nothing is overwritten); a failed write leaves nothing behind."""
    path = Path(path)
    if not hasattr(os, "O_TMPFILE"):
        return _publish_named(path, data)
    with _unnamed(path.parent) as ref:
        _fill(ref, data)
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:  # linkat(AT_SYMLINK_FOLLOW) through dst_dir_fd: names the unnamed file
            os.link(ref, path.name, dst_dir_fd=dir_fd)
        finally:
            os.close(dir_fd)


def _publish_named(path: Path, data: torch.Tensor) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.time_ns()}.tmp")
    try:
        _fill(tmp, data)
        os.link(tmp, path)  # unlike os.replace, refuses to overwrite
    finally:
        unlink(tmp)


def _fill(path: str | os.PathLike, data: torch.Tensor) -> None:
    """Size the file at ``path`` to ``data``'s bytes and write them through a shared mapping."""
    map_file(path, data.numel()).copy_(data)


# ---- clean-up -----------------------------------------------------------------------------------
def unlink(path: str | os.PathLike) -> None:
    """Remove the name ``path`` (gone already is fine); mappings of the file stay valid and its
    memory goes back to the system with the last of them."""
    Path(path).unlink(missing_ok=True)


__all__ = [
    "map_file",
    "map_shared",
    "publish",
    "shared_path",
    "shm_root",
    "unlink",
]

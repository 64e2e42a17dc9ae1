"""Flush and fetch: move one contiguous chunk of KV between media in the background (DéjàVuLib's
lowest level).

A chunk is a contiguous tensor moved as its bytes. The sending side *flushes* it under a key; the
receiving side *fetches* the key into a tensor of the same byte size. The transport depends on the
two media (:func:`choose_transport`):

- ``local``: same process, a device/host ``copy_``;
- ``shm``: CPU shared memory between processes of one machine, one region per key in ``/dev/shm``;
- ``p2p``: ``torch.distributed`` isend/irecv on a dedicated background process group;
- ``file``: one safetensors file per key, written atomically.

Every transport runs its jobs on a background thread of its own (P2P: one per direction), first
in first out, so per peer the order of flushes and fetches is kept. A :class:`Job` reports completion; ``wait`` raises
``TimeoutError`` naming the job, or re-raises on the caller's thread an error from the background.
Each transport counts the bytes and calls it moved (:class:`TransportStats`).
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch
import torch.distributed as dist

from reshard import shm
from reshard.kv.jobs import Job, JobQueue, Key, TransportStats
from reshard.mesh import cached_group

MediumKind = Literal["device", "cpu", "disk"]
TransportKind = Literal["local", "shm", "p2p", "file"]

_HEADER_TAG, _DATA_TAG = 0x4B5601, 0x4B5602


# ---- media and the choice of transport --------------------------------------------------------
@dataclass(frozen=True)
class Medium:
    """Where a chunk lives: a rank's device or CPU memory, or a disk; ``node`` is the machine."""

    kind: MediumKind
    rank: int
    node: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("device", "cpu", "disk") or self.rank < 0 or self.node < 0:
            raise ValueError(
                f"a medium is kind 'device', 'cpu' or 'disk' with rank >= 0 and node >= 0; "
                f"got kind={self.kind!r}, rank={self.rank}, node={self.node}"
            )


def choose_transport(src: Medium, dst: Medium) -> TransportKind:
    """The transport from ``src`` to ``dst``.

    A disk on either side -> ``file`` (the directory must be visible to both ranks); the same rank
    -> ``local``; CPU to CPU on one machine -> ``shm`` (one copy into and one out of a shared
    region, no socket and no matching of sends with receives, so the receiver may fetch whenever
    it likes); any other pair -> ``p2p``.
    """
    if "disk" in (src.kind, dst.kind):
        return "file"
    if src.rank == dst.rank:
        return "local"
    if src.kind == dst.kind == "cpu" and src.node == dst.node:
        return "shm"
    return "p2p"


def open_transport(
    src: Medium,
    dst: Medium,
    *,
    run_id: str | None = None,
    directory: str | os.PathLike | None = None,
    group: dist.ProcessGroup | None = None,
) -> Transport:
    """The transport :func:`choose_transport` picks, opened on this rank (one of the two sides).

    ``shm`` needs ``run_id`` (the same on both sides); ``file`` needs ``directory``; ``p2p`` uses
    ``group`` or a background group of its own (:func:`reshard.mesh.cached_group`).
    """
    kind = choose_transport(src, dst)
    if kind == "local":
        return LocalTransport()
    if kind == "file":
        if directory is None:
            raise ValueError(f"a transport from {src} to {dst} writes files: pass directory=")
        return FileTransport(directory)
    me = dist.get_rank()
    if me not in (src.rank, dst.rank):
        raise ValueError(f"rank {me} is neither side of a transport from {src} to {dst}")
    if kind == "shm":
        if run_id is None:
            raise ValueError(f"a transport from {src} to {dst} uses shared memory: pass run_id=")
        return SharedMemoryTransport(run_id)
    return P2PTransport(dst.rank if me == src.rank else src.rank, group)


# ---- transports -------------------------------------------------------------------------------
class Transport(Protocol):
    """Flush (send/write) and fetch (receive/read) of contiguous chunks, keyed."""

    kind: TransportKind
    stats: TransportStats

    def flush(self, chunk: torch.Tensor, key: Key) -> Job: ...

    def fetch(self, key: Key, out: torch.Tensor) -> Job: ...

    def close(self, timeout: float = 10.0) -> None: ...


class _Queued:
    """A transport with its own :class:`JobQueue`."""

    kind: TransportKind

    def __init__(self) -> None:
        self._queue = JobQueue(self.kind)
        self.stats = self._queue.stats

    def close(self, timeout: float = 10.0) -> None:
        """Finish submitted jobs (up to ``timeout`` s; the rest fail), join the thread, clean up."""
        self._queue.close(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LocalTransport(_Queued):
    """Same process: ``flush`` registers the chunk (no copy; leave it unchanged until fetched),
    ``fetch`` copies it into ``out`` (``non_blocking`` on a device, then waits for the copy).
    A fetch submitted before the flush of its key fails with ``KeyError``."""

    kind = "local"

    def __init__(self) -> None:
        super().__init__()
        self._chunks: dict[Key, torch.Tensor] = {}
        self._lock = threading.Lock()

    def flush(self, chunk: torch.Tensor, key: Key) -> Job:
        data = _bytes(chunk, "chunk", key)
        return self._queue.submit("flush", key, data.numel(), lambda: self._register(key, data))

    def _register(self, key: Key, data: torch.Tensor) -> None:
        """In queue order, so a fetch submitted after this flush always finds the chunk."""
        with self._lock:
            if key in self._chunks:
                raise ValueError(f"key {key!r} was flushed already and not fetched yet")
            self._chunks[key] = data

    def fetch(self, key: Key, out: torch.Tensor) -> Job:
        dst = _bytes(out, "out", key)
        return self._queue.submit("fetch", key, dst.numel(), lambda: self._copy(key, dst))

    def _copy(self, key: Key, dst: torch.Tensor) -> None:
        with self._lock:
            if key not in self._chunks:
                raise KeyError(f"no chunk was flushed under key {key!r} before this fetch")
            src = self._chunks[key]
            _check_size(key, src.numel(), dst)
            del self._chunks[key]
        dst.copy_(src, non_blocking=True)
        device = dst.device if dst.device.type != "cpu" else src.device
        if device.type != "cpu":  # the copy ran on this thread's current stream of that device
            torch.accelerator.current_stream(device).synchronize()


class SharedMemoryTransport(_Queued):
    """CPU shared memory between the processes of one machine: one region per key.

    A flush writes the chunk into an unnamed file (``O_TMPFILE``) in ``/dev/shm`` and then gives it
    the key's name (``reshard-kv-<run_id>-<key>``; :func:`reshard.shm.publish`), so a fetch never
    sees a partial region and a failed flush leaves nothing. A fetch waits for the name, copies
    the region out and removes it. :meth:`close` removes the regions this transport flushed that
    nobody fetched, so close the flushing side after the fetching side has fetched (e.g. after a
    barrier). Both sides use the same ``run_id``; a process killed between a flush and its fetch
    leaves that region behind.
    """

    kind = "shm"

    def __init__(self, run_id: str, root: str | os.PathLike | None = None) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", run_id):
            raise ValueError(f"run_id must be letters, digits, '_', '.' or '-'; got {run_id!r}")
        self.root = Path(root) if root is not None else shm.shm_root()
        if not self.root.is_dir():
            raise ValueError(f"shared-memory directory {str(self.root)!r} does not exist")
        self.prefix = f"reshard-kv-{run_id}-"
        self._published: set[Path] = set()
        super().__init__()

    def region(self, key: Key) -> Path:
        """The path of ``key``'s region (what a fetch waits for)."""
        return self.root / (self.prefix + _key_name(key))

    def flush(self, chunk: torch.Tensor, key: Key) -> Job:
        data = _bytes(chunk, "chunk", key)
        return self._queue.submit("flush", key, data.numel(), lambda: self._write(self.region(key), data))

    def fetch(self, key: Key, out: torch.Tensor) -> Job:
        dst = _bytes(out, "out", key)
        return self._queue.submit("fetch", key, dst.numel(), lambda: self._read(key, self.region(key), dst))

    def close(self, timeout: float = 10.0) -> None:
        super().close(timeout)
        for path in self._published:
            shm.unlink(path)
        self._published.clear()

    def _write(self, path: Path, data: torch.Tensor) -> None:
        shm.publish(path, data)
        self._publish(path)

    def _publish(self, path: Path) -> None:
        self._published.add(path)
        if len(self._published) % 1024 == 0:  # forget regions that were fetched
            self._published = {p for p in self._published if p.exists()}

    def _read(self, key: Key, path: Path, dst: torch.Tensor) -> None:
        self._queue.poll_until(path.exists)
        _check_size(key, path.stat().st_size, dst)
        if dst.numel():
            dst.copy_(shm.map_file(path, dst.numel(), shared=False))
        shm.unlink(path)


class P2PTransport(_Queued):
    """``torch.distributed`` isend/irecv with one ``peer`` on a background process group.

    Flushes run on one thread and fetches on another, each in submission order, so two ranks may
    flush to each other before fetching; both ranks must issue the chunks of one direction in the
    same order. Each chunk is preceded by a 16-byte header (size, key hash), so a fetch of the
    wrong key or size raises ``ValueError`` (after draining the chunk, so the stream stays usable)
    instead of aborting the process in the backend. On gloo, device tensors go through the CPU.
    A receive cannot be interrupted: closing with a fetch its peer never flushes raises (see
    :meth:`JobQueue.close`). Use one transport per (group, peer).
    """

    kind = "p2p"

    def __init__(self, peer: int, group: dist.ProcessGroup | None = None) -> None:
        group = group if group is not None else cached_group(purpose="kv-transport")
        ranks = dist.get_process_group_ranks(group)
        if peer == dist.get_rank() or peer not in ranks:
            raise ValueError(
                f"peer {peer} must be another rank of the group (ranks {ranks}, this is rank {dist.get_rank()})"
            )
        self.peer, self.group = peer, group
        self._device = "cpu" if dist.get_backend(group) == "gloo" else None
        super().__init__()  # the fetch thread
        self._sends = JobQueue(self.kind, self.stats)

    def flush(self, chunk: torch.Tensor, key: Key) -> Job:
        data = _bytes(chunk, "chunk", key)
        return self._sends.submit("flush", key, data.numel(), lambda: self._send(key, data))

    def fetch(self, key: Key, out: torch.Tensor) -> Job:
        dst = _bytes(out, "out", key)
        return self._queue.submit("fetch", key, dst.numel(), lambda: self._recv(key, dst))

    def close(self, timeout: float = 10.0) -> None:
        try:
            self._sends.close(timeout)
        finally:
            super().close(timeout)

    def _send(self, key: Key, data: torch.Tensor) -> None:
        device = self._device or data.device
        header = torch.tensor([data.numel(), _key_hash(key)], dtype=torch.int64, device=device)
        works = [dist.isend(header, self.peer, group=self.group, tag=_HEADER_TAG)]
        if data.numel():
            works.append(dist.isend(data.to(device), self.peer, group=self.group, tag=_DATA_TAG))
        for work in works:
            work.wait()

    def _recv(self, key: Key, dst: torch.Tensor) -> None:
        device = torch.device(self._device or dst.device)
        header = torch.empty(2, dtype=torch.int64, device=device)
        dist.irecv(header, self.peer, group=self.group, tag=_HEADER_TAG).wait()
        nbytes, key_hash = header.tolist()
        direct = dst.device == device and nbytes == dst.numel()
        buf = dst if direct else torch.empty(nbytes, dtype=torch.uint8, device=device)
        if nbytes:
            dist.irecv(buf, self.peer, group=self.group, tag=_DATA_TAG).wait()
        if key_hash != _key_hash(key):
            raise ValueError(
                f"fetched key {key!r} from rank {self.peer}, which flushed a different key "
                f"next ({nbytes} bytes); flushes and fetches must be issued in the same order"
            )
        _check_size(key, nbytes, dst)
        if not direct:
            dst.copy_(buf)


class FileTransport(_Queued):
    """One safetensors file per key in ``directory`` (kept: disk is storage, not a channel).

    A flush writes a temporary file and renames it into place, so a fetch (which waits for the
    file) never reads a partial one; a failed flush removes its temporary file.
    """

    kind = "file"

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ValueError(f"file transport directory {str(self.directory)!r} does not exist")
        super().__init__()

    def path(self, key: Key) -> Path:
        """The file that holds ``key``'s chunk."""
        return self.directory / f"{_key_name(key)}.safetensors"

    def flush(self, chunk: torch.Tensor, key: Key) -> Job:
        data = _bytes(chunk, "chunk", key)
        return self._queue.submit("flush", key, data.numel(), lambda: self._write(self.path(key), data))

    def fetch(self, key: Key, out: torch.Tensor) -> Job:
        dst = _bytes(out, "out", key)
        return self._queue.submit("fetch", key, dst.numel(), lambda: self._read(key, self.path(key), dst))

    def _write(self, path: Path, data: torch.Tensor) -> None:
        from safetensors.torch import save_file

        tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.time_ns()}.tmp")
        try:
            save_file({"chunk": data.cpu()}, str(tmp))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def _read(self, key: Key, path: Path, dst: torch.Tensor) -> None:
        from safetensors import safe_open

        self._queue.poll_until(path.exists)
        with safe_open(str(path), framework="pt") as f:
            data = f.get_tensor("chunk")
        _check_size(key, data.numel(), dst)
        dst.copy_(data)


# ---- helpers ----------------------------------------------------------------------------------
def _bytes(t: torch.Tensor, what: str, key: Key) -> torch.Tensor:
    """``t`` as a flat uint8 view; ``ValueError`` unless contiguous."""
    _check_key(key)
    if not t.is_contiguous():
        raise ValueError(
            f"{what} for key {key!r} must be contiguous; got shape {tuple(t.shape)} with strides {t.stride()}"
        )
    return t.reshape(-1).view(torch.uint8)


def _check_key(key: Key) -> None:
    parts = key if isinstance(key, tuple) else (key,)
    if not parts or not all(isinstance(p, (int, str)) and not isinstance(p, bool) for p in parts):
        raise ValueError(f"a key is a string or a non-empty tuple of ints and strings; got {key!r}")


def _check_size(key: Key, nbytes: int, dst: torch.Tensor) -> None:
    if nbytes != dst.numel():
        raise ValueError(f"chunk for key {key!r} has {nbytes} bytes but the fetch buffer has {dst.numel()}")


def _key_name(key: Key) -> str:
    """A file name for ``key``: readable, with a digest so distinct keys never share one."""
    text = key if isinstance(key, str) else "-".join(map(str, key))
    digest = hashlib.blake2b(repr(key).encode(), digest_size=6).hexdigest()
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', text)[:64]}.{digest}"


def _key_hash(key: Key) -> int:
    return zlib.crc32(repr(key).encode())

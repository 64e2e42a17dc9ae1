"""A two-rank gloo process group for point-to-point messages between two generations of engine
groups that do not step together (KV mirrors, their supervisors' hosts, weight donors), and the
threads that run an owner's links (:class:`Links`)."""

from __future__ import annotations

import datetime
import pickle
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

LINK_TIMEOUT = datetime.timedelta(days=1)  # a quiet link is not a dead one


class Link:
    """A two-rank gloo process group named ``name`` in ``store``: ``side`` 0 sends, 1 receives.
    The group is built on first use, by the thread that uses the link (so building a link never
    blocks its owner, whether gloo connects then or, ``TORCH_GLOO_LAZY_INIT``, at the first
    message). A message is a header (two sizes), pickled metadata and a byte buffer. Waits block
    (a gloo wait with a timeout breaks the connection): a link whose peer died before it
    connected blocks its thread for good. :meth:`close` drops this end's group; an operation still
    blocked on it holds it until it returns (a gloo group torn down with an operation pending
    aborts the process), and the link's next operation raises ``RuntimeError``."""

    def __init__(self, store: dist.Store, name: str, side: int) -> None:
        self.store, self.name, self.side, self.peer = store, name, side, 1 - side
        self._pg: dist.ProcessGroup | None = None
        self._closed = False

    def _group(self) -> dist.ProcessGroup:
        if self._closed:
            raise RuntimeError(f"link {self.name} is closed")
        if self._pg is None:
            self._pg = dist.ProcessGroupGloo(dist.PrefixStore(self.name, self.store), self.side, 2, LINK_TIMEOUT)
        return self._pg

    def send(self, meta, data: torch.Tensor) -> None:
        pg = self._group()  # held until the message is out, whatever close() does meanwhile
        blob = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8)
        header = torch.tensor([blob.numel(), data.numel()], dtype=torch.int64)
        for t in (header, blob, data.cpu()):
            pg.send([t], self.peer, 0).wait()

    def recv(self) -> tuple[object, torch.Tensor]:
        """The next message: its metadata and bytes."""
        pg = self._group()  # held until the message is in, whatever close() does meanwhile
        header = torch.empty(2, dtype=torch.int64)
        pg.recv([header], self.peer, 0).wait()
        blob, data = torch.empty(int(header[0]), dtype=torch.uint8), torch.empty(int(header[1]), dtype=torch.uint8)
        pg.recv([blob], self.peer, 0).wait()
        pg.recv([data], self.peer, 0).wait()
        return pickle.loads(blob.numpy().tobytes()), data

    def close(self) -> None:
        """Drop this end's group (its peer's next operation fails); idempotent."""
        self._closed, self._pg = True, None


class Links:
    """An owner's links, each run by a daemon thread of its own (a link blocked on a peer that
    died blocks only its thread), and the owner's watcher thread: :meth:`watch` and :meth:`open`
    start them (nothing once :attr:`stopping`), :meth:`close` stops them all. ``connect()``: a
    new client of the job's store (each link has its own: a client blocked in a wait, as a link's
    lazy connection is, blocks every thread sharing it); ``name``: the threads' name prefix."""

    def __init__(self, connect: Callable[[], dist.Store], name: str) -> None:
        self.connect, self.name = connect, name
        self.stopping = threading.Event()
        self._lock = threading.Lock()  # open() and close() from different threads
        self._threads: list[tuple[Link | None, threading.Thread]] = []  # (its link, or None: the watcher)

    def watch(self, run: Callable[[], None]) -> None:
        """Run ``run()`` (the owner's watcher) on a thread of its own."""
        self._start(None, run)

    def open(self, name: str, side: int, run: Callable, *args) -> None:
        """Open link ``name`` (``side`` 0: sending) and run ``run(link, *args)`` on a thread of its
        own (which should close the link when it ends); ended threads are forgotten."""
        with self._lock:
            if not self.stopping.is_set():
                self._start(Link(self.connect(), name, side), run, *args)

    def _start(self, link: Link | None, run: Callable, *args) -> None:
        args = args if link is None else (link, *args)
        what = "watch" if link is None else ("out" if link.side == 0 else "in")
        thread = threading.Thread(target=run, args=args, name=f"{self.name}-{what}", daemon=True)
        self._threads = [(ln, t) for ln, t in self._threads if t.is_alive()] + [(link, thread)]
        thread.start()

    def close(self, timeout: float) -> None:
        """Stop (not collective; safe on an error path): every thread is joined, up to ``timeout``
        s in all, and every link closed. A thread still blocked then (on a peer that died before
        it connected) is left, a daemon, holding its link's group until its operation returns."""
        deadline = time.monotonic() + timeout
        self.stopping.set()
        with self._lock:
            threads, self._threads = self._threads, []
        for link, thread in threads:
            if link is not None:
                link.close()
            thread.join(max(0.0, deadline - time.monotonic()))

"""Background jobs with ids, completion checks and timeouts: what every KV transport
(:mod:`reshard.kv.transport`) and streamer (:mod:`reshard.kv.stream`) runs its moves as.

A :class:`JobQueue` owns one thread that runs submitted jobs first in first out and joins it in
``close()``; a :class:`Job` reports completion, and ``wait`` raises ``TimeoutError`` naming the
job or re-raises on the caller's thread an error from the background; :class:`TransportStats`
counts the calls and bytes of the jobs that succeeded.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

Key = str | tuple[int | str, ...]  # e.g. (request_id, layer, step) or a string

_IDS = itertools.count(1)


# ---- jobs and their queue ---------------------------------------------------------------------
class Job:
    """One flush or fetch run by a transport's background thread."""

    def __init__(self, op: str, key: Key, transport: str, nbytes: int) -> None:
        self.id = next(_IDS)
        self.op = op
        self.key = key
        self.transport = transport
        self.nbytes = nbytes
        self._event = threading.Event()
        self._error: BaseException | None = None

    def __repr__(self) -> str:
        return f"job {self.id} ({self.transport} {self.op} of key {self.key!r}, {self.nbytes} bytes)"

    def done(self) -> bool:
        """Whether the job has finished (successfully or not)."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the job finishes; re-raise its error here; ``TimeoutError`` after ``timeout`` s."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self!r} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error

    def _finish(self, error: BaseException | None) -> None:
        if error is not None:
            error.add_note(f"raised in the background by {self!r}")
        self._error = error
        self._event.set()


@dataclass
class TransportStats:
    """What one transport moved: calls and bytes of successful flushes and fetches."""

    flush_calls: int = 0
    flush_bytes: int = 0
    fetch_calls: int = 0
    fetch_bytes: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    @property
    def calls(self) -> int:
        return self.flush_calls + self.fetch_calls

    @property
    def bytes(self) -> int:
        return self.flush_bytes + self.fetch_bytes

    def add(self, job: Job) -> None:
        with self._lock:
            if job.op == "flush":
                self.flush_calls, self.flush_bytes = self.flush_calls + 1, self.flush_bytes + job.nbytes
            else:
                self.fetch_calls, self.fetch_bytes = self.fetch_calls + 1, self.fetch_bytes + job.nbytes


class JobQueue:
    """One background thread running jobs in submission order; successes are counted in ``stats``.

    A job that waits for something outside the process (a region, a file) calls
    :meth:`poll_until`, which gives up when the queue is being closed.
    """

    def __init__(self, name: str, stats: TransportStats | None = None) -> None:
        self.name, self.stats = name, stats if stats is not None else TransportStats()
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._stop, self._closed = threading.Event(), False
        self._thread = threading.Thread(target=self._run, name=f"kv-{name}", daemon=True)
        self._thread.start()

    def submit(self, op: str, key: Key, nbytes: int, fn: Callable[[], None]) -> Job:
        if self._closed:
            raise RuntimeError(f"the {self.name} transport is closed; cannot {op} key {key!r}")
        job = Job(op, key, self.name, nbytes)
        self._todo.put((job, fn))
        return job

    def poll_until(self, ready: Callable[[], bool]) -> None:
        """On the queue's thread: wait until ``ready()``; ``RuntimeError`` once the queue closes."""
        delay = 1e-5
        while not ready():
            if self._stop.is_set():
                raise RuntimeError(f"the {self.name} transport was closed while this job waited")
            time.sleep(delay)
            delay = min(2 * delay, 2e-3)

    def close(self, timeout: float = 10.0) -> None:
        """Run what was submitted (up to ``timeout`` s), then fail what is left and join the thread.

        ``RuntimeError`` if a job is stuck in a call that cannot be interrupted (a receive that
        never matches); its thread is left behind.
        """
        if not self._closed:
            self._closed = True
            self._todo.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join(min(timeout, 1.0))
        if self._thread.is_alive():
            self._fail_queued()
            raise RuntimeError(
                f"the {self.name} transport's thread is stuck in a job that cannot be "
                f"interrupted; it is left behind (do not reuse its process group)"
            )

    def _run(self) -> None:
        while not self._stop.is_set():
            item = self._todo.get()
            if item is None:
                return
            job, fn = item
            try:
                fn()
            except BaseException as error:
                job._finish(error)
            else:
                self.stats.add(job)
                job._finish(None)
        self._fail_queued()

    def _fail_queued(self) -> None:
        while True:
            try:
                item = self._todo.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[0]._finish(RuntimeError(f"the {self.name} transport was closed before {item[0]!r} ran"))

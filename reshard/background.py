"""Background threads with owners: one call (:class:`Background`) or a worker that runs calls in
order for its owner's life (:class:`Worker`); results and errors are handed to the caller's thread."""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class Background:
    """Runs ``fn()`` on a daemon thread named ``name``; :meth:`result` joins it.

    ``exit_wait``: if the interpreter exits while the call runs (an error raised on the caller's
    thread ends the script), its exit waits up to this many seconds for the call first (``None``:
    it does not wait). A call that communicates needs it: a daemon thread still inside the
    backend when the interpreter finalizes is ended there and the process aborts after printing
    the error (``terminate called without an active exception``, SIGABRT); its peers, whose own
    exits wait the same way, finish the call with it.
    """

    def __init__(self, fn: Callable[[], Any], name: str, what: str, *, exit_wait: float | None = None) -> None:
        self.what = what
        self._value: Any = None
        self._error: BaseException | None = None
        self._exit_wait = exit_wait
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        if exit_wait is not None:
            atexit.register(self._join_at_exit)  # unregistered by result()
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # re-raised by result() on the caller's thread
            self._error = e

    def _join_at_exit(self) -> None:
        self._thread.join(self._exit_wait)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float | None = None) -> Any:
        """The call's return value; ``TimeoutError`` naming ``what`` after ``timeout`` s, or its error."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"{self.what} did not finish within {timeout} s")
        if self._exit_wait is not None:
            atexit.unregister(self._join_at_exit)
        if self._error is not None:
            raise self._error
        return self._value


class Worker:
    """One daemon thread named ``name`` that runs the calls it is given, in order, each with a
    :class:`concurrent.futures.Future` of its result; :meth:`close` ends it once the calls queued
    before have run (daemon: a call blocked for good on a dead peer never holds the process)."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        self._calls.put((fn, future))
        return future

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, future = call
            try:
                future.set_result(fn())
            except BaseException as e:  # re-raised by future.result() on the caller's thread
                future.set_exception(e)

    def close(self, timeout: float | None = None) -> None:
        """End the thread after the calls queued so far; wait up to ``timeout`` s for it."""
        self._calls.put(None)
        self._thread.join(timeout)

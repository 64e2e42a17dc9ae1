"""One call on a background thread, its result or error handed to the caller's thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Background:
    """Runs ``fn()`` on a daemon thread named ``name``; :meth:`result` joins it."""

    def __init__(self, fn: Callable[[], Any], name: str, what: str) -> None:
        self.what = what
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # re-raised by result() on the caller's thread
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float | None = None) -> Any:
        """The call's return value; ``TimeoutError`` naming ``what`` after ``timeout`` s, or its error."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"{self.what} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value

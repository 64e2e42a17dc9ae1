"""Heartbeats through the job's store: a rank silent for 3 periods is declared dead and the survivors leave."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque


class Heartbeat:
    """Liveness of every rank through the job's store (a side thread per rank).

    Each rank bumps its counter every ``period`` seconds; the same thread reads every other
    rank's counter, and a rank whose counter has not moved for ``misses`` periods is declared
    dead: ``on_dead(rank, silent_seconds)`` runs (default: record it and leave the job, so no
    survivor waits in a collective for a rank that hangs). ``detected`` lists what was declared.

    ``events`` records what each check saw of each other rank, in order (the last ``EVENTS_KEPT``):
    ``("beat", r, n)`` rank ``r``'s counter had moved, to ``n``; ``("miss", r, n)`` it was still
    ``n``; ``("dead", r, n)`` still ``n``, and ``r`` is declared dead (no event of ``r`` follows).
    ``events.copy()`` reads it while the thread runs.
    """

    EVENTS_KEPT = 1000

    def __init__(
        self, store, rank: int, world: int, *, period: float = 0.5, misses: int = 3, prefix: str = "hb", on_dead=None
    ) -> None:

        self.store = store
        self.rank = rank
        self.world = world
        self.period = period
        self.misses = misses
        self.prefix, self.on_dead = prefix, on_dead or _leave
        self.detected: list[tuple[int, float]] = []
        self.events: deque[tuple[str, int, int]] = deque(maxlen=self.EVENTS_KEPT)
        self.error: Exception | None = None
        self._beats, self._paused = 0, False
        self._beat()  # before anyone can watch: a rank is live from its first beat
        self._seen = {r: (-1, time.monotonic()) for r in range(world) if r != rank}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reshard-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.period):
                if not self._paused:
                    self._beat()
                self._check()
        except Exception as e:  # the store went away (the job is ending): stop watching
            self.error = e

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(f"{self.prefix}/{self.rank}", str(self._beats))

    def _check(self) -> None:
        now = time.monotonic()
        for r, (count, since) in list(self._seen.items()):
            current = int(self.store.get(f"{self.prefix}/{r}")) if self.store.check([f"{self.prefix}/{r}"]) else -1
            grace = self.misses if count >= 0 else 4 * self.misses  # a rank not yet seen: starting up
            if current != count:
                self._seen[r] = (current, now)
                self.events.append(("beat", r, current))
            elif now - since > grace * self.period:
                del self._seen[r]
                self.events.append(("dead", r, current))
                self.detected.append((r, now - since))
                self.on_dead(r, now - since)
            else:
                self.events.append(("miss", r, current))

    def pause(self) -> None:
        """Stop beating (a hung rank, for tests); the monitor keeps watching the others."""
        self._paused = True

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _leave(rank: int, silent: float) -> None:
    print(f"rank {rank} silent for {silent:.1f} s: declared dead, leaving the job", file=sys.stderr, flush=True)
    os._exit(3)

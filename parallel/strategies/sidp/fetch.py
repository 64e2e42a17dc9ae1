"""SiDP's fetch scheduler: which non-owned FFN layers each rank fetches into its cache slots, in
which round, from which owner (WaS).

One housekeeper thread per rank (:class:`reshard.background.Worker`, started with the scheduler and joined by
its :meth:`FetchScheduler.close`) fetches the step's non-owned layers into the owner pool's slots
(:class:`reshard.layers.owner_pool.OwnerPool`) over a background process group of its own, as
planned transfers of the movement core (the owner's housekeeper sends; its compute thread does
nothing per fetch). Fetches run in rounds, every rank at most one layer per round; a round waits
for a free slot, so a rank runs at most ``slots`` layers ahead of its compute. With **peak
shifting** each rank walks a cycle of G layers from its own offset, so in any round the ranks read
from different owners (counted: ``max_concurrent_readers``).
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import Replicate

from reshard import Layout
from reshard.background import Worker
from reshard.executor import execute
from reshard.layers.owner_pool import CAS, WAS, OwnerPool
from reshard.mesh import cached_group
from reshard.plan import plan_transfer

Rounds = list[list[tuple[int, int]]]  # round -> (reader rank, layer)


@dataclass
class FetchCounters:
    """What the schedule did on this rank (identical schedule on every rank)."""

    fetches: int = 0  # layers fetched into slots by this rank
    fetch_bytes: int = 0  # bytes this rank received into slots
    max_concurrent_readers: int = 0  # most ranks reading one owner in one round (the schedule)
    readers: dict = field(default_factory=dict)  # owner -> most readers in one round
    active_steps: dict = field(default_factory=lambda: {WAS: 0, CAS: 0})  # steps with rows here
    dummy_steps: int = 0  # steps with no rows on this rank


def check_slots(
    slots: int, group_size: int, *, prefetch_depth: int, peak_shifting: bool, layers: int | None = None
) -> None:
    """``ValueError`` unless ``slots`` cache slots serve the schedule over ``group_size`` ranks (and,
    given the model's ``layers``, no rank has more slots or look-ahead than layers to fetch)."""
    if layers is not None and group_size > 1:  # one rank owns every layer: nothing to fetch or check
        fetched = layers - math.ceil(layers / group_size)  # the fewest non-owned layers of any rank
        for key, value in (("prefetch_depth", prefetch_depth), ("slots", slots)):
            if value > fetched:
                raise ValueError(
                    f"parallel.{key} ({value}) exceeds the FFN layers a rank fetches ({fetched}: {layers} layers, "
                    f"{math.ceil(layers / group_size)} owned per rank over {group_size} ranks); more only costs "
                    f"memory (use at most {fetched})"
                )
    if not 1 <= prefetch_depth <= slots:
        raise ValueError(f"need 1 <= prefetch_depth ({prefetch_depth}) <= slots ({slots})")
    if peak_shifting and slots < group_size - 1:
        raise ValueError(
            f"peak shifting walks a cycle of {group_size} layers: it needs slots >= {group_size - 1}, got {slots}"
        )


class FetchScheduler:
    """Fetches for ``pool``'s non-owned layers, step by step (collective per step: every rank of
    the group calls :meth:`begin_step` with the same arguments, then :meth:`end_step`).

    Args:
        prefetch_depth: how many layers ahead a rank may fetch (at most the pool's slots);
        peak_shifting: each rank starts its cycle at its own offset (needs ``slots >= G - 1``);
        timeout: seconds :meth:`end_step` waits for the step's fetches.

    Owns its housekeeper thread: :meth:`close` (or the end of a ``with`` block) joins it.

    ``on_fetch``: None, or ``fn(event, layer)`` called on the housekeeper thread for each fetch
    into this rank's slots: ``("fetch_begin", j)`` once layer ``j`` has a slot, before its bytes
    move; ``("fetch_end", j)`` once they are in the slot, before the forward may use them (what
    tests and benches listen to).
    """

    def __init__(
        self, pool: OwnerPool, *, prefetch_depth: int = 2, peak_shifting: bool = True, timeout: float = 60.0
    ) -> None:
        check_slots(pool.slots, pool.G, prefetch_depth=prefetch_depth, peak_shifting=peak_shifting)
        self.pool = pool
        self.depth = prefetch_depth
        self.shift = peak_shifting
        self.timeout = timeout
        self.counters = FetchCounters()
        self._group = cached_group(pool.ranks, purpose="sidp-fetch")
        self._housekeeper = Worker(f"sidp-housekeeper-{pool.rank}")
        self._step: Future | None = None  # the step's fetches, while they run
        self.on_fetch: Callable[[str, int], None] | None = None

    # ---- one step ---------------------------------------------------------------------------------
    def begin_step(self, rows: list[int], mode: str) -> None:
        """A step starts: ``rows[g]`` FFN input rows on each group rank (0: a dummy step), ``mode``
        WaS or CaS. In WaS the housekeeper starts fetching this rank's non-owned layers."""
        pool = self.pool
        assert len(rows) == pool.G and mode in (WAS, CAS), (rows, mode)
        self.end_step()
        if rows[pool.ranks.index(pool.rank)]:
            self.counters.active_steps[mode] += 1
        else:
            self.counters.dummy_steps += 1
        if mode == CAS:
            pool.begin_step(rows, fetched=[])
            return
        rounds = self.schedule([r > 0 for r in rows])
        self._count_readers(rounds)
        pool.begin_step(rows, fetched=[j for j, o in enumerate(pool.owner) if o != pool.rank])
        self._step = self._housekeeper.submit(lambda: self._housekeep(rounds))

    def end_step(self) -> None:
        """Wait for the step's fetches (their errors reach the caller here)."""
        if self._step is not None:
            step, self._step = self._step, None
            try:
                step.result(self.timeout)
            except concurrent.futures.TimeoutError:  # (the builtin TimeoutError from Python 3.11)
                raise TimeoutError(
                    f"SiDP housekeeper of rank {self.pool.rank} did not finish within {self.timeout} s"
                ) from None

    def close(self, timeout: float = 2.0) -> None:
        """Join the housekeeper thread, up to ``timeout`` s (not collective: a step's fetches
        still running on an error path are not waited for beyond it)."""
        self._housekeeper.close(timeout)

    def __enter__(self) -> FetchScheduler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the schedule -----------------------------------------------------------------------------
    def schedule(self, active: list[bool]) -> Rounds:
        """Fetch rounds of a step: round ``t`` lists ``(reader rank, layer)``, one layer per active
        reader. Without peak shifting every reader walks its non-owned layers in order; with it,
        each cycle of G layers starting at the reader's own offset in the group."""
        orders = {r: self._order(r) for r, on in zip(self.pool.ranks, active) if on}
        n = max((len(o) for o in orders.values()), default=0)
        return [[(r, o[t]) for r, o in orders.items() if t < len(o)] for t in range(n)]

    def _order(self, reader: int) -> list[int]:
        owner, G = self.pool.owner, self.pool.G
        g = self.pool.ranks.index(reader)
        layers = [j for j in range(len(owner)) if owner[j] != reader]
        if not self.shift:
            return layers
        out = []
        for c in range(0, len(owner), G):  # within each cycle, from the reader's offset
            cycle = [c + (g + 1 + t) % G for t in range(G) if c + (g + 1 + t) % G < len(owner)]
            out += [j for j in cycle if owner[j] != reader]
        return out

    def _count_readers(self, rounds: Rounds) -> None:
        for rnd in rounds:
            per: dict[int, int] = {}
            for _, j in rnd:
                per[self.pool.owner[j]] = per.get(self.pool.owner[j], 0) + 1
            for o, n in per.items():
                self.counters.readers[o] = max(self.counters.readers.get(o, 0), n)
                self.counters.max_concurrent_readers = max(self.counters.max_concurrent_readers, n)

    # ---- the housekeeper ------------------------------------------------------------------------
    def _housekeep(self, rounds: Rounds) -> None:
        try:
            with torch.inference_mode():
                for rnd in rounds:
                    self._fetch_round(rnd)
        except BaseException as e:  # the compute thread's forwards raise it too
            self.pool.fail(e)
            raise

    def _fetch_round(self, rnd: list[tuple[int, int]]) -> None:
        """One round: every reader's layer, whole on its owner -> whole in a slot of the reader."""
        pool = self.pool
        mine = next((j for r, j in rnd if r == pool.rank), None)
        slot = pool.take_slot() if mine is not None else None
        if mine is not None and self.on_fetch is not None:
            self.on_fetch("fetch_begin", mine)
        plans = []
        srcs = []
        outs = []
        like = pool.slot_flat[0]
        for reader, j in rnd:
            shape = tuple(like.shape)
            plans.append(
                plan_transfer(
                    Layout((pool.owner[j],), (Replicate(),), shape, like.dtype),
                    Layout((reader,), (Replicate(),), shape, like.dtype),
                )
            )
            srcs.append(pool.flat[j] if pool.owner[j] == pool.rank else None)
            outs.append(pool.slot_flat[slot] if reader == pool.rank else None)
        _, stats = execute(plans, srcs, out=outs, group=self._group)
        if mine is not None:
            self.counters.fetches += 1
            self.counters.fetch_bytes += stats.bytes_received
            if self.on_fetch is not None:
                self.on_fetch("fetch_end", mine)
            pool.filled(mine, slot)

    def fetch_round_once(self) -> None:
        """One fetch round of a step in which every rank reads (profiling); the slot is freed."""
        pool = self.pool
        pool.begin_step([0] * pool.G, fetched=list(range(len(pool.owner))))
        with torch.inference_mode():
            self._fetch_round(self.schedule([True] * pool.G)[0])
        pool.begin_step([0] * pool.G, fetched=[])

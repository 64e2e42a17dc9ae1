"""Seesaw's CPU tier as the decode side's KV connector (:class:`TierKV`), and as a prefix cache.

A prefill's prompt KV goes out to the tier under the request's id. The decode side loads it: the
request resumed after its first token, and its siblings (requests of the same prompt prefilled
beside it). Once the last of them has loaded it, the prompt stays in the tier, retained (least
recently used first, :class:`reshard.parallel.engine.retained.RetainedPrompts`), until a new
prompt needs its tokens or the weights are written. A later request whose prompt is the same, or
shares at least 16 leading tokens with it and at least half its prompt (a chat's next turn, a
long shared system prompt), skips the prefill layout: it goes to the decode side, loads the shared
positions from the tier and computes only the rest there. An entry is retained or freed only
once its swap-out is written (the policy waits for it before a waiting request drops its hold).
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING

from reshard.kv import CPUKVTier
from reshard.parallel.engine.channel import Handoff
from reshard.parallel.engine.connector import KVConnector
from reshard.parallel.engine.request import Request, Sequence
from reshard.parallel.engine.retained import RetainedPrompts

if TYPE_CHECKING:
    from reshard.parallel.strategies.seesaw.policy import SeesawStats

TIER = "seesaw-tier"  # the kv_source of a request whose prompt KV is in the CPU tier


class TierKV(KVConnector):
    """The CPU tier as a KV connector of the decode side: a request resumed from :data:`TIER`
    matches its prompt (every position but the first token, which its first decode step feeds),
    a sibling (:meth:`share`) every position of the prompt but its last, which its first decode
    step feeds to sample its first token, and a request that starts from a retained prompt
    (:meth:`reuse`) the positions they share; :meth:`load` copies this rank's layers and head range
    of them into the decode slot, on the ranks of the sequence's decode replica. An entry whose
    last load is done is retained (``retain``: ``EngineConfig.prefix_caching``) or freed. The
    policy makes the tier whole on every rank before a decode step admits from it, so the answer
    is never "awaiting". ``decode``: the decode layout's runner; ``slot_of``: request id -> the
    decode slot it was loaded into (this rank's replica). Every rank keeps the same books."""

    def __init__(self, tier: CPUKVTier, decode, stats: SeesawStats, *, retain: bool = True) -> None:
        self.tier, self.decode, self.stats, self.retain = tier, decode, stats, retain
        self.slot_of: dict[int, int] = {}
        # a request id -> the tier entry it loads (where not its own)
        self.entry_of: dict[int, object] = {}
        # a shared tier entry -> the loads it awaits
        self.holders: dict[object, int] = {}
        # a request started from a retained prompt -> the positions it shares
        self.matched: dict[int, int] = {}
        # a request handed to the decode side -> its prefill's marks and log-probabilities
        self.marks: dict[int, tuple[tuple, tuple]] = {}
        # an entry computed under the current weights -> its prompt
        self.prompts: dict[object, tuple[int, ...]] = {}
        # prompt -> its retained entry, ("retained", n)
        self.retained = RetainedPrompts()
        self._keys = itertools.count()

    def share(self, leader: int, siblings: list[int], *, leader_loads: bool) -> None:
        """``siblings`` load ``leader``'s prompt KV from the tier (and ``leader``, where it
        decodes on): its entry is freed or retained after the last of them."""
        self.entry_of.update(dict.fromkeys(siblings, leader))
        self.holders[leader] = len(siblings) + leader_loads

    def computed(self, entry: int, request: Request) -> None:
        """``request``'s prompt KV goes out to the tier as ``entry`` now, under the current
        weights: retained after its loads."""
        if self.retain:
            self.prompts[entry] = tuple(request.prompt_ids)

    def reuse(self, request: Request) -> int:
        """Start ``request`` from the retained prompt sharing the most of its prompt: the
        positions it loads from the tier (0: it is prefilled, in the prefill layout, where none
        shares enough, or where more of its prompt would be left to compute in the decode layout
        than it shares)."""
        if not (self.retain and len(self.retained)):
            return 0
        match = self.retained.match(request.prompt_ids)
        if match is None or len(request.prompt_ids) - match.shared > match.shared:
            return 0
        entry = self.retained.use(match.source)
        self.entry_of[request.id] = entry
        self.holders[entry] = self.holders.get(entry, 0) + 1
        self.matched[request.id] = match.shared
        return match.shared

    def release(self, entry) -> None:
        """One holder of ``entry`` is done with it (loaded, or finished at its prefill without
        siblings); after the last, it is retained (a prompt computed under the current weights,
        not retained already) or its tier tokens freed."""
        left = self.holders.pop(entry, 1) - 1
        if left:
            self.holders[entry] = left
            return
        prompt = self.prompts.pop(entry, None)
        if isinstance(entry, tuple) and prompt is not None:  # a retained entry: it stays
            self.prompts[entry] = prompt
        elif prompt is not None and self.retained.keep(prompt, key := ("retained", next(self._keys))):
            # the request's entry outlives it, under a key no request id takes
            self.tier.rename(entry, key)
            self.prompts[key] = prompt
        else:
            self.tier.free(entry)

    def receive(self, handoff: Handoff) -> list[tuple[Request, str]] | None:
        """A prefill step's hand-off to the decode side (its own group's): each request that
        runs on, resumed after its tokens so far (a sibling as it came), its KV source the tier.
        None for another group's hand-off (its source not its target): not this tier's."""
        if handoff.source != handoff.target:
            return None
        rows = [row for row in handoff.rows() if not row[2]]
        self.marks.update((r.id, (times, logprobs)) for r, _, _, times, logprobs in rows)
        return [(r.resume(list(tokens)) if tokens else r, TIER) for r, tokens, *_ in rows]

    def carried(self, request_id: int) -> tuple[tuple, tuple] | None:
        """A prefilled request's marks and log-probabilities from its prefill step, once."""
        return self.marks.pop(request_id, None)

    def forget(self, request: Request) -> None:
        """An aborted request that waited for the decode side: its hold on the tier's KV goes."""
        if request.kv_source == TIER:
            self.drop(request.id)

    def drop(self, request_id: int) -> None:
        """A request that waits for the decode side leaves it (aborted, or requeued): its hold on
        the tier's KV goes."""
        self.matched.pop(request_id, None)
        self.marks.pop(request_id, None)
        self.release(self.entry_of.pop(request_id, request_id))

    def could_fit(self, num_tokens: int) -> bool:
        """Whether the tier would fit ``num_tokens`` once the retained prompts no request holds
        were evicted (nothing is evicted: :meth:`make_room` does that when a prompt takes them)."""
        busy = self._held_prompts()
        evictable = [e for p, e in self.retained.by_prompt.items() if p not in busy]
        return self.tier.can_fit(num_tokens, evictable)

    def _held_prompts(self) -> set[tuple[int, ...]]:
        """Prompts of the entries a request still holds (it loads them): never evicted."""
        return {p for e, p in self.prompts.items() if e in self.holders}

    def make_room(self, num_tokens: int) -> bool:
        """Whether the tier fits ``num_tokens`` now, retained prompts no request holds evicted
        (least recently used first) until it does."""
        while not self.tier.can_fit(num_tokens):
            entry = self.retained.evict(self._held_prompts())
            if entry is None:
                return False
            del self.prompts[entry]
            self.tier.free(entry)
        return True

    def reset(self) -> None:
        """The weights were written: no prompt computed so far is retained or matched again; those
        a waiting request still holds are freed at their release."""
        for entry in self.retained.clear():
            if entry not in self.holders:
                self.tier.free(entry)
        self.prompts.clear()

    def matched_tokens(self, seq: Sequence) -> int | None:
        if seq.request.kv_source != TIER:
            return 0
        return self.matched.get(seq.request.id, seq.prompt_len - 1)

    def load(self, seq: Sequence, num_tokens: int) -> None:
        rid, kv = seq.request.id, self.decode.kv
        entry = self.entry_of.pop(rid, rid)
        self.matched.pop(rid, None)
        if seq.replica == self.decode.replica.rank:
            t0 = time.perf_counter()
            if kv.spec.paged:  # the slot's blocks before the load writes them
                kv.assign(seq.slot, list(seq.blocks))
            loaded = self.tier.swap_in(kv, seq.slot, entry, num_tokens)
            assert loaded == num_tokens, (rid, loaded, num_tokens)
            self.slot_of[rid] = seq.slot
            self.stats.swap_in_tokens += loaded
            self.stats.swap_seconds += time.perf_counter() - t0
        self.release(entry)

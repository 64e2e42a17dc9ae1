"""DejaVu's prompt side as an engine policy: :class:`PromptSide` prefills prompts, streams each
layer's KV to a token group and hands each prefilled prompt on; it computes a prompt once for the
requests that share it, and a chat's next turn only past what it kept of the last."""

from __future__ import annotations

import torch

from reshard.kv.stream_plan import Span
from reshard.parallel.engine import Policy, SlotPool, Step, StepOutput
from reshard.parallel.engine.channel import Handoff
from reshard.parallel.engine.request import Request, Sequence
from reshard.parallel.engine.retained import CopyPrefix, RetainedPrompts
from reshard.parallel.engine.splits import split_ranges
from reshard.parallel.engine.step import Move
from reshard.parallel.strategies.dejavu.lease import NONE, LeaseBook
from reshard.parallel.strategies.dejavu.sides import DejaVuStats


class PromptSide(Policy):
    """A prompt group: prefill admitted prompts (streaming each layer's KV out as it is written)
    and hand every prefilled prompt, with its first token, to a token group.

    A prompt's KV is computed once for the requests that share it:

    - In the step that computes it, the queue's next requests with the same prompt are its
      *siblings* (``n`` samples): no slot, no stream of their own. They leave with no token: the
      token group loads them from its streamed KV but for the last position, which their first
      step there feeds (it samples their first token).
    - After its step a prompt's KV stays in its slot (:class:`RetainedPrompts`, least recently
      used first) until a new prompt needs the slot or the weights are written (across
      ``generate`` calls too). A later request with the same prompt takes the slot over and feeds
      only its last prompt token; one that shares a long prefix with it (a chat's next turn) has
      the prefix copied into a slot of its own and computes the rest. Such steps stream their
      prompts at their end (:meth:`after_step`), not layer by layer.
    - A token group keeps the prompts streamed to it (:mod:`.lease`, ``kept`` per token group):
      a prompt that begins with one it keeps streams only what follows.

    ``share=False`` (``EngineConfig.prefix_caching``): every request computes its whole prompt.
    """

    stats_cls = DejaVuStats

    def __init__(
        self,
        streamers: dict,
        group: int,
        token_groups: list[int],
        max_prefill_tokens: int,
        share: bool = True,
        kept: int = 0,
    ) -> None:
        self.streamers = streamers  # token group -> streamer from this group's ranks to that group's
        self.share = share  # prompts shared at all (EngineConfig.prefix_caching)
        self.group = group
        self.token_groups = token_groups
        self.max_prefill_tokens = max_prefill_tokens
        self.outgoing: list = []
        self.steps = 0
        self.retained = RetainedPrompts()
        self.slots: SlotPool | None = None
        self.leases = {t: LeaseBook(kept if share else 0) for t in token_groups}  # what each token group keeps

    @property
    def initial_layout(self) -> str:
        return "prompt"

    def start(self, queue) -> None:
        """A new call: every slot free but the retained prompts'."""
        self.slots = SlotPool(self.runner_info["prompt"].max_batch_size, 1)
        for seq in self.retained.handles():
            self.slots.free.remove(seq.slot)

    def next_step(self, queue, limit: int | None = None) -> Step:
        """Prefill queued prompts up to the token budget, or, where the queue's head can start
        from a retained prompt, such requests (at most ``limit`` requests in all, siblings
        counted)."""
        self._siblings: dict[int, list[Request]] = {}  # a prompt's request in the step -> its siblings
        moves: list[Move] = []
        admitted = self._reuse(queue, limit, moves)  # (none where the head starts from no retained prompt)
        reuse = bool(admitted)
        admitted = admitted or self._compute(queue, limit)
        assert admitted or not queue or limit == 0, "a prompt step admitted none of a queue (policy bug)"
        self._prefilling, self._passes, self._streams_at_end = admitted, {}, reuse
        self._plan_stream(admitted)
        counts = [s.prompt_len - s.num_computed_tokens for s in admitted]
        return Step(admitted, counts, "prompt", moves=tuple(moves))

    def _compute(self, queue, limit: int | None) -> list[Sequence]:
        """The queue's head requests that start from no retained prompt, within the token budget,
        each with its siblings."""
        budget, admitted, prompts = self.max_prefill_tokens, [], {}
        while (
            queue
            and self._taking(admitted) != limit
            and self.retained.match(queue[0].prompt_ids) is None
            and (not admitted or len(queue[0].prompt_ids) <= budget)
            and (len(self.slots) or self._evict(set()))
        ):
            admitted.append(self._admit(queue.popleft(), prompts, 0))
            self.slots.take(admitted[-1])
            budget -= admitted[-1].prompt_len
            self._take_siblings(queue, prompts, limit, admitted)
        return admitted

    def _reuse(self, queue, limit: int | None, moves: list[Move]) -> list[Sequence]:
        """The queue's head requests that start from a retained prompt, within the token budget,
        each with its siblings; ``moves``: the prefix copies they need.

        One whose prompt equals the retained one takes its slot over. Any other takes a free slot
        (the least recently used retained prompt no request of the step reads evicted, if need
        be), the shared prefix copied into it before the step; where there is none, the step's
        first takes the retained prompt's slot over (which then keeps the new prompt). So where
        the head starts from a retained prompt, at least the head is admitted."""
        budget, admitted, prompts, busy = self.max_prefill_tokens, [], {}, set()
        while queue and self._taking(admitted) != limit:
            reuse = self.retained.match(queue[0].prompt_ids)
            if reuse is None or (admitted and len(queue[0].prompt_ids) - reuse.shared > budget):
                break
            over = reuse.same or not (len(self.slots) or self._evict(busy | {reuse.source}))
            if over and admitted and not reuse.same:
                break  # (no slot for it: the next step)
            seq = self._admit(queue.popleft(), prompts, reuse.shared)
            if over:
                seq.replica, seq.slot = 0, self.retained.take(reuse.source).slot
            else:
                self.slots.take(seq)
                moves.append(CopyPrefix(self.retained.use(reuse.source).slot, seq.slot, reuse.shared))
                busy.add(reuse.source)
            seq.num_computed_tokens = reuse.shared
            admitted.append(seq)
            budget -= seq.prompt_len - reuse.shared
            self._take_siblings(queue, prompts, limit, admitted)
        return admitted

    def make(self, move: Move) -> None:
        """A :class:`CopyPrefix`: one slot's first positions into another, every layer held here."""
        assert isinstance(move, CopyPrefix), move
        kv = self.runner_info["prompt"].kv
        for layer in self._layers() if kv is not None else ():
            kv.write_slot(layer, move.dst, *kv.read_slot(layer, move.src, move.tokens))

    def _admit(self, request: Request, prompts: dict, shared: int) -> Sequence:
        """``request``'s sequence, ``shared`` of its prompt's positions reused (the prefix-cache
        figures); later requests of its prompt in the step are its siblings."""
        prompts.setdefault(tuple(request.prompt_ids), request.id)
        self._count(request, shared)
        return self.new_sequence(request)

    def _evict(self, busy: set) -> bool:
        """Free the slot of the least recently used retained prompt not in ``busy``; whether
        there was one."""
        seq = self.retained.evict(busy)
        if seq is not None:
            self.slots.give(seq)
        return seq is not None

    def _taking(self, admitted: list) -> int:
        """Requests this step hands off: its prompts' and their siblings."""
        return len(admitted) + sum(map(len, self._siblings.values()))

    def _take_siblings(self, queue, prompts: dict, limit: int | None, admitted: list) -> None:
        """The queue's head requests whose prompt (of two tokens or more) the step streams
        (``prompts``: the step's -> its request): they take no slot and no stream of their own."""
        while (
            self.share
            and queue
            and self._taking(admitted) != limit
            and len(queue[0].prompt_ids) > 1
            and (leader := prompts.get(tuple(queue[0].prompt_ids))) is not None
        ):
            self._siblings.setdefault(leader, []).append(queue.popleft())
            self._count(self._siblings[leader][-1], None)

    def _count(self, request: Request, shared: int | None) -> None:
        """The prefix-cache figures: ``shared`` positions not computed (None: a sibling's, all but
        its last)."""
        if not self.share:
            return
        n = len(request.prompt_ids)
        self.stats.prefix_cache_queries += n
        self.stats.prefix_cache_hits += n - 1 if shared is None else shared

    @property
    def target(self) -> int:
        """The token group of this step's prompts (round robin over the steps)."""
        return self.token_groups[self.steps % len(self.token_groups)]

    def stream_layer(self, layer: int, h: torch.Tensor, ctx) -> None:
        """``layer_after``: once every micro-batch of a step of whole prompts passed ``layer``, its
        KV leaves for the token group."""
        if self._streams_at_end:
            return
        self._passes[layer] = self._passes.get(layer, 0) + 1
        if self._passes[layer] < len(split_ranges(len(self._prefilling), self.runner_info["prompt"].num_microbatches)):
            return
        self._stream([layer])

    def _plan_stream(self, seqs: list[Sequence]) -> None:
        """What of ``seqs``' prompts this step streams: each but the prefix its token group keeps
        (:class:`.lease.LeaseBook`; ``self._lease`` goes with the hand-off)."""
        book = self.leases[self.target]
        self._lease = book.plan([tuple(s.request.prompt_ids) for s in seqs]) if book.capacity else None
        shared = self._lease.shared if self._lease is not None else [NONE] * len(seqs)
        self._spans = [
            Span(s.request.id, s.slot, n, s.prompt_len) for s, (_, n) in zip(seqs, shared) if n < s.prompt_len
        ]

    def _stream(self, layers: list[int]) -> None:
        """The step's planned prompt positions (``self._spans``), layer by layer, to its token group."""
        kv = self.runner_info["prompt"].kv
        streamer = self.streamers[self.target]
        for layer in layers if self._spans else ():
            self.outgoing += streamer.stream_out(kv, self._spans, layers=[layer], tag=self.steps)

    def after_step(self, step: Step, output: StepOutput) -> list[Handoff]:
        """The step's hand-off: its requests (in the stream's order), then their siblings; its
        prompts retained. A step of reused prompts streams them now, every layer."""
        if self._streams_at_end and self.runner_info["prompt"].kv is not None:
            self._stream(self._layers())
        for seq in step.seqs:
            if not (self.share and self.retained.keep(tuple(seq.request.prompt_ids), seq)):
                self.slots.give(seq)
        self.outgoing = [job for job in self.outgoing if not job.done()]
        handoff = self._handoff(step.seqs)
        self.steps += 1
        return [handoff]

    def _handoff(self, seqs: list[Sequence]) -> Handoff:
        """``seqs`` (the step's, with their first token) and their siblings (none yet)."""
        index = {s.request.id: i for i, s in enumerate(seqs)}
        shared = [(index[rid], r) for rid, rs in self._siblings.items() for r in rs]
        blank = ((),) * len(shared)
        return Handoff(
            self.group,
            self.target,
            self.steps,
            tuple(s.request for s in seqs) + tuple(r for _, r in shared),
            tuple(tuple(s.output) for s in seqs) + blank,
            tuple(s.finish_reason is not None for s in seqs) + (False,) * len(shared),
            tuple(tuple(s.times) for s in seqs) + blank,
            tuple(tuple(s.logprobs) for s in seqs) + blank,
            leaders=(*range(len(seqs)), *(i for i, _ in shared)) if shared else (),
            lease=self._lease,
        )

    def _layers(self) -> list[int]:
        """The decoder layers this rank holds KV of (its pipeline stage's), in order."""
        spec = self.runner_info["prompt"].kv.spec
        return list(range(spec.first_layer, spec.first_layer + spec.num_layers))

    def reset_prefix_cache(self, version: int) -> None:
        """The weights were written (or the cache freed): no retained prompt is reused."""
        for seq in self.retained.clear():
            if self.slots is not None:
                self.slots.give(seq)
        for book in self.leases.values():
            book.reset(version)

    def room(self) -> tuple[int, int]:
        """Free slots, retained ones counted (a new prompt takes one)."""
        free = len(self.slots) + len(self.retained)
        return free, free * self.runner_info["prompt"].kv.spec.max_seq_len

    def close(self) -> None:
        for job in self.outgoing:
            job.wait(next(iter(self.streamers.values())).timeout)
        for streamer in self.streamers.values():
            streamer.close()

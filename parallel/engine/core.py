"""``EngineCore``: one engine group's requests, taken in and stepped one step at a time.

Every front end drives an engine group the same way, vLLM v1's ``EngineCore`` way: add requests,
then step until nothing is unfinished (``Engine.generate``, ``LLM``, ``reshard serve``'s groups, the
verl adapter, a supervised child, DejaVu's token side: all run :meth:`EngineCore.step`).

- :meth:`EngineCore.add_request` queues a request (every rank of the group adds the same requests
  in the same order, as every rank calls ``generate`` with the same list); a request with a KV
  source (a request resumed from a hand-off: the group's connector receives a hand-off that
  reaches it and names each of its requests' source) waits for its KV (``WAITING_FOR_KV``)
  before it runs.
- :meth:`EngineCore.abort` ends requests between steps: a queued one leaves the queue, a running
  one gives its KV slot and blocks back at once (``FINISHED_ABORTED``), or, where a step of it is
  still computing (an in-flight pipeline's micro-batch), at that step's token. A cancellation a
  routed group takes is an abort.
- :meth:`EngineCore.step` runs the policy's next step (or, with nothing to run, waits for the
  next request) and returns what each request gained: :class:`CoreOutput` s.

Where requests come from is an :class:`reshard.parallel.engine.admission.Admission`: the requests
added here (a ``LocalAdmission``), or a routed group's channel. A request's status is where it is:
queued (``WAITING``, ``WAITING_FOR_KV``, or ``PREEMPTED`` when the scheduler gave its KV back to
an older request), running in the policy, or finished; :meth:`EngineCore.status` reads it there,
so there is one source of truth for it.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from reshard.parallel.engine.admission import ADMIT, Admission, Done, LocalAdmission, enqueue, withdraw
from reshard.parallel.engine.channel import Cancel, Handoff
from reshard.parallel.engine.notes import NotedSteps
from reshard.parallel.engine.policy import Step, StepOutput
from reshard.parallel.engine.request import NO_TOKEN, Completion, Request


class RequestStatus(enum.Enum):
    """Where a request is (vLLM's ``RequestStatus``)."""

    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # queued with a KV source (a hand-off, a migration)
    RUNNING = "running"
    PREEMPTED = "preempted"  # queued again: its KV went to older requests; recomputed when it runs
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @staticmethod
    def of_finish(reason: str) -> RequestStatus:
        """The status of a completion's ``finish_reason`` (``"stop"`` | ``"length"`` | ``"abort"``)."""
        names = {"stop": "FINISHED_STOPPED", "length": "FINISHED_LENGTH", "abort": "FINISHED_ABORTED"}
        return RequestStatus[names[reason]]


@dataclass(frozen=True)
class CoreOutput:
    """What one request gained in one :meth:`EngineCore.step`: its new tokens and its status
    after the step; a finished request's :class:`Completion` rides along."""

    request_id: int
    new_token_ids: list[int]
    status: RequestStatus
    completion: Completion | None = None

    @property
    def finished(self) -> bool:
        return self.status.finished


class EngineCore:
    """One engine group's request loop, a step at a time (see the module docstring).

    ``engine``: the :class:`reshard.parallel.engine.loop.Engine` whose runners and policy run
    the steps; ``admission``: where requests come from (default: a ``LocalAdmission`` of the
    requests added here); ``start``: the wall clock the requests' arrival times and timings count
    from; ``done``: where finished requests are kept (a server's keeps none, only counts them).
    """

    def __init__(
        self,
        engine,
        admission: Admission | None = None,
        *,
        start: float | None = None,
        done: Done | None = None,
        progress=None,
    ) -> None:
        self.engine = engine
        self.start = time.time() if start is None else start
        if admission is None:  # the requests added here
            admission = LocalAdmission([], self.start, engine._leads_group(), progress)
        self.intake = admission
        if isinstance(engine.policy, NotedSteps):  # a later pipeline stage: its requests come in the first's notes
            self.intake = engine.policy.admission()
        self.queue: deque = deque()
        self.done = Done() if done is None else done
        self.left = 0  # sequences handed on to other groups
        self.dropped = 0  # requests aborted before the group took them (done, never taken)
        self.resumed = 0  # requests added with a KV source (queued at once, never taken)
        self.aborts: list[int] = []
        self.started = False
        self.ahead: Step | None = None  # async scheduling: the step scheduled while the last one computed

    # ---- the API --------------------------------------------------------------------------------
    def add_request(self, request: Request, kv_source: str | None = None) -> None:
        """Queue ``request``. ``kv_source``: where its KV may come from (a connector's key: a
        hand-off's, a mirror's); such a request resumes work begun elsewhere, so it is queued at
        once (ahead of fresh requests), whatever its arrival time."""
        if kv_source is not None:
            request = dataclasses.replace(request, kv_source=kv_source)
        self.engine.validate([request])
        if isinstance(self.engine.policy, NotedSteps):  # a later pipeline stage runs what the first stage notes
            return
        if kv_source is not None:
            enqueue(self.queue, [request])
            self.resumed += 1
            return
        assert isinstance(self.intake, LocalAdmission), "a routed group's requests come from its router"
        self._check_new(request.id)
        self.intake.add(request)

    def abort(self, request_ids: Iterable[int]) -> None:
        """End ``request_ids`` before the next step (every rank aborts the same ids between the
        same steps). An unknown or finished id is ignored. A later pipeline stage ignores them:
        it ends what the first stage's notes say it aborted."""
        ids = list(request_ids) if isinstance(request_ids, Iterable) and not isinstance(request_ids, str) else None
        if ids is None or any(type(i) is not int for i in ids):  # (a str's characters matched no id: silently)
            raise ValueError(f"abort takes a list of request ids (ints), got {request_ids!r:.60}")
        if not isinstance(self.engine.policy, NotedSteps):
            self.aborts.extend(ids)

    def _check_new(self, request_id: int) -> None:
        """``ValueError`` for a fresh request whose id this group holds: added and not ended, or
        ended and kept (the loop never counted the second one finished: it stepped for ever)."""
        if request_id in self.intake.unfinished or (self.done.keep and request_id in self.done):
            raise ValueError(f"request id {request_id!r} is in this engine already; ids must be unique")

    def has_unfinished(self) -> bool:
        """Whether a request is queued or running, or may still come (a routed group's input)."""
        waiting = bool(self.queue) or bool(self.aborts) or self.engine.connector.arriving()
        return waiting or not (self.intake.exhausted and self._settled())

    def _settled(self) -> bool:
        """Whether every request the group took or was added with a KV source has finished here
        or left for another group."""
        return len(self.done) - self.dropped + self.left == self.intake.taken + self.resumed

    @torch.inference_mode()
    def step(self) -> list[CoreOutput]:
        """One step of the policy (or, with nothing queued or running, a wait for the next
        request): the tokens each request gained and the requests that finished."""
        if not self.started:
            self._begin()
        if self.engine.check_weights():  # requests admitted onto the old weights' cached KV start again
            self.engine.policy.requeue_unstarted(self.queue)
        outputs = self._apply_aborts()
        if not self.queue and self._settled():
            if not outputs:  # (what the aborts ended is returned now, not after the wait)
                self._idle()
        else:
            for step, output in self._next_steps():
                outputs += self._settle(step, output)
        if not self.has_unfinished():
            self._finish()
        return outputs

    def status(self, request_id: int) -> RequestStatus | None:
        """Where ``request_id`` is now (None: not known to this group)."""
        if request_id in self.done:
            return RequestStatus.of_finish(self.done[request_id].finish_reason)
        if request_id in self.engine._live and self.engine.policy.is_running(self.engine._live[request_id]):
            return RequestStatus.RUNNING
        waiting = (*self.queue, *self.engine.policy.waiting())  # (the engine's queue, the policy's own)
        queued = [r for r in waiting if isinstance(r, Request) and r.id == request_id]
        if isinstance(self.intake, LocalAdmission):  # added, not taken yet
            queued += [r for r in self.intake.requests[self.intake.taken :] if r.id == request_id]
        return _waiting(queued[0]) if queued else None

    def run(self) -> Done:
        """Step until nothing is unfinished; every finished request, by id."""
        while self.has_unfinished():
            self.step()
        return self.done

    # ---- the loop's parts -----------------------------------------------------------------------
    def _begin(self) -> None:
        """Before the first step: the offline requests queued, the policy started, the load told."""
        self.started = True
        if self.engine.flow is not None:
            self.engine.flow.begin()
        enqueue(self.queue, self.intake.initial())
        self.engine.policy.start(self.queue)
        self.intake.report(self.engine.policy.load(self.queue), [])

    def _idle(self) -> None:
        """Nothing queued or running: wait for the next request (an in-flight pipeline's first
        stage notes its aborts down first, so the later stages free those sequences now)."""
        self.ahead = None  # (nothing runs: a step scheduled ahead holds no request)
        self.engine.connector.land_arriving()  # (KV streamed for sequences that finished before)
        if self.engine.flow is not None:
            self.engine.flow.note_aborts()
        self._accept(self.intake.wait_next())

    def _next_steps(self) -> list[tuple[Step, StepOutput]]:
        """The engine's next steps, the next one scheduled ahead where scheduling is asynchronous."""
        if not self.engine.schedules_ahead():
            return self.engine._advance(self.queue, self.intake)
        done, self.ahead = self.engine._advance_ahead(self.queue, self.intake, self.ahead)
        return done

    def _finish(self) -> None:
        """Nothing is left: an in-flight pipeline's stages stop together."""
        if self.engine.flow is not None:
            self.engine.flow.finish()
        self.engine.policy.finish()
        self.started = False
        self.ahead = None  # (it holds no request: every one finished)

    def _settle(self, step: Step, output: StepOutput) -> list[CoreOutput]:
        """After a step's tokens are appended: hand-offs, retire finished sequences, admit what the
        group agreed to; what each request gained."""
        engine = self.engine
        for handoff in engine.policy.after_step(step, output) or ():
            self.left += handoff.open
            for r in handoff.requests:
                engine._live.pop(r.id, None)
            if engine.policy.hands_off_to_itself:  # (received here, as a token group receives one)
                self._accept([handoff])
            else:
                self.intake.hand_off(handoff)
        outputs = _gained(step, output.tokens)
        finished = [seq for seq in step.seqs if seq.finish_reason is not None]
        completions = [seq.completion(self.start) for seq in finished]
        for seq in finished:
            engine.policy.retire(seq)
            engine._live.pop(seq.request.id, None)
        ended = self._end_cancelled()
        self._done(completions + ended)
        self._accept(self.intake.take((output.agreed or {}).get(ADMIT, 0)))
        self.intake.report(engine.policy.load(self.queue), completions + ended)
        return _marked(outputs, completions) + self._ended(ended)

    def _accept(self, items: list) -> None:
        """What the group took: requests queued; a hand-off (``Handoff``) received by the
        group's connector, its requests added with their KV source; a cancellation (``Cancel``)
        aborted before the next step, wherever its request waits or runs by then."""
        for item in items:
            if isinstance(item, Handoff):
                for request, source in self.engine.connector.receive(item):
                    self.add_request(request, kv_source=source)
            elif isinstance(item, Cancel):
                self.abort([item.id])
            else:
                enqueue(self.queue, [item])

    def _apply_aborts(self) -> list[CoreOutput]:
        """The aborts asked for since the last step: a request not taken yet, queued or running ends now."""
        ids, self.aborts = self.aborts, []
        ended = []
        for rid in ids:
            request = self.intake.remove(rid) if isinstance(self.intake, LocalAdmission) else None
            if request is not None:
                ended.append(request.aborted())
                self.dropped += 1
        withdrawn = self.engine.policy.withdraw(set(ids))  # waiting in the policy's own queues
        for request in withdrawn:
            self.engine._live.pop(request.id, None)
            ended.append(request.aborted())
        withdrawn += [r for r in self.queue if isinstance(r, Request) and r.id in ids]
        ended += withdraw(self.queue, ids, self.engine._live) + self._end_cancelled()
        for request in [r for r in withdrawn if r.kv_source]:  # (its KV awaited: the connector's hold goes back)
            self.engine.connector.forget(request)
        self._done(ended)
        self.intake.report(self.engine.policy.load(self.queue) if ended else None, ended)  # (their KV is free)
        return self._ended(ended)

    def _end_cancelled(self) -> list[Completion]:
        """Cancelled running sequences the policy can end between steps: their KV back now."""
        ended = []
        for seq in [s for s in self.engine._live.values() if s.cancelled]:
            if self.engine.policy.ends_now(seq):
                seq.finish_reason = "abort"
                self.engine.policy.retire(seq)
                self.engine._live.pop(seq.request.id)
                ended.append(seq.completion(self.start))
        return ended

    def _done(self, completions: list[Completion]) -> None:
        """``completions`` finished here; an in-flight pipeline's first stage notes its aborts
        to the later stages."""
        for c in completions:
            self.done[c.id] = c
        if self.engine.flow is not None:
            self.engine.flow.aborted(completions)

    def _ended(self, completions: list[Completion]) -> list[CoreOutput]:
        return [CoreOutput(c.id, [], RequestStatus.of_finish(c.finish_reason), c) for c in completions]


def _gained(step: Step, tokens: list[int]) -> dict[int, list[int]]:
    """Request id -> the tokens its sequence gained in ``step`` (none for a short prompt chunk)."""
    gained: dict[int, list[int]] = {}
    for seq, token in zip(step.seqs, tokens):
        new = gained.setdefault(seq.request.id, [])
        if token != NO_TOKEN:
            new.append(token)
    return gained


def _marked(gained: dict[int, list[int]], completions: list[Completion]) -> list[CoreOutput]:
    """One output per request of the step, the finished ones with their completions."""
    by_id = {c.id: c for c in completions}
    outputs = []
    for rid, tokens in gained.items():
        c = by_id.get(rid)
        status = RequestStatus.RUNNING if c is None else RequestStatus.of_finish(c.finish_reason)
        outputs.append(CoreOutput(rid, tokens, status, c))
    return outputs


def _waiting(request: Request) -> RequestStatus:
    """A queued request's status."""
    if request.preempted:
        return RequestStatus.PREEMPTED
    return RequestStatus.WAITING_FOR_KV if request.kv_source else RequestStatus.WAITING

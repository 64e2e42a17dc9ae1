"""The one request loop: admit -> policy -> step -> sample -> agree on tokens -> retire.

Every strategy runs on this loop: it supplies runners (:class:`ModelRunner`, one per layout) and a
:class:`Policy`. Each engine group (a set of ranks; one group when the layout steps in lockstep)
runs the loop on the requests it is handed (the whole list, or what the router on rank 0 hands it,
:mod:`parallel.engine.router`); the policy splits each step's sequences over the data-parallel
replicas of the step's layout, each replica computes its share, and :func:`sample_step` makes
every rank of the group continue with the same tokens. The policy returns each step as plain data
and the engine makes the moves it names (:mod:`parallel.engine.policy`); KV from elsewhere comes
through its connectors (:mod:`parallel.engine.connector`), the rest through :attr:`Engine.events`.
"""

from __future__ import annotations

import datetime
import functools
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from collections.abc import Sequence as Seq

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from reshard.background import Worker
from reshard.mesh import device_type
from reshard.parallel.engine.admission import (
    ADMIT,
    Admission,
    Done,
    RoutedAdmission,
)
from reshard.parallel.engine.agree import sample_emitting, sample_step
from reshard.parallel.engine.batching import ContinuousBatching, batching_options
from reshard.parallel.engine.channel import Channel, GroupLayout
from reshard.parallel.engine.checks import (
    check_chunked,
    check_requests,
    check_same_requests,
    seeded,
)
from reshard.parallel.engine.config import EngineConfig, refuse_moved_keys
from reshard.parallel.engine.connector import KVConnectors
from reshard.parallel.engine.core import EngineCore
from reshard.parallel.engine.events import EngineEvents
from reshard.parallel.engine.inflight import BatchQueue, use_inflight
from reshard.parallel.engine.policy import Policy, PolicyContext, RunnerInfo, Step, StepOutput
from reshard.parallel.engine.request import (
    NO_TOKEN,
    Completion,
    Request,
    Sequence,
    eos_ids,
    model_eos_ids,
    record_times,
)
from reshard.parallel.engine.routed import generate_routed
from reshard.parallel.engine.runner import ModelRunner, runners_device
from reshard.parallel.engine.sampling import SamplingParams
from reshard.parallel.engine.step import make_cache_moves, policy_moves
from reshard.parallel.model.info import parallel_info
from reshard.parallel.model.offload import release_runners, restore


class Engine:
    """Generation over one or more layouts of a model.

    ``Engine(model, config)``: one runner in the model's own layout, continuous batching (a
    tensor-parallel model, with data-parallel replicas when its dims have ``dp > 1``).
    ``Engine(runners={...}, policy=..., config=...)``: a strategy's layouts and policy (the
    runners hold their own slots and caches; the config's ``routing``, ``group_timeout`` and
    ``pipeline`` still apply).

    Args:
        config: every knob that is configuration (slots, sequence length, KV cache, admission,
            chunked prefill, replicas, routing, pipeline schedule...): :class:`EngineConfig`.
        runners, policy: a strategy's layouts (name -> :class:`ModelRunner`) and its
            :class:`Policy` (default: :class:`ContinuousBatching` over the first runner, in
            flight for a pipeline that can keep micro-batches in flight, see
            ``EngineConfig.pipeline``).
        group: the ranks that agree on every step's tokens (e.g. ``dist.group.WORLD`` when layouts
            on disjoint ranks share steps, as DejaVu's do); default: the step's layout's ranks.
        host_tiers: layouts whose KV reaches the other layouts' caches through a host tier (layout
            -> its :class:`reshard.kv.CPUKVTier`, e.g. Seesaw's prefill); fault tolerance keeps
            those tiers in files that outlive a restart instead of replicating the layout's cache.
        engine_group: which group of the job this engine is, for strategies that compose groups
            of several layouts (DejaVu's sides); default: the runner's replica, if it is a group.
        tokenizer: a Hugging Face tokenizer, for requests with stop strings (``SamplingParams.stop``:
            a request ends once its decoded output holds one); settable later (``engine.tokenizer``).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        config: EngineConfig | None = None,
        *,
        runners: Mapping[str, ModelRunner] | None = None,
        policy: Policy | None = None,
        group: dist.ProcessGroup | None = None,
        host_tiers: Mapping | None = None,
        engine_group: GroupLayout | None = None,
        tokenizer=None,
        **moved,
    ) -> None:
        refuse_moved_keys(moved)
        if (model is None) == (runners is None):
            raise ValueError("give either a model or runners")

        self.config = config = config if config is not None else EngineConfig()
        if config.prefill_chunk is not None:  # before any runner (and so any collective) exists
            check_chunked(config.prefill_chunk, model=model, policy=policy)
        self.runners = dict(runners) if runners is not None else {"main": ModelRunner(model, config)}
        self.group_timeout = None if config.group_timeout is None else datetime.timedelta(seconds=config.group_timeout)

        custom = policy is not None or config.replicas == "lockstep"
        inflight = use_inflight(config.pipeline, self.runners, custom_policy=custom)
        # an in-flight pipeline's batch queue, on every stage (None: every step drains)
        self.flow = BatchQueue(next(iter(self.runners.values()))) if inflight else None
        self._advance = self._advance_drained if self.flow is None else self._advance_inflight
        self.policy = policy or self._default_policy()

        model = next(iter(self.runners.values())).model
        self.vocab_size, self.eos_ids = model.config.vocab_size, model_eos_ids(model)
        self.group, self.host_tiers = group, dict(host_tiers or {})
        self.events = EngineEvents()
        self.stats = self.policy.stats_cls()
        # a Hugging Face tokenizer: requests' stop strings are matched in its text
        self.tokenizer = tokenizer

        layouts = {name: RunnerInfo.of(r) for name, r in self.runners.items()}
        # where KV comes from besides computing it (a job adds them)
        self.connector = KVConnectors.of(self.runners)
        # request id -> its running sequence here (a cancel marks it)
        self._live: dict[int, Sequence] = {}
        self.policy.setup(PolicyContext(layouts, self.stats, self._new_sequence, self.connector))
        self.active: str | None = self.policy.initial_layout
        self.engine_group = engine_group or next(iter(self.runners.values())).engine_group  # None: one group

        self.group_stats: list = []  # every group's counters after a routed generate
        # routed generates so far: each call's store keys have a prefix of their own
        self.routed_calls = 0
        # the thread routed calls' routers run on (the job's first rank)
        self._router_worker: Worker | None = None
        self._released: list = []  # caches and weights freed by release_memory(), restored by ready()
        self._weights_seen: tuple = ()  # (version, writes) of every runner's weights at the last look
        self._prefix_resets = 0
        self.steps_done = 0

    def _default_policy(self) -> Policy:
        """Continuous batching over the first runner, by the config (in flight: see ``pipeline``;
        a later stage of an in-flight pipeline runs the steps the first stage notes)."""
        layout = next(iter(self.runners))
        options = batching_options(self.config, [self.runners[layout]])
        if self.flow is not None:
            return self.flow.policy(layout, options)
        return ContinuousBatching(layout, **options)

    # ---- what the active layout holds ------------------------------------------------------------
    @property
    def runner(self) -> ModelRunner:
        return self.runners[self.active or next(iter(self.runners))]

    @property
    def model(self) -> nn.Module:
        return self.runner.model

    @property
    def kv(self):
        return self.runner.kv

    @property
    def max_batch_size(self) -> int:
        return self.runner.max_batch_size

    @property
    def max_seq_len(self) -> int:
        return min(r.max_seq_len for r in self.runners.values())

    # ---- the loop -------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        requests: Seq[Request],
        *,
        seed: int | None = None,
        progress: bool = False,
    ) -> list[Completion]:
        """Run all ``requests`` (the same list on every rank) to completion; returns every
        completion, in request order, on every rank. A sampled request without a seed of its own
        takes one from ``seed`` and its position in ``requests`` (None: a fresh seed per call).
        With several engine groups (:attr:`engine_group`) each group runs this loop on the
        requests the router hands it; the completions are gathered at the end. A request with an
        ``arrival`` time is admitted once it has arrived (online workloads)."""
        if self.engine_group is None:  # engine groups check theirs once the router's start is posted
            check_same_requests(requests, self.agreement_group())
            requests = seeded(requests, seed, self.agreement_group())
        self.validate(requests)
        self.ready()

        with tqdm(total=len(requests), disable=not progress, desc="generate", unit="req") as bar:
            if self.engine_group is None:
                core = EngineCore(self, progress=bar)
                for request in requests:
                    core.add_request(request)
                done = core.run()
                return [done[r.id] for r in requests]
            return generate_routed(self, requests, bar, seed)

    @torch.inference_mode()
    def serve_routed(
        self,
        channel: Channel,
        endpoint: str,
        beat: Callable[[], None] | None = None,
        layout: GroupLayout | None = None,
        keep: bool = True,
    ) -> list[Completion]:
        """Serve this rank's engine group as ``endpoint`` of a supervised job (whose router runs
        in another process, :mod:`reshard.parallel.engine.router`): requests come from
        ``channel``, every completion goes to its ``done`` list as it finishes; ``beat()`` runs
        while it waits for requests (a heartbeat: idle is not hung). ``layout``: the group, when the
        engine is not one of several (a strategy's one group of every rank). Returns this group's
        completions (:meth:`generate` returns the whole job's, where every group lives to the
        end; ``keep=False``, a server's, which runs without end: none, each is only counted)."""
        layout = layout or self.engine_group
        assert layout is not None, "serve_routed runs an engine group: give its layout"
        self.ready()

        what = f"engine group {endpoint} waiting for the router's start time"
        channel.wait("start", what, self.group_timeout)
        admission = RoutedAdmission(channel, layout, None, self.group_timeout, endpoint=endpoint, beat=beat)
        return list(EngineCore(self, admission, start=channel.get("start"), done=Done(keep)).run().values())

    def ready(self, tags: Collection[str] = ("weights", "kv_cache"), check: bool = True) -> None:
        """Before serving: weights synced (``check``), what release_memory() freed of ``tags`` back."""
        for runner in self.runners.values() if check else ():
            parallel_info(runner.model).weight_version.check_ready()
        self._released = restore(self._released, tags)
        self.check_weights()

    def check_weights(self) -> bool:
        """Where any runner's weights were written since the last look, no cached prefix is
        shared any more (its KV is of the old weights); returns whether they were."""
        seen = tuple((id(v), v.writes) for v in (parallel_info(r.model).weight_version for r in self.runners.values()))
        if seen == self._weights_seen:
            return False
        self._weights_seen = seen
        self.reset_prefix_cache()
        return True

    def reset_prefix_cache(self) -> None:
        """Share no KV computed so far with later requests (vLLM's ``reset_prefix_cache``): the
        engine calls it itself when weights are written, the cache freed or overwritten."""
        self._prefix_resets += 1
        self.policy.reset_prefix_cache(self._prefix_resets)

    def _advance_drained(self, queue: deque, admission: Admission) -> list[tuple[Step, StepOutput]]:
        """The steps that finished next: the policy's next step, run to its agreed tokens."""
        step = self._scheduled(self.policy.next_step(queue))
        # (the proposal is read once the step computed: what arrived meanwhile joins the next step)
        output = self._run(step, {ADMIT: admission.proposal, **self.connector.agree()})
        self.connector.agreed(output.agreed or {})
        return [(step, output)]

    def schedules_ahead(self) -> bool:
        """Whether steps are scheduled one ahead (``EngineConfig.async_scheduling``; None: where
        the device is CUDA): with the default policy's token budget, drained, no KV connectors."""
        on = self.config.async_scheduling
        on = device_type() == "cuda" if on is None else on
        return on and self.flow is None and self.policy.schedules_ahead and not self.connector.members

    def _advance_ahead(
        self, queue: deque, admission: Admission, ahead: Step | None
    ) -> tuple[list[tuple[Step, StepOutput]], Step]:
        """Async scheduling: run the step scheduled during the last one (the first: scheduled
        now) and, once its forward is launched, schedule the next one; then agree on this one's
        tokens. Returns the step run and the step scheduled ahead."""
        step = self._scheduled(self.policy.next_step(queue)) if ahead is None else self.policy.confirm(ahead, queue)
        extras = {ADMIT: admission.proposal, **self.connector.agree()}  # (read after the forward)

        runner = self._prepare(step, self.steps_done)
        started, t0 = time.time(), time.perf_counter()
        mine, logits = self._forward(step, runner)
        emits = step.emits()  # (read before its positions move on)
        prompt = self._advance_positions(step)
        nxt = self.policy.ahead(queue)  # (on an asynchronous device, while the forward computes)
        self._scheduled(nxt)

        tokens, agreed, logprobs = self._sample(step, runner, mine, logits, emits, extras)
        self._append(step, tokens, started, t0, logprobs, prompt)
        self.connector.agreed(agreed or {})
        return [(step, StepOutput(tokens, agreed=agreed))], nxt

    def _scheduled(self, step: Step) -> Step:
        self.events.fire("step_scheduled", step)
        return step

    def _advance_inflight(self, queue: deque, admission: Admission) -> list[tuple[Step, StepOutput]]:
        """In-flight pipeline: on the last stage, the step it sampled landed at once; else the
        next step launched (after landing the steps that hold its sequences); else, when none can
        go, the oldest one landed. (Landing what arrived before launching the next step would
        delay the next stage's work: measured 5-8% fewer tokens/s, ``bench/pipeline.py``.)"""
        flow = self.flow
        if flow.flights and flow.flights[0].sampled_here:
            return [self._land(admission)]

        step = self.policy.next_step(queue) if len(flow.flights) < self.runner.num_microbatches else None
        if step is not None:
            self._scheduled(step)
        if step is None:
            # nothing to land with no step to run: a later stage whose first stage has stopped
            stopped = not flow.first and self.policy.only_aborted_left()
            assert flow.flights or stopped, "no step, nothing in flight, and requests that will not end"
            return [self._land(admission)] if flow.flights else []

        landed = [self._land(admission) for _ in range(flow.holding(step))]
        if not flow.first:
            self.policy.check(step)
        self._launch(step)
        return landed

    def _leads_group(self) -> bool:
        """Whether this rank is the first of the ranks that agree on steps (it proposes admissions)."""
        return not dist.is_initialized() or dist.get_rank() == min(dist.get_process_group_ranks(self.agreement_group()))

    def agreement_group(self) -> dist.ProcessGroup | None:
        """The ranks that agree on this engine's steps, and so call :meth:`generate` together with
        one engine group (None: no process group)."""
        if not dist.is_initialized():
            return None
        return (self.group if self.group is not None else self.runner.group) or dist.group.WORLD

    def _run(self, step: Step, extras: dict[str, int]) -> StepOutput:
        """Enter the step's layout, make its moves, compute it and agree on its tokens."""
        runner = self._prepare(step, self.steps_done)
        started = time.time()
        t0 = time.perf_counter()
        tokens, agreed, logprobs = self._computed(step, runner, extras)
        self._record(step, tokens, started, t0, logprobs)
        return StepOutput(tokens, agreed=agreed)

    def _prepare(self, step: Step, index: int) -> ModelRunner:
        """Make step ``index``'s cache moves, enter its layout and make the policy's moves."""
        self.stats.kv_bytes_released += make_cache_moves(step.moves, self.runners)
        runner = self._enter(step.layout)
        for move in policy_moves(step.moves):
            self.policy.make(move)
        self.events.fire("step_ready", index, step)
        return runner

    def _record(
        self,
        step: Step,
        tokens: list[int],
        started: float,
        t0: float,
        logprobs: list | None = None,
    ) -> None:
        """Move a step's sequences past the positions it computed, then append its tokens."""
        self._append(step, tokens, started, t0, logprobs, self._advance_positions(step))

    def _advance_positions(self, step: Step) -> int:
        """The step's sequences hold its positions' KV now; returns the prompt tokens it computed."""
        prompt = 0
        for seq, fed in zip(step.seqs, step.num_tokens):
            prompt += max(0, min(fed, seq.prompt_len - seq.num_computed_tokens))
            seq.num_computed_tokens += fed
        return prompt

    def _append(
        self, step: Step, tokens: list[int], started: float, t0: float, logprobs: list | None, prompt: int
    ) -> None:
        """Append a step's agreed tokens (and their log-probabilities, where asked) to its
        sequences; count it (``prompt``: the prompt tokens it computed); tell the listeners."""
        now = time.time()

        for seq, token, lp in zip(step.seqs, tokens, logprobs or [None] * len(tokens)):
            if token != NO_TOKEN:  # a prompt chunk short of the prompt's end emits nothing
                seq.append(token, lp)
            record_times(seq, started, now, emitted=token != NO_TOKEN)

        self.stats.add_step(step.kind, len(step.seqs), step.total_tokens, time.perf_counter() - t0)
        self.stats.prompt_tokens_computed += prompt
        self.events.fire("step_agreed", self.steps_done, step, tokens)
        self.steps_done += 1

    def _launch(self, step: Step) -> None:
        """In-flight pipeline: start one micro-batch's step on this stage (its tokens land later)."""
        index = self.steps_done + len(self.flow.flights)  # steps land in launch order
        self._prepare(step, index)
        self.events.fire("step_begin", step, step.seqs, layout=step.layout)
        self.flow.launch(step, self.events.layers(step.layout))
        self.connector.save(step, step.seqs)
        self.events.fire("step_end", step, step.seqs, layout=step.layout)

    def _land(self, admission: Admission) -> tuple[Step, StepOutput]:
        """In-flight pipeline: the oldest micro-batch's tokens (and log-probabilities) from the
        last stage, recorded. The first stage alone admits: its proposal is agreed."""
        flight, tokens, logprobs = self.flow.land()
        self._record(flight.step, tokens, flight.launched, flight.clock, logprobs)
        return flight.step, StepOutput(tokens, agreed={ADMIT: admission.proposal()})

    def _computed(self, step: Step, runner: ModelRunner, extras: dict) -> tuple[list[int], dict, list]:
        mine, logits = self._forward(step, runner)
        return self._sample(step, runner, mine, logits, step.emits(), extras)

    def _forward(self, step: Step, runner: ModelRunner) -> tuple[list[Sequence], torch.Tensor | None]:
        """This rank's share of the step computed: its sequences and their logits (None: none here)."""
        mine = [s for s in step.seqs if s.replica == runner.replica.rank]
        if not mine:  # (a replica without sequences still joins its layers' collectives: MoE dispatch)
            self.events.fire("idle", step, mine, layout=step.layout)
            runner.idle()
            return mine, None

        here = [n for s, n in zip(step.seqs, step.num_tokens) if s.replica == runner.replica.rank]
        self.events.fire("step_begin", step, mine, layout=step.layout)
        logits = runner.run(mine, here, self.events.layers(step.layout))
        self.connector.save(step, mine)
        self.events.fire("step_end", step, mine, layout=step.layout)
        return mine, logits

    def _sample(
        self,
        step: Step,
        runner: ModelRunner,
        mine: list,
        logits: torch.Tensor | None,
        emits: list[bool],
        extras: dict,
    ) -> tuple[list[int], dict, list]:
        """The step's tokens (where ``emits``), the same on every rank, with the agreed sums."""
        group = self.group if self.group is not None else runner.group
        # the policy's, the admissions, the connectors' (a callable is read now, after the compute)
        agree = {k: v() if callable(v) else v for k, v in {**step.agree, **extras}.items()}

        if all(emits):
            return sample_step(step.seqs, mine, logits, runner.is_source, self.vocab_size, group, agree)
        return sample_emitting(step.seqs, emits, mine, logits, runner.is_source, self.vocab_size, group, agree)

    def _enter(self, layout: str) -> ModelRunner:
        """Make ``layout`` active (``policy.on_switch`` moves what must move)."""
        if layout not in self.runners:
            raise ValueError(f"policy chose layout {layout!r}; the engine has {sorted(self.runners)}")
        if layout != self.active:
            self.policy.on_switch(self.active, layout)
            self.active = layout
        return self.runners[layout]

    # ---- checks and helpers ---------------------------------------------------------------------
    def _new_sequence(self, request: Request) -> Sequence:
        tok, skip = self.tokenizer, request.sampling.skip_special_tokens  # (stop strings: in its output's text)
        decode = None if tok is None else functools.partial(tok.decode, skip_special_tokens=skip)
        eos = (*self.eos_ids, *eos_ids(getattr(tok, "eos_token_id", None)))  # (the tokenizer's too: vLLM's)
        seq = self._live[request.id] = Sequence.of(  # (its noise drawn on this rank's device)
            request, eos, self.vocab_size, decode=decode, device=runners_device(self.runners)
        )
        return seq

    def validate(self, requests: Seq[Request]) -> None:
        """``ValueError`` naming the request for what this engine cannot run
        (:func:`check_requests`); then the policy's checks."""
        check_requests(
            requests,
            vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len,
            has_tokenizer=self.tokenizer is not None,
        )
        self.policy.validate(requests)

    def prompt_logits(self, prompts: Seq[Seq[int]]) -> list[torch.Tensor]:
        """fp32 logits ``(len(p), vocab)`` at every position of each prompt, through the active
        runner's cache (slots ``0..len(prompts)-1``); call it between ``generate`` calls."""
        if not 0 < len(prompts) <= self.max_batch_size:
            raise ValueError(f"prompt_logits takes 1..{self.max_batch_size} prompts, got {len(prompts)}")
        self.validate([Request(i, list(p), SamplingParams(max_new_tokens=1)) for i, p in enumerate(prompts)])
        self.reset_prefix_cache()  # (it writes blocks from 0 on)
        return self.runner.prompt_logits(prompts)

    def release_memory(self, weights: bool = False) -> int:
        """Free every runner's KV cache and its connectors' (e.g. while the same ranks train) and,
        with ``weights``, move the weights to host; returns the device bytes freed. :meth:`ready`
        re-acquires them. A decode step compiled by default runs eagerly from then on (the memory
        moves at every release, and CUDA graphs would re-record)."""
        eager = self.config.compile is None  # (left to the default: graphs would re-record at every release)
        released = self.connector.released_caches()
        freed, self._released = release_runners(list(self.runners.values()), released, weights, self._released, eager)
        self.reset_prefix_cache()
        return freed

    def router_worker(self) -> Worker:
        """The thread this rank's routed ``generate`` calls run their routers on, one for the
        engine's life: a call starts no thread of its own."""
        if self._router_worker is None:
            self._router_worker = Worker("reshard-router")
        return self._router_worker

    def close(self) -> None:
        """Release the policy's and the router's threads and shared memory (not collective; safe
        on error paths)."""
        self.policy.close()
        if self._router_worker is not None:
            self._router_worker.close(timeout=5.0)
            self._router_worker = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""A verl-shaped rollout over :class:`reshard.LLM`: what verl's ``BaseRollout`` asks of an engine.

verl drives its rollout servers through a small surface (read from its source): an async,
token-in / token-out ``generate`` per request (each with its own sampling parameters and id,
many in flight at once), ``update_weights`` from a generator of ``(HF name, tensor)`` pairs, and
``release`` / ``resume`` of the engine's memory around training. :class:`Rollout` gives that
surface over one ``LLM`` in one process (a data-parallel replica, as verl places its servers):
each request is added to the engine's core as it arrives and runs from the next step on, beside
those already running, so concurrency becomes batch size. verl itself is not imported:
verl 0.9.1 (read from its wheel) requires ``transformers<5.11``, ray, wandb and tensorboard, so
installing it beside the transformers reshard is tested with would downgrade it; the methods keep
``BaseRollout``'s names and arguments (``update_weights``' ``wire_format`` included).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from reshard.integrations import vllm_sampling
from reshard.parallel.engine.checks import seeded
from reshard.parallel.engine.core import EngineCore
from reshard.parallel.engine.request import Completion, Request
from reshard.parallel.llm import LLM
from reshard.parallel.vllm_api import within_context


@dataclass
class TokenOutput:
    """One request's result (verl's ``TokenOutput``): its tokens and their log-probabilities."""

    token_ids: list[int]
    log_probs: list[float] | None
    finish_reason: str


class Rollout:
    """verl's rollout surface over ``llm`` (an :class:`LLM` of one process). Every method is a
    coroutine; each ``generate`` call is a request added to the engine's
    :class:`reshard.parallel.engine.core.EngineCore`, which one task steps while any is
    unfinished: a request that arrives while others run joins them at the next step (continuous
    batching; at most ``max_batch_size`` run at once, the rest wait for a slot).
    """

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self._arrived: list[tuple[Request, asyncio.Future]] = []
        self._waiting: dict[int, asyncio.Future] = {}  # request id -> its caller's future
        self._ids = itertools.count()
        self._running: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # one user of the engine at a time: steps, weight updates, release

    async def generate(self, prompt_ids: list[int], sampling_params: dict, request_id: str) -> TokenOutput:
        """``prompt_ids``' completion under ``sampling_params`` (verl's dict: ``max_tokens``,
        ``temperature``, ``top_p``, ``top_k``, ``seed``, ``logprobs``, ...); ``request_id``
        only names it (its noise comes from its seed, or a fresh one)."""
        params = self.llm.sampling(vllm_sampling(sampling_params, f"request {request_id}"))  # (its logprobs_mode)
        params = within_context(params, len(prompt_ids), self.llm.engine.max_seq_len)  # (vLLM's cap)
        if params.n != 1:
            raise ValueError(f"request {request_id}: n={params.n}; verl sends one request per sample (n=1)")
        future = asyncio.get_running_loop().create_future()
        request = seeded([Request(next(self._ids), list(prompt_ids), params)], None, None)[0]
        self._arrived.append((request, future))
        if self._running is None or self._running.done():
            self._running = asyncio.create_task(self._drive())
        return await future

    async def _drive(self) -> None:
        """Step the engine while a request is unfinished, adding those that arrived before each step."""
        async with self._lock:
            self.llm.engine.ready()
            core = EngineCore(self.llm.engine)
            while self._arrived or core.has_unfinished():
                self._add(core)
                try:
                    outputs = await asyncio.to_thread(core.step)
                except Exception as e:  # every request in the engine gets the error
                    self._fail(e)
                    return
                for out in outputs:
                    if out.finished:
                        self._waiting.pop(out.request_id).set_result(_token_output(out.completion))

    def _add(self, core: EngineCore) -> None:
        """The requests that arrived, into the engine (one refused gets its error, alone)."""
        arrived, self._arrived = self._arrived, []
        for request, future in arrived:
            try:
                core.add_request(request)
            except ValueError as e:
                future.set_exception(e)
                continue
            self._waiting[request.id] = future

    def _fail(self, error: Exception) -> None:
        for future in [*self._waiting.values(), *(f for _, f in self._arrived)]:
            future.set_exception(error)
        self._waiting, self._arrived = {}, []

    async def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], wire_format: str = "named_tensors", **kwargs
    ) -> None:
        """Copy the ``(HF name, tensor)`` pairs into the engine (streamed: :meth:`LLM.load_weights`).
        verl's other ``wire_format`` (``"delta_flush"``) is refused by name."""
        if wire_format != "named_tensors":
            raise ValueError(f"update_weights: wire_format {wire_format!r} is not supported; give 'named_tensors'")
        async with self._lock:
            await asyncio.to_thread(self.llm.load_weights, weights)

    async def release(self) -> None:
        """Free the KV cache and move the weights to host for training (verl calls it before the
        actor's step)."""
        async with self._lock:
            self.llm.release(weights=True)

    async def resume(self, tags: list[str] | None = None) -> None:
        """Take back what ``tags`` names (verl's ``"weights"``, ``"kv_cache"``; None: both)."""
        async with self._lock:
            self.llm.resume(("weights", "kv_cache") if tags is None else tags)


def _token_output(c: Completion) -> TokenOutput:
    """A finished request as verl's ``TokenOutput``."""
    logprobs = None if c.logprobs is None else [lp for lp, _ in c.logprobs]
    return TokenOutput(c.output_ids, logprobs, c.finish_reason)

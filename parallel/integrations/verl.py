"""A verl-shaped rollout over :class:`reshard.LLM`: what verl's ``BaseRollout`` asks of an engine.

verl drives its rollout servers through a small surface (read from its source): an async,
token-in / token-out ``generate`` per request (each with its own sampling parameters and id,
many in flight at once), ``update_weights`` from a generator of ``(HF name, tensor)`` pairs, and
``release`` / ``resume`` of the engine's memory around training. :class:`Rollout` gives that
surface over one ``LLM`` in one process (a data-parallel replica, as verl places its servers):
requests that arrive while a batch runs wait and go together in the next one (a batching front
end, as an inference server's), so concurrency becomes batch size. verl itself is not imported:
verl 0.9.1 (read from its wheel) requires ``transformers<5.11``, ray, wandb and tensorboard, so
installing it beside the transformers reshard is tested with would downgrade it; the methods keep
``BaseRollout``'s names and arguments (``update_weights``' ``wire_format`` included).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from reshard.integrations import vllm_sampling
from reshard.parallel.engine.sampling import SamplingParams
from reshard.parallel.llm import LLM


@dataclass
class TokenOutput:
    """One request's result (verl's ``TokenOutput``): its tokens and their log-probabilities."""

    token_ids: list[int]
    log_probs: list[float] | None
    finish_reason: str


class Rollout:
    """verl's rollout surface over ``llm`` (an :class:`LLM` of one process). Every method is a
    coroutine; ``generate`` calls made while a batch runs form the next batch, in arrival order.
    """

    def __init__(self, llm: LLM, *, max_batch: int | None = None) -> None:
        self.llm, self.max_batch = llm, max_batch or llm.engine.max_batch_size
        self._waiting: list[tuple[list[int], SamplingParams, asyncio.Future]] = []
        self._running: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # one engine call at a time: batches, weight updates, release

    async def generate(self, prompt_ids: list[int], sampling_params: dict, request_id: str) -> TokenOutput:
        """``prompt_ids``' completion under ``sampling_params`` (verl's dict: ``max_tokens``,
        ``temperature``, ``top_p``, ``top_k``, ``seed``, ``logprobs``, ...); ``request_id``
        only names it (its noise comes from its seed, or a fresh one)."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((list(prompt_ids), vllm_sampling(sampling_params, f"request {request_id}"), future))
        if self._running is None or self._running.done():
            self._running = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        """Run what waits, a batch at a time, until nothing does."""
        while self._waiting:
            batch, self._waiting = self._waiting[: self.max_batch], self._waiting[self.max_batch :]
            try:
                async with self._lock:
                    outs = await asyncio.to_thread(
                        self.llm.generate, [p for p, _, _ in batch], [s for _, s, _ in batch]
                    )
            except Exception as e:  # every request of the batch gets the error
                for _, _, future in batch:
                    future.set_exception(e)
                continue
            for (_, _, future), out in zip(batch, outs):
                sample = out.outputs[0]
                lps = sample.logprobs
                logprobs = None if lps is None else [e[t].logprob for t, e in zip(sample.token_ids, lps)]
                future.set_result(TokenOutput(sample.token_ids, logprobs, sample.finish_reason))

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

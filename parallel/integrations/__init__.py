"""Adapters that let RL frameworks drive :class:`reshard.LLM` through their own interfaces
(``reshard.integrations.trl``, ``reshard.integrations.verl``); the sampling names they share
(vLLM's) are translated by :func:`reshard.parallel.vllm_api.vllm_sampling`."""

from __future__ import annotations

from reshard.parallel.vllm_api import vllm_sampling

__all__ = ["vllm_sampling"]

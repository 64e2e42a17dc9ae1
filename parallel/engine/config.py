"""The engine's configuration: one dataclass, :class:`EngineConfig` (vLLM's ``EngineArgs``).

``Engine(model, EngineConfig(...))`` and every strategy's ``build(path, config)`` take it; the
generate job's ``engine:`` section (``conf/generate.yaml``) is this dataclass, key for key, checked by
Hydra (:mod:`reshard.recipes.schema`). Only plain values live here (numbers, strings, ``None``),
so OmegaConf can hold it; live objects (process groups, runners, policies, a tokenizer) are
:class:`~reshard.parallel.engine.loop.Engine`'s keyword arguments. ``__post_init__`` checks every
range and choice and names the key and value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

DTYPES = ("float32", "bfloat16", "float16")
# keys that are counts: an int >= 1 (or None where the field allows it)
_COUNTS = (
    "max_batch_size",
    "max_seq_len",
    "max_prefill_tokens",
    "kv_block_size",
    "kv_tokens",
    "prefill_chunk",
    "num_microbatches",
)
MAX_DEFAULT_SEQ_LEN = 4096  # max_seq_len=None: the model's max_position_embeddings, capped at this


@dataclass
class EngineConfig:
    """Every engine knob that is configuration (see each field). Keys of a strategy (its layout,
    thresholds) live in the strategy's own dataclass, not here."""

    max_batch_size: int = 8
    """KV-cache slots per data-parallel replica: sequences that run at once."""

    max_seq_len: int | None = None
    """Prompt + generated tokens per slot; None: the model's ``max_position_embeddings``, capped at
    4096 (:meth:`seq_len`)."""

    max_prefill_tokens: int = 4096
    """The step's token budget per replica (vLLM's ``max_num_batched_tokens``): the default
    policy gives running sequences their decode token first, then prompts tokens while it lasts
    (a whole prompt larger than it still runs, alone in its step)."""

    admission: str = "fifo"
    """The default policy's admission order: ``"fifo"`` or ``"longest_first"`` (largest
    ``max_new_tokens`` first); strategies with a scheduler of their own ignore it."""

    kv_block_size: int | None = None
    """A paged KV cache: positions per block (with ``kv_tokens``); None: contiguous slots of
    ``max_seq_len`` positions."""

    kv_tokens: int | None = None
    """A paged KV cache: tokens per replica (with ``kv_block_size``); None: the memory contiguous
    slots would take, ``max_batch_size`` x ``max_seq_len`` rounded up to whole blocks."""

    replicas: str = "groups"
    """Data-parallel replicas: ``"groups"``, each an engine group that steps on its own, fed by a
    router; ``"lockstep"``, the replicas share every step (as fault tolerance's journal needs)."""

    routing: str = "least_loaded"
    """How the router places requests on engine groups: ``"least_loaded"`` (most free KV tokens),
    ``"round_robin"`` or ``"longest_first"``."""

    pipeline: str | None = None
    """A pipeline layout's schedule: ``"inflight"`` (micro-batches stay in flight across steps) or
    ``"drain"`` (every step drains the pipeline); None: in flight wherever it runs (one layout,
    the default policy, replicas as groups), else drained."""

    chunked_prefill: bool = True
    """One token budget per step (vLLM's ``enable_chunked_prefill``): prompts take tokens beside
    the running sequences' decode tokens, in steps that mix both, a prompt longer than the budget
    in chunks. It runs where the policy takes the engine's batching options (the default policy,
    an in-flight pipeline's per micro-batch, Shift's, SiDP's; with ``kv_swap`` too, each
    micro-batch's slots swapped in around it); elsewhere, and with False, whole prompts run in
    steps of their own."""

    prefix_caching: bool = True
    """Share the KV of prompts' common prefixes (vLLM's automatic prefix caching): full blocks of
    a paged cache (``kv_block_size``) are cached by the tokens they hold and reused by later
    requests (``n`` samples and a chat's next turn compute their prompt once); dropped whenever
    the weights are written. Runs with chunked prefill in the default policy (an in-flight
    pipeline's too), Shift's and SiDP's. On contiguous caches, Seesaw and DejaVu share whole
    prompts instead: ``n`` samples of a prompt computed once, and DejaVu's prompt side (in its
    slots) and Seesaw's CPU tier keep computed prompts for later requests that begin the same
    way."""

    async_scheduling: bool | None = None
    """Schedule step n+1 while step n computes (vLLM's ``async_scheduling``): the policy admits
    and budgets the next step right after this step's forward is launched, before its tokens are
    sampled and agreed; the next step's inputs are built once they are, and a sequence that
    finished meanwhile leaves it. Tokens are the same on or off. None: on where the device is
    CUDA (where the forward runs asynchronously to the host); it runs with chunked prefill in
    the default policy without KV connectors, and steps as usual elsewhere."""

    prefill_chunk: int | None = None
    """Chunked prefill's cap (vLLM's ``long_prefill_token_threshold``): a prompt gets at most this
    many tokens per step; None: up to ``max_prefill_tokens``. Needs ``chunked_prefill``, the
    default policy and no pipeline stages."""

    num_microbatches: int | None = None
    """Pipeline micro-batches per step; None: one per pipeline stage (the model's ``pp`` degree;
    1 without stages)."""

    kv_swap: bool = False
    """Micro-batch swapping (DejaVu): every slot's KV lives in host memory and the device holds
    two micro-batches' worth. Needs ``num_microbatches >= 2``, a contiguous cache and an eager
    decode step (``compile`` not True)."""

    compile: bool | None = None
    """``torch.compile`` the decode step (static shapes, a few graphs; CUDA graphs on a GPU). None:
    compiled where the device is CUDA, as vLLM compiles by default, and eager elsewhere (on a
    2-core CPU a compiled step of a tiny model measured 0-15% faster than an eager one, which pays
    back a warm compile of ~3 s only after some 20,000 steps: ``bench/RESULTS.md``). Eager too
    where the graphs would not hold (:meth:`compiles`): with ``kv_swap``, pipeline micro-batches,
    a strategy whose decode runs eagerly or whose KV and weights move (:meth:`Strategy.settled`:
    SiDP, DejaVu, Seesaw), supervised groups (a first compile would outlast their heartbeat), RL
    rollout engines, and an engine once it released its memory (its graphs would re-record at
    every release). False: eager (vLLM's ``enforce_eager``); True: compiled wherever it can run."""

    dtype: str | None = None
    """The weights' dtype when a strategy loads a checkpoint: ``"float32"``, ``"bfloat16"`` or
    ``"float16"`` (:attr:`torch_dtype`); None: the checkpoint's."""

    group_timeout: float | None = None
    """Seconds an engine group waits for the router before it fails naming what it waited for;
    None: the job's collective timeout."""

    allow_unused: bool = False
    """Load a checkpoint that holds tensors the model does not use."""

    load_weights: bool = True
    """False: a strategy building one layout leaves the parameters unread, for the caller to fill
    (a respawned group takes them from a live replica)."""

    def __post_init__(self) -> None:
        if self.prefill_chunk is not None and not self.chunked_prefill:
            raise ValueError(
                f"engine.prefill_chunk ({self.prefill_chunk}) caps chunked prefill, which engine.chunked_prefill=False "
                "turns off: give one of them"
            )
        if self.kv_tokens is not None and self.kv_block_size is None:
            raise ValueError(
                f"engine.kv_tokens ({self.kv_tokens}) sizes a paged KV cache: give engine.kv_block_size too"
            )
        for key in _COUNTS:
            value = getattr(self, key)
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"engine.{key} must be >= 1, got {value!r}")
        for key, choices in _choices().items():
            _check_choice(key, getattr(self, key), choices)
        if self.group_timeout is not None and not self.group_timeout > 0:
            raise ValueError(
                f"engine.group_timeout must be > 0 seconds (None: the collective timeout), got {self.group_timeout}"
            )

    def compiles(self, device_type: str, microbatches: int = 1) -> bool:
        """Whether the decode step runs compiled on a device of ``device_type``, in steps of
        ``microbatches`` micro-batches: :attr:`compile`, or where it is None, on CUDA in steps of
        one micro-batch (a pipeline stage's several would each replay a CUDA graph over the last
        one's outputs) without ``kv_swap``."""
        if self.compile is not None:
            return self.compile
        return device_type == "cuda" and microbatches == 1 and not self.kv_swap

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """:attr:`dtype` as a ``torch.dtype`` (None: the checkpoint's)."""
        return None if self.dtype is None else getattr(torch, self.dtype)

    def paged_tokens(self, seq_len: int) -> int | None:
        """A paged cache's tokens per replica for slots of ``seq_len`` positions (None: contiguous)."""
        if self.kv_block_size is None:
            return None
        block = self.kv_block_size
        if block > seq_len:
            raise ValueError(f"engine.kv_block_size ({block}) is longer than a sequence (max_seq_len {seq_len})")
        if self.kv_tokens is not None:
            return self.kv_tokens
        return self.max_batch_size * -(-seq_len // block) * block

    def seq_len(self, model_config: Any) -> int:
        """Positions per slot for a model of Hugging Face config ``model_config`` (vLLM's
        ``max_model_len``); ``ValueError`` naming both where ``max_seq_len`` runs past the model's
        ``max_position_embeddings`` (positions it was never trained on: plausible, wrong tokens)."""
        context = model_config.max_position_embeddings
        if self.max_seq_len is not None and self.max_seq_len > context:
            raise ValueError(
                f"engine.max_seq_len (LLM's max_model_len) {self.max_seq_len} exceeds the model's context: its "
                f"max_position_embeddings is {context}"
            )
        return self.max_seq_len or min(context, MAX_DEFAULT_SEQ_LEN)


def _choices() -> dict[str, tuple]:
    """The keys that take one of a few names, and those names (each owned by its module)."""
    from reshard.parallel.engine.batching import ADMISSION
    from reshard.parallel.engine.inflight import PIPELINES
    from reshard.parallel.engine.router import ROUTING
    from reshard.parallel.engine.runner import REPLICAS

    return {
        "admission": ADMISSION,
        "replicas": REPLICAS,
        "routing": ROUTING,
        "pipeline": (*PIPELINES, None),
        "dtype": (*DTYPES, None),
    }


def _check_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        names = [c for c in choices if c is not None]
        null = " or None" if None in choices else ""
        raise ValueError(f"engine.{key} must be one of {names}{null}, got {value!r}")


def refuse_moved_keys(given: dict) -> None:
    """``TypeError`` for keyword arguments ``Engine`` no longer takes (none given: nothing): one
    line pointing a key of :class:`EngineConfig` (given as ``Engine(model, max_batch_size=...)``,
    the form before ``EngineConfig``) to it."""
    if not given:
        return
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    key = sorted(given)[0]
    if key in fields:
        raise TypeError(
            f"Engine({key}={given[key]!r}) is a key of EngineConfig now: "
            f"Engine(model, EngineConfig({key}={given[key]!r}))"
        )
    raise TypeError(f"Engine got an unexpected keyword argument {key!r}")

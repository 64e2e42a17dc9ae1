"""The generate job's config: dataclasses that Hydra checks ``conf/generate.yaml`` and the overrides
against (registered in :mod:`reshard.recipes.schema`); ``__post_init__`` adds the range checks. The
``engine:`` section is the library's :class:`~reshard.parallel.engine.config.EngineConfig` itself."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from reshard.parallel.engine.config import EngineConfig


@dataclass
class ModelConfig:
    path: str | None = None
    cache_dir: str | None = None
    dtype: str = "float32"
    allow_unused_weights: bool = False  # load a checkpoint with tensors its config.json does not use

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"model.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


@dataclass
class WorkloadConfig:
    num_requests: int = 32
    prompt_len_min: int = 16
    prompt_len_max: int = 128
    seed: int = 0
    prompts_file: str | None = None
    rate: float | None = None  # online: Poisson arrivals at this many requests/s (null: offline)
    burst: int = 1  # online: requests arrive this many at a time

    def __post_init__(self) -> None:
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"workload.rate must be > 0 requests/s (or null: offline), got {self.rate}")
        if self.burst < 1:
            raise ValueError(f"workload.burst must be >= 1, got {self.burst}")
        if self.num_requests < 1:
            raise ValueError(f"workload.num_requests must be >= 1, got {self.num_requests}")
        if not 1 <= self.prompt_len_min <= self.prompt_len_max:
            raise ValueError(
                f"need 1 <= workload.prompt_len_min ({self.prompt_len_min}) <= "
                f"workload.prompt_len_max ({self.prompt_len_max})"
            )
        if self.prompts_file is not None:
            self._check_file_alone()

    def _check_file_alone(self) -> None:
        """The synthetic workload's keys do not apply to a prompts file: set to anything but their
        defaults next to one, they are a ``ValueError`` naming them (never silently ignored)."""
        default = WorkloadConfig()
        for key in ("num_requests", "prompt_len_min", "prompt_len_max"):
            if getattr(self, key) != getattr(default, key):
                raise ValueError(
                    f"workload.{key}={getattr(self, key)} shapes the synthetic workload; with "
                    f"workload.prompts_file={self.prompts_file} the file's lines are the requests (unset one)"
                )


@dataclass
class GenerationConfig:
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0  # the job's: request i samples with seed (seed * 1_000_003 + i) % 2**63
    stop_token_ids: Any = None  # a list of token ids that end a request besides the model's EOS ids
    min_tokens: int = 0  # stop tokens are never sampled before this many new tokens (HF min_new_tokens)
    ignore_eos: bool = False  # the model's EOS ids do not end a request (stop_token_ids still do)
    stop: Any = None  # strings that end a request once its decoded output holds one (needs the checkpoint's tokenizer)
    logprobs: int | None = None  # log-probabilities of each output token and of the top this many (null: none)
    n: int = 1  # samples per prompt (each its own request and seed; needs temperature > 0)

    def __post_init__(self) -> None:
        if not (type(self.n) is int and self.n >= 1):
            raise ValueError(f"generation.n must be an int >= 1 (samples per prompt), got {self.n!r}")
        if self.n > 1 and self.temperature == 0:
            raise ValueError(
                f"generation.n={self.n} samples per prompt need generation.temperature > 0 "
                "(greedy decoding gives n identical outputs)"
            )
        ids = self.stop_token_ids
        if ids is not None and not (
            isinstance(ids, (list, tuple)) and ids and all(type(t) is int and t >= 0 for t in ids)
        ):
            raise ValueError(
                f"generation.stop_token_ids must be a non-empty list of token ids >= 0 or null, got {ids!r}"
            )
        if self.stop is not None and not (
            isinstance(self.stop, (list, tuple)) and self.stop and all(isinstance(t, str) and t for t in self.stop)
        ):
            raise ValueError(
                f"generation.stop must be a non-empty list of non-empty strings or null, got {self.stop!r}"
            )
        try:
            self.sampling_params()
        except ValueError as e:  # SamplingParams names the field; add the config section
            raise ValueError(f"generation.{e}") from None

    def sampling_params(self):
        from reshard.parallel import SamplingParams

        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            stop_token_ids=None if self.stop_token_ids is None else tuple(self.stop_token_ids),
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop=tuple(self.stop or ()),
            logprobs=self.logprobs,
        )


MIN_HEARTBEAT_S = 0.1  # fault.heartbeat_s below this declares busy ranks dead (store polls of a loaded machine)


@dataclass
class FaultConfig:
    # retired (true is refused, naming its replacement): the whole-job restart with a KV ring;
    # fault.migrate=kv keeps KV through a failure inside the job
    replicate: bool = False
    # [rank, step]: SIGKILL that rank before that engine step of its first life; a list of such
    # pairs kills once per life (fault.migrate: per generation of its group; else per torchrun attempt)
    kill_at: Any = None
    # liveness period: under fault.migrate each engine group's leader beats at each step and while
    # it waits for requests
    heartbeat_s: float = 1.0
    # fault.migrate: an engine group whose leader has not beaten for this long is hung (killed and
    # respawned); longer than any step (a loaded machine's, a first compiled one's)
    hung_after_s: float = 30.0
    inject: str = "kill"  # what kill_at does: kill (SIGKILL) | hang (stop for good, heartbeats too)
    replicate_every: int = 1  # fault.migrate=kv: the most positions per sequence a failure computes again
    # a request handed on with its KV (fault.migrate=kv; DejaVu's prompt -> token groups) awaits KV
    # still on its way from a live group at most this long, then computes its prompt again
    handoff_wait_s: float = 2.0
    # supervised ranks (each engine a child of the process torchrun watches, respawned in the job)
    # and where a failed engine group's requests go: kv (the next group, which mirrors its KV,
    # adopts them and decodes on) | reprefill (any live group, prompt + tokens so far prefilled
    # again) | none (wait for the group's respawn); null: failures end the attempt
    migrate: Any = None
    max_respawns: int = 3  # per rank, under fault.migrate; one more failure ends the job
    warm_spare: bool = True  # fault.migrate: keep a spare child per rank with its imports done (a faster respawn)
    # fault.migrate: where a respawned engine takes its weights: replica (a live group of the same
    # layout sends its ranks' shards; the checkpoint when none serves) | checkpoint
    respawn_weights: str = "replica"
    # fault.migrate: SIGKILL rank 0's supervisor (the router's process) once this many requests
    # completed, in the first attempt (torchrun's restart takes over; finished requests are kept)
    kill_router_after: int | None = None

    def __post_init__(self) -> None:
        if not self.heartbeat_s >= MIN_HEARTBEAT_S:
            raise ValueError(
                f"fault.heartbeat_s must be >= {MIN_HEARTBEAT_S} s (each engine group's leader beats through the job's "
                f"store once a period: shorter periods spend the ranks' time on it), got {self.heartbeat_s}"
            )
        if not self.handoff_wait_s > 0:
            raise ValueError(f"fault.handoff_wait_s must be > 0 seconds, got {self.handoff_wait_s}")
        if not self.hung_after_s > self.heartbeat_s:
            raise ValueError(
                f"fault.hung_after_s must exceed fault.heartbeat_s ({self.heartbeat_s}), got {self.hung_after_s}"
            )
        self.kills()  # validates
        if self.replicate:
            raise ValueError(
                "fault.replicate=true (the whole-job restart with a KV ring) is retired: fault.migrate=kv keeps "
                "each rank's KV through a failure inside the job (fault.migrate=reprefill where a strategy "
                "cannot mirror it)"
            )
        if not (type(self.replicate_every) is int and self.replicate_every >= 1):
            raise ValueError(
                f"fault.replicate_every must be an int >= 1 (steps per message), got {self.replicate_every!r}"
            )
        self._check_migrate()
        if self.inject not in ("kill", "hang"):
            raise ValueError(f"fault.inject must be kill or hang, got {self.inject!r}")
        if self.inject == "hang" and self.kill_at is not None and self.migrate is None:
            raise ValueError(
                "fault.inject=hang needs fault.migrate: the heartbeat that declares a silent group hung comes "
                "with supervision (without it the others would wait in a collective), got fault.migrate=null"
            )

    def _check_migrate(self) -> None:
        if self.migrate is None and self.kill_router_after is not None:
            raise ValueError(
                f"fault.kill_router_after={self.kill_router_after} kills a supervised job's router; "
                "fault.migrate is null"
            )
        if self.migrate is None:
            return
        if self.migrate not in ("kv", "reprefill", "none"):
            raise ValueError(f"fault.migrate must be kv, reprefill, none or null, got {self.migrate!r}")
        if self.kill_router_after is not None and not (
            type(self.kill_router_after) is int and self.kill_router_after >= 1
        ):
            raise ValueError(f"fault.kill_router_after must be an int >= 1 or null, got {self.kill_router_after!r}")
        if self.respawn_weights not in ("replica", "checkpoint"):
            raise ValueError(f"fault.respawn_weights must be replica or checkpoint, got {self.respawn_weights!r}")
        if not (type(self.max_respawns) is int and self.max_respawns >= 0):
            raise ValueError(f"fault.max_respawns must be an int >= 0, got {self.max_respawns!r}")

    def check_world(self, world_size: int) -> None:
        """``ValueError`` naming the pair if ``fault.kill_at`` names a rank outside the job."""
        for rank, step in self.kills():
            if rank >= world_size:
                raise ValueError(
                    f"fault.kill_at [{rank}, {step}] names rank {rank}, outside the job's {world_size} ranks "
                    f"(0..{world_size - 1})"
                )

    def kills(self) -> list[tuple[int, int]]:
        """``(rank, step)`` to kill in attempt 0, 1, ... of the job."""
        k = self.kill_at
        if k is None:
            return []
        pairs = [k] if isinstance(k, (list, tuple)) and k and not isinstance(k[0], (list, tuple)) else k
        if not (isinstance(pairs, (list, tuple)) and pairs and all(_is_kill(p) for p in pairs)):
            raise ValueError(
                f"fault.kill_at must be [rank, step] (two ints >= 0), a list of them (one per "
                f"attempt) or null, got {k!r}"
            )
        return [tuple(p) for p in pairs]


def _is_kill(pair) -> bool:
    return isinstance(pair, (list, tuple)) and len(pair) == 2 and all(type(v) is int and v >= 0 for v in pair)


@dataclass
class ServeConfig:
    """``reshard serve``'s HTTP server (the generate job ignores it)."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None  # the model clients name (null: the checkpoint directory's name)
    max_waiting: int = 256  # accepted requests without a first token; more get 429 + Retry-After
    retry_after_s: int = 1
    grace_s: float = 30.0  # SIGTERM: running requests get this long to finish, then are cancelled

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"serve.port must be a port number in 0..65535, got {self.port}")
        for key in ("max_waiting", "retry_after_s"):
            if getattr(self, key) < 1:
                raise ValueError(f"serve.{key} must be >= 1, got {getattr(self, key)}")
        if not self.grace_s >= 0:
            raise ValueError(f"serve.grace_s must be >= 0 seconds, got {self.grace_s}")


@dataclass
class GenerateConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    # the registered strategy's config (a parallel.engine.Strategy dataclass; None: tp). Typed Any:
    # Hydra's ``parallel`` group puts the chosen strategy's schema here (conf/parallel/<name>.yaml)
    parallel: Any = None
    compile: bool | None = None  # null: compiled on CUDA where the strategy compiles (EngineConfig.compile)
    progress: bool = True

    def __post_init__(self) -> None:
        from reshard.parallel.engine import Strategy, make_strategy

        if self.parallel is None:
            self.parallel = make_strategy({})
        if not isinstance(self.parallel, Strategy):
            raise TypeError(f"parallel must be a registered strategy's config, got {type(self.parallel).__name__}")
        if self.engine.prefill_chunk is not None:  # before anything loads, on every rank alike
            self._check_prefill_chunk(self.engine.prefill_chunk)
        if self.generation.logprobs is not None and self.fault.migrate is not None:
            raise ValueError(
                f"generation.logprobs ({self.generation.logprobs}) are not kept across a failure (a migration "
                f"carries tokens only): unset fault.migrate ({self.fault.migrate})"
            )
        engine = self.engine_config()  # checks the engine keys the job's own keys set
        if self.fault.migrate is None:  # supervised jobs build their groups' engines themselves (recipes/supervised.py)
            self.parallel.check_args(engine)
        longest = self.workload.prompt_len_max + self.generation.max_new_tokens
        limit = self.engine.max_seq_len  # null: the model's (checked per request when it runs)
        if self.workload.prompts_file is None and limit is not None and longest > limit:  # a file's: build_requests
            raise ValueError(
                f"workload.prompt_len_max ({self.workload.prompt_len_max}) + "
                f"generation.max_new_tokens ({self.generation.max_new_tokens}) = {longest} exceeds "
                f"engine.max_seq_len ({limit})"
            )

    def engine_config(self) -> EngineConfig:
        """The :class:`EngineConfig` this job runs its strategy with: ``engine:`` plus the job's
        ``compile``, ``model.dtype`` and ``model.allow_unused_weights`` (an ``engine.`` key of
        those set otherwise is a ``ValueError`` naming both). Supervised groups (``fault.migrate``)
        decode eagerly unless ``compile=true``: a first compile would outlast their heartbeat."""
        compile = self.compile if self.compile is not None else self.engine.compile  # (null: either may set it)
        compile = False if compile is None and self.fault.migrate is not None else compile
        own = {"compile": compile, "dtype": self.model.dtype, "allow_unused": self.model.allow_unused_weights}
        self._check_engine_keys(own)
        return self.parallel.settled(replace(self.engine, **own))

    def _check_engine_keys(self, own: dict[str, Any]) -> None:
        """``ValueError`` naming both keys for an ``engine.`` key set apart from the job's key that
        sets it (``own``: engine key -> the job's value), or for unread weights."""
        job_keys = {"compile": "compile", "dtype": "model.dtype", "allow_unused": "model.allow_unused_weights"}
        default = EngineConfig()
        for key, value in own.items():
            given = getattr(self.engine, key)
            if given != getattr(default, key) and given != value:
                raise ValueError(
                    f"engine.{key} ({given!r}) differs from {job_keys[key]} ({value!r}), which sets it in the "
                    f"generate job: set {job_keys[key]} (and leave engine.{key} unset)"
                )
        if not self.engine.load_weights:
            raise ValueError("engine.load_weights=false leaves the weights unread; a generate job reads them")

    def _check_prefill_chunk(self, prefill_chunk: int) -> None:
        """``ValueError`` naming the values for what chunked prefill does not run with."""
        self.parallel.check_prefill_chunk(prefill_chunk)

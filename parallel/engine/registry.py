"""Strategies register themselves: name -> config dataclass that builds the engine and its summary.

A strategy is one module (or package) of :mod:`reshard.parallel.strategies` defining a dataclass
(its config: :mod:`reshard.recipes` registers it with Hydra as the schema of the option
``parallel=<name>``, which the YAML ``conf/parallel/<name>.yaml`` extends) decorated with
``@register_strategy("<name>")`` and subclassing :class:`Strategy`. The registry discovers the
built-in ones by importing every module of that package (no list of names); a strategy that lives
elsewhere registers when its module is imported, or is named by its dotted module path. The
recipes look strategies up by name and never branch on them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import pkgutil
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from reshard.parallel.engine.channel import Topology
from reshard.parallel.engine.config import EngineConfig
from reshard.parallel.engine.loop import Engine
from reshard.parallel.model.dims import ParallelDims

STRATEGIES_PACKAGE = "reshard.parallel.strategies"
_REGISTRY: dict[str, type] = {}


@dataclass(frozen=True)
class WorkloadShape:
    """What a strategy's planner knows of the job's requests before they run."""

    prompt_len: float  # mean prompt tokens
    new_tokens: int  # tokens generated per request
    batch: int  # sequences per step (the engine's max_batch_size)


PAGED_BLOCK_SIZE = 16  # a paged KV cache's block when a strategy pages by default (vLLM's block size)


class Strategy:
    """Base of a strategy's config dataclass (validate fields in ``__post_init__``)."""

    name: ClassVar[str] = ""
    compiles_decode: ClassVar[bool] = True
    """Whether a ``compile`` left to the default (None) may compile this strategy's decode step
    (False: it runs eagerly unless ``compile=True``, which a strategy may refuse: :meth:`settled`)."""

    def default_kv_block_size(self) -> int | None:
        """The KV cache's block size when the job gives none (``engine.kv_block_size`` unset,
        ``LLM(...)`` without it): a paged cache of :data:`PAGED_BLOCK_SIZE` where this strategy's
        engine caches prefixes, so ``n`` samples and chat turns compute their prompt once; the
        default, None: contiguous slots."""
        return None

    @classmethod
    def settled(cls, config: EngineConfig) -> EngineConfig:
        """``config`` with a ``compile`` left to the default settled to False where this strategy's
        decode step runs eagerly (:attr:`compiles_decode`); elsewhere the engine settles it by the
        device (:meth:`EngineConfig.compiles`)."""
        if config.compile is None and not cls.compiles_decode:
            return dataclasses.replace(config, compile=False)
        return config

    def planned(self, path: str | os.PathLike, world_size: int, workload: WorkloadShape) -> Strategy:
        """This config with what it left to a planner filled in (collective: every rank calls it and
        gets the same answer). The default leaves nothing to plan."""
        return self

    @property
    def strategy(self) -> str:
        return self.name

    def dims(self, world_size: int) -> ParallelDims:
        """A single-layout strategy's one layout over ``world_size`` ranks (``ValueError`` naming the
        keys if it cannot cover them). Strategies that run several layouts define :meth:`layouts`."""
        raise NotImplementedError(f"strategy {self.name!r} runs several layouts: see its layouts()")

    def layouts(self, world_size: int) -> dict[str, ParallelDims]:
        """Every layout the run uses, by name (Seesaw's ``prefill`` and ``decode``, DejaVu's ``prompt``
        and ``token`` sides, Shift's ``sp`` and ``tp`` modes; the default: :meth:`dims` as ``main``,
        the engine's one runner). Validates them all before anything loads; ``summary.json``'s
        ``parallel`` reports them (:meth:`ParallelDims.describe`)."""
        return {"main": self.dims(world_size)}

    def build(self, path: str | os.PathLike, config: EngineConfig) -> Engine:
        """Load the model in this strategy's layout(s) and return its engine (collective).

        The default builds :meth:`build_model` over the whole world, then :meth:`build_engine`.
        """
        import torch.distributed as dist

        model = self.build_model(path, self.dims(dist.get_world_size()), config)
        return self.build_engine(model, config)

    def build_model(self, path: str | os.PathLike, dims: ParallelDims, config: EngineConfig) -> nn.Module:
        """The model in this strategy's one layout over ``dims``' ranks (collective over the job),
        in ``config.dtype``; ``config.load_weights=False`` leaves its parameters unread.

        Strategies whose engine holds several module trees (Seesaw, DejaVu) do not define it, and so
        cannot be built on a subset of ranks (an RL rollout's).
        """
        raise NotImplementedError(f"strategy {self.name!r} has no single-layout model")

    def build_engine(self, model: nn.Module, config: EngineConfig) -> Engine:
        """The engine over a :meth:`build_model` model (collective over its ranks)."""
        raise NotImplementedError(f"strategy {self.name!r} has no single-layout model")

    @classmethod
    def single_model(cls) -> bool:
        """Whether the strategy builds one model in one layout (:meth:`build_model`)."""
        return cls.build_model is not Strategy.build_model

    def summary(self, engine: Engine) -> dict:
        """Keys this strategy adds to ``summary.json`` (collective: may reduce over ranks)."""
        return engine.stats.summary()

    def report(self, summary: dict) -> list[str]:
        """Lines the job prints about this strategy's keys of ``summary``."""
        return []

    def check_args(self, config: EngineConfig) -> None:
        """``ValueError`` naming the key and value for an engine config key this strategy cannot
        honour (checked with the job config, before anything loads; and again by :meth:`build`).
        The default: chunked prefill only where :meth:`check_prefill_chunk` allows it."""
        if config.prefill_chunk is not None:
            self.check_prefill_chunk(config.prefill_chunk)

    # ---- supervision (``fault.migrate``): the engine groups the supervisors run --------------------
    def supervised_layout(self, world: int, migrate: str) -> tuple[int, Topology]:
        """Ranks per engine group and the :class:`Topology` of a supervised job under ``migrate``
        (``ValueError`` for a layout supervision does not take). The default: one group of every
        rank, restarted whole in the job, whose supervisors keep its KV under ``kv`` unless
        :meth:`unhosted_reason` says why they cannot."""
        why = self.unhosted_reason(world) if migrate == "kv" else None
        if why is not None:
            raise ValueError(
                "fault.migrate=kv keeps each rank's KV cache of one lockstep group in its supervisors for the "
                f"group's next generation; parallel.strategy={self.name!r} {why} "
                "(use fault.migrate=reprefill or none)"
            )
        return world, Topology.lockstep(hosted=migrate == "kv")

    def unhosted_reason(self, world: int) -> str | None:
        """Why the supervisors cannot keep this lockstep strategy's KV for its next generation,
        as the end of a sentence naming the strategy (None, the default: they can)."""
        return None

    def group_strategy(self, path: str | os.PathLike, world: int, workload: WorkloadShape) -> Strategy:
        """What builds each supervised engine group's engine (collective, like :meth:`planned`).
        The default: this strategy, planned, for its one group of every rank."""
        return self.planned(path, world, workload)

    @property
    def replica_groups(self) -> bool:
        """Whether a supervised job's engine groups are replicas of one layout, whose ranks can
        give a respawned group its weights (the default: no, a single group)."""
        return False

    def check_prefill_chunk(self, prefill_chunk: int) -> None:
        """``ValueError`` naming the values if this strategy cannot run chunked prefill of
        ``prefill_chunk`` tokens (checked with the job config, before anything loads). The
        default: it cannot (its policy takes no cap per prompt)."""
        raise ValueError(
            f"engine.prefill_chunk ({prefill_chunk}) runs on the tp strategy's continuous batching; "
            f"parallel.strategy {self.name!r} takes no cap per prompt (set engine.prefill_chunk=null)"
        )


def register_strategy(name: str):
    """Class decorator: register a :class:`Strategy` dataclass under ``name``."""

    def register(cls: type) -> type:
        if not issubclass(cls, Strategy):
            raise TypeError(f"strategy {name!r}: {cls.__name__} must subclass Strategy")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return register


def discover() -> None:
    """Import every module of :data:`STRATEGIES_PACKAGE` so that its strategies register."""
    package = importlib.import_module(STRATEGIES_PACKAGE)
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{STRATEGIES_PACKAGE}.{module.name}")


def strategy_class(name: str) -> type:
    """The registered strategy ``name``: a built-in, or one in the module ``name`` (dotted path)."""
    if name not in _REGISTRY:
        discover()
    if name not in _REGISTRY and isinstance(name, str) and "." in name:
        with contextlib.suppress(ModuleNotFoundError):
            importlib.import_module(name)
    if name not in _REGISTRY:
        raise ValueError(f"parallel.strategy {name!r} is not one of {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def make_strategy(values: dict[str, Any]) -> Strategy:
    """The config of ``values["strategy"]`` (default ``tp``) built from the other keys, which are
    already of their fields' types: nested sections as their dataclasses. An unknown key is the
    constructor's ``TypeError``. Config files and overrides are checked against the dataclass by
    Hydra in :mod:`reshard.recipes` (``recipes.schema.strategy_config`` for a plain dict)."""
    values = dict(values)
    cls = strategy_class(values.pop("strategy", "tp"))
    _check_types(cls, values)
    return cls(**values)


def _check_types(cls: type, values: dict[str, Any]) -> None:
    """``ValueError`` naming a key whose value is not of its field's type, where that is ``int``,
    ``float``, ``bool``, ``str`` or one of them or None: ``LLM``'s keyword arguments reach here
    unchecked (``tensor_parallel_size="2"`` failed in a comparison), a config's are checked by Hydra."""
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        kinds = _simple_kinds(hints.get(key))
        if kinds and not any(_is_a(value, kind) for kind in kinds):
            names = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
            raise ValueError(f"parallel.{key} must be {names}, got {value!r}")


def _simple_kinds(hint) -> tuple[type, ...]:
    """The types a field of type ``hint`` takes where each is int, float, bool, str or None; () else."""
    kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return kinds if all(k in (int, float, bool, str, type(None)) for k in kinds) else ()


def _is_a(value: Any, kind: type) -> bool:
    """Whether ``value`` is of ``kind`` as a config reads it: a bool is no number, an int is a float."""
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return type(value) is int
    return value is None if kind is type(None) else isinstance(value, kind)


def registered() -> list[str]:
    """Every strategy name: the built-ins and any registered since."""
    discover()
    return sorted(_REGISTRY)

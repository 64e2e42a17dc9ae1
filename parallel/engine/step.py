"""A step as plain data: what a policy returns (:class:`Step`, the :class:`Move` s it names) and
what the engine tells it back (:class:`StepOutput`). :mod:`reshard.parallel.engine.policy` states
the contract."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from reshard.parallel.engine.request import Sequence, batch_kind


@dataclass(frozen=True)
class Move:
    """Something a step needs made before it runs, in its layout (after any transition). The
    policy that names it makes it when the engine calls :meth:`Policy.make`; a
    :class:`CacheMove` the engine makes itself."""


@dataclass(frozen=True)
class CacheMove(Move):
    """A move of one layout's KV cache memory, which the engine makes itself before it enters
    the step's layout (memory given up before that layout's weights move in): a policy that
    owns two caches holds one at a time (Seesaw's phases)."""

    layout: str

    def make(self, kv) -> int:
        """Make it on ``kv``, the layout's cache; returns the bytes given up."""
        raise NotImplementedError


@dataclass(frozen=True)
class ReleaseKV(CacheMove):
    """Give the layout's cache memory up (its contents are lost: what the policy keeps of them
    is elsewhere by now, e.g. swapped out to a host tier)."""

    def make(self, kv) -> int:
        return kv.release()


@dataclass(frozen=True)
class RestoreKV(CacheMove):
    """Allocate the layout's cache again (a no-op where it is allocated)."""

    def make(self, kv) -> int:
        kv.restore()
        return 0


def policy_moves(moves: tuple[Move, ...]) -> list[Move]:
    """``moves`` but the cache moves: those the policy makes (:meth:`Policy.make`), in order."""
    return [m for m in moves if not isinstance(m, CacheMove)]


def make_cache_moves(moves: tuple[Move, ...], runners) -> int:
    """Make ``moves``' cache moves in order on ``runners``' (layout -> runner) caches; returns
    the bytes given up."""
    freed = 0
    for move in (m for m in moves if isinstance(m, CacheMove)):
        assert move.layout in runners and runners[move.layout].kv is not None, f"{move}: no such cache"
        freed += move.make(runners[move.layout].kv)
    return freed


@dataclass
class Step:
    """One step: every sequence of it over all replicas (the same on every rank) and the tokens
    each computes: sequence ``i`` feeds its positions ``num_computed_tokens .. num_computed_tokens
    + num_tokens[i] - 1`` (its whole prompt, a chunk of it, or its last output token). A step
    with no sequences only agrees (``agree``, admissions): a "wait" step."""

    seqs: list[Sequence]
    num_tokens: list[int]  # tokens each sequence computes this step, from its num_computed_tokens on
    layout: str  # the runner that runs it
    moves: tuple[Move, ...] = ()  # made by the engine, in order, before the step runs (cache moves first)
    # summed over the group with the tokens; a callable is read after this rank's compute, just
    # before the agreement (e.g. "has this KV landed yet", which the compute's time may settle)
    agree: dict[str, int | Callable[[], int]] = field(default_factory=dict)
    _kind: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        assert len(self.num_tokens) == len(self.seqs), (len(self.num_tokens), len(self.seqs))
        assert all(n >= 1 for n in self.num_tokens), f"a step's sequence computes >= 1 token: {self.num_tokens}"
        self._kind = batch_kind(self.seqs, self.num_tokens)  # before the step runs and moves them on

    @property
    def kind(self) -> str:
        """``"prefill"`` | ``"decode"`` | ``"mixed"`` | ``"wait"``: derived from the counts when
        the step was made (:func:`batch_kind`), for statistics labels and listeners; it decides
        nothing in the engine."""
        return self._kind

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def emits(self) -> list[bool]:
        """Whether each sequence gets a token this step (read before it is recorded): all but a
        prompt chunk that stops short of the prompt's end."""
        return [s.num_computed_tokens + n >= s.prompt_len for s, n in zip(self.seqs, self.num_tokens)]


@dataclass(frozen=True)
class StepOutput:
    """What the engine tells the policy after a step."""

    tokens: list[int]  # the agreed next token of every sequence of the step, in its order (NO_TOKEN: none)
    agreed: dict[str, int] | None = None  # the step's ``agree`` summed over the group

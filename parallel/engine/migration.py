"""What the router records of a failed group (:class:`Migration`), the request arithmetic of
its moves (a prefill-only request of a disaggregated job's entry, a journal's tokens merged in)
and its count of the steps a group journaled."""

from __future__ import annotations

import dataclasses
import io
import pickle

from reshard.parallel.engine.channel import Channel
from reshard.parallel.engine.request import Request


@dataclasses.dataclass
class Migration:
    """What the router did when ``endpoint`` failed (``seen``: when it noticed, job clock).

    Ordered facts, no clock (tests assert on them): ``order``, its place in
    :attr:`Router.observed`; ``steps``, the steps every endpoint had journaled when the
    router saw the death (the dead one's: every step it ran); ``steps_down``, the same in the
    router's last count taken before it found the group's next generation ready (a count made
    while the group was still down).
    """

    endpoint: str
    seen: float
    order: int = 0
    steps: dict[str, int] = dataclasses.field(default_factory=dict)
    steps_down: dict[str, int] = dataclasses.field(default_factory=dict)
    resumed: list[int] = dataclasses.field(default_factory=list)  # request ids re-admitted with tokens so far
    restarted: list[int] = dataclasses.field(default_factory=list)  # ... with none yet
    completed: list[int] = dataclasses.field(default_factory=list)  # finished there, completed from the journal
    reprefilled_tokens: int = 0  # generated tokens prefilled again (reprefill; kv: by the adopter, if it had to)
    rejoined: float | None = None  # when the group's next generation was ready (job clock)
    rejoined_order: int | None = None  # that observation's place in Router.observed
    adopted_by: str | None = None  # migrate="kv": the endpoint that adopted its requests with their KV
    tokens: dict[int, int] = dataclasses.field(default_factory=dict)  # request id -> tokens it had generated


def prefill_only(request: Request) -> Request:
    """``request`` as an entry of a disaggregated job runs it: up to its first token."""
    first = dataclasses.replace(request.sampling, max_new_tokens=1, min_tokens=min(request.sampling.min_tokens, 1))
    return dataclasses.replace(request, sampling=first)


def merged(before: list[int], tokens: dict[int, int]) -> list[int]:
    """``before`` (a request's output known so far) with ``tokens`` (by output index) written in
    and everything after the last of them dropped."""
    if not tokens:
        return list(before)
    out = list(before[: max(tokens) + 1])
    out += [0] * (max(tokens) + 1 - len(out))
    for i, t in tokens.items():
        out[i] = t
    return out


def count_steps(channel: Channel, endpoint: str, counted: dict[str, tuple[int, int]]) -> None:
    """Count the steps appended to ``endpoint``'s journal since the last count (``counted``:
    endpoint -> (bytes of its journal counted, steps in them), updated)."""
    key = f"journal/{endpoint}"
    if not channel.ready(key):
        return
    blob = channel.store.get(key)
    done, steps = counted.get(endpoint, (0, 0))
    stream = io.BytesIO(blob)
    stream.seek(done)
    while stream.tell() < len(blob):
        pickle.load(stream)
        steps += 1
    counted[endpoint] = (len(blob), steps)

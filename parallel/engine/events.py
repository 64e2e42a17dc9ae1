"""The engine's one event interface: what strategies, fault injection, tests and benches listen to.

``engine.events.on(event, fn, layout=...)`` registers ``fn`` and returns a function that removes
it. The loop fires the step events; the runner fires the layer events (only when a listener for
its layout exists, so a step without layer listeners pays nothing per layer). Every rank fires the
same step events in the same order (every stage of an in-flight pipeline too: each runs the
steps the first stage notes).

============== ========================== ==================================================================
event          listener                   when
============== ========================== ==================================================================
step_scheduled ``fn(step)``                the policy made a step (async scheduling: while the one before it
                                          computes, before that one's tokens are agreed)
step_ready     ``fn(index, step)``        the step's layout is entered and its moves made; it runs next
step_begin     ``fn(step, seqs)``         this rank starts computing ``seqs``, its replica's share [layout]
layer_before   ``fn(i, hidden, ctx)``     before layer ``i`` (``hidden`` ``(1, N, D)``); a returned tensor
                                          replaces the hidden states [layout]
layer_after    ``fn(i, hidden, ctx)``     after layer ``i``; a returned tensor replaces them [layout]
step_end       ``fn(step, seqs)``         this rank finished computing ``seqs`` (before the agreement) [layout]
idle           ``fn(step, seqs)``         instead of begin/end when this rank's replica has no sequence of
                                          a computed step (``seqs`` empty; e.g. serve other replicas) [layout]
step_agreed    ``fn(index, step, tokens)`` every rank holds the step's agreed tokens
============== ========================== ==================================================================

[layout]: fired for the step's layout; ``on(..., layout=name or names)`` listens to those layouts
only (default: every layout).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

STEP_EVENTS = ("step_scheduled", "step_ready", "step_agreed")
LAYOUT_EVENTS = ("step_begin", "layer_before", "layer_after", "step_end", "idle")
EVENTS = STEP_EVENTS + LAYOUT_EVENTS


class LayerHooks:
    """The ``layer_before`` / ``layer_after`` listeners of one layout, handed to the runner per step."""

    def __init__(self, before: list[Callable], after: list[Callable]) -> None:
        self.before, self.after = before, after

    def apply(self, listeners: list[Callable], index: int, h: torch.Tensor, ctx) -> torch.Tensor:
        for fn in listeners:
            out = fn(index, h, ctx)
            h = h if out is None else out
        return h


class EngineEvents:
    """Listeners by event (see the module's table), each optionally restricted to some layouts."""

    def __init__(self) -> None:
        self._listeners: dict[str, list[tuple[Callable, frozenset[str] | None]]] = {e: [] for e in EVENTS}

    def on(self, event: str, fn: Callable, *, layout: str | Iterable[str] | None = None) -> Callable[[], None]:
        """Register ``fn`` for ``event`` (of ``layout``'s runner(s) only, for a layout event);
        returns a function that removes it."""
        if event not in self._listeners:
            raise ValueError(f"event {event!r} is not one of {EVENTS}")
        if layout is not None and event not in LAYOUT_EVENTS:
            raise ValueError(
                f"event {event!r} is fired once per step, not per layout; layouts apply to {LAYOUT_EVENTS}"
            )
        layouts = None if layout is None else frozenset([layout] if isinstance(layout, str) else layout)
        entry = (fn, layouts)
        self._listeners[event].append(entry)
        return lambda: self._listeners[event].remove(entry)

    def _for(self, event: str, layout: str | None) -> list[Callable]:
        return [fn for fn, only in self._listeners[event] if only is None or layout in only]

    def fire(self, event: str, *args, layout: str | None = None) -> None:
        """Call ``event``'s listeners (those of ``layout``, for a layout event) in registration order."""
        for fn in self._for(event, layout):
            fn(*args)

    def layers(self, layout: str) -> LayerHooks | None:
        """``layout``'s layer listeners for one step; None when it has none (the runner's fast path)."""
        before, after = self._for("layer_before", layout), self._for("layer_after", layout)
        return LayerHooks(before, after) if before or after else None

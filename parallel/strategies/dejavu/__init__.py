"""DejaVu prompt/token disaggregation: prompts on some ranks, tokens on the others.

The prompt ranks and the token ranks are two meshes with their own layouts (TP degree and
pipeline depth may differ, e.g. prompt TP2 -> token PP2). A prefill step runs on the prompt
ranks; a ``layer_after`` listener of the prompt layout streams layer ``i``'s KV to the token ranks
while layer ``i + 1`` computes (DejaVu's layer-by-layer prompt streaming), re-sharded on the way
by the stream plan (:mod:`reshard.kv.stream`).

By default (``replicas="groups"``) each side is one or more engine groups running the one engine
loop at the same time (:func:`dejavu_groups_engine`): a prompt group (:class:`PromptSide`)
prefills what the router hands it and hands every prefilled prompt, with its first token and
timing, to a token group (:class:`TokenSide`): the group's KV connector receives the hand-off,
the group adds its requests (``EngineCore.add_request`` with the hand-off as KV source), and
each takes a free slot, its KV loaded, and decodes once the KV has landed on every rank of the
group. With ``replicas="lockstep"`` both sides step in one loop (:class:`LockstepSides`: one
prompt side and one token side, each step over the whole job): a prompt step's hand-off goes
straight to the token side's connector, the one a token group has, so its requests resume
awaiting KV there exactly as in a token group; ranks outside a step's layout only join the
token agreement.

The appendix-D planner (:mod:`parallel.cost.dejavu_planner`) chooses the split when
``prompt_ranks`` is unset (:meth:`DejaVuStrategy.planned`), from configured step times or the cost
model's prediction; after the run it turns the measured prompt and token step times into the split
``D_p`` / ``D_t`` it would choose next time, reported in ``summary.json``.
"""

from reshard.parallel.strategies.dejavu.prompt import PromptSide
from reshard.parallel.strategies.dejavu.sides import DejaVuStats, LockstepSides, TokenSide
from reshard.parallel.strategies.dejavu.strategy import (
    DejaVuStrategy,
    SideConfig,
    dejavu_engine,
    dejavu_groups_engine,
    predicted_step_ms,
)

__all__ = [
    "DejaVuStats",
    "DejaVuStrategy",
    "LockstepSides",
    "PromptSide",
    "SideConfig",
    "TokenSide",
    "dejavu_engine",
    "dejavu_groups_engine",
    "predicted_step_ms",
]

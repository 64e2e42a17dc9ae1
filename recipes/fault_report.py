"""What a supervised generate run reports of its failures (``summary.json``'s ``fault``): each death
as the router saw it, what moved where, and what the other groups did while the dead one was down,
in steps journaled between the router's observations (no clock: tests assert the order of what
happened, never how long it took)."""

from __future__ import annotations

from reshard.parallel.engine.admission import Endpoint
from reshard.parallel.engine.channel import Channel
from reshard.parallel.engine.router import Migration, Router
from reshard.parallel.fault.journal import read_journal
from reshard.parallel.fault.supervisor import failures


def _outage(router: Router, m: Migration, entries: dict) -> dict:
    """What the other groups did while ``m``'s group was down, in steps journaled between the
    router's count when it saw the death and its last count before it saw the group's next
    generation ready (or the end), no clock.

    ``others_kept_stepping``: each endpoint of another group not dead yet when the death was seen,
    and its steps in that interval; ``served_throughout``: those of them already ready then and
    not dead before the interval ended; ``stepped_by_adopter``: the requests of ``resumed`` the
    adopter journaled a token of after the death was seen."""
    never = float("inf")
    died = {d.endpoint: d.order for d in router.migrations}
    ready = {e: k for k, (what, e) in enumerate(router.observed) if what == "ready"}
    rejoined = m.rejoined_order is not None
    end = m.rejoined_order if rejoined else len(router.observed)
    upto = m.steps_down if rejoined else {e: len(js) for e, js in entries.items()}
    group = Endpoint(m.endpoint).group
    others = [e for e in entries if Endpoint(e).group != group and died.get(e, never) > m.order]
    adopter = entries.get(m.adopted_by, [])[m.steps.get(m.adopted_by, 0) :]
    journaled = {t[0] for entry in adopter for t in entry.tokens}
    return {
        "others_kept_stepping": {e: upto.get(e, 0) - m.steps.get(e, 0) for e in others},
        "served_throughout": [e for e in others if ready.get(e, never) < m.order and died.get(e, never) > end],
        "stepped_by_adopter": [rid for rid in m.resumed if rid in journaled],
    }


def _adopted(router: Router, m: Migration, adoptions: list) -> list[tuple]:
    """``m``'s requests adopted with their KV: (request id, output tokens whose KV came, positions
    computed again). Adoptions are ``(source, request id, kept, again, adopter)``: from the dead
    endpoint's mirror, or, where its supervisors host the KV, by the group's next generation."""
    if router.topology.hosted:
        host = f"{router.topology.host}.0"
        return [a[1:4] for a in adoptions if a[0] == host and a[4] == m.adopted_by and a[1] in m.resumed]
    return [a[1:4] for a in adoptions if a[0] == m.endpoint]


def _first_token(entries: dict, requests: set[int], after: float, clock) -> float | None:
    """When the first of ``requests`` produced a token anywhere after ``after`` (job clock)."""
    times = [clock(e.time) for js in entries.values() for e in js if any(t[0] in requests for t in e.tokens)]
    later = [t for t in times if t > after]
    return min(later) if later else None


def fault_summary(
    router: Router, channel: Channel, store, endpoints: list[str], digests: dict, adoptions: list
) -> dict:
    """What failed and what moved where; per death, what the other groups did while the dead
    one was down, in steps journaled between the router's observations (:func:`_outage`; no
    clock); every generation's weight digest per rank. Times in seconds on the job's clock (for
    people: tests assert the order of what happened, never how long it took)."""
    clock = lambda t: t - router.start  # noqa: E731
    entries = {e: read_journal(channel, e) for e in endpoints}
    journals = {e: [clock(entry.time) for entry in js] for e, js in entries.items()}
    ready = {e: clock(channel.get(f"ready/{e}")) for e in endpoints if channel.ready(f"ready/{e}")}
    failed: dict = {}
    for f in failures(store):  # the first recorded death of a generation is its cause
        failed.setdefault(f"{f.group}.{f.generation}", f)
    deaths = []
    for m in router.migrations:
        f = failed.get(m.endpoint)
        deaths.append(
            {
                "endpoint": m.endpoint,
                "rank": None if f is None else f.rank,
                "exitcode": None if f is None else f.exitcode,
                "hung": None if f is None else f.hung,  # killed by its supervisor: silent past fault.hung_after_s
                "died_s": None if f is None else clock(f.seen_at),  # its supervisor saw the child end
                "seen_s": m.seen,  # the router saw its group's generation move on
                "rejoined_s": m.rejoined,
                "first_migrated_token_s": _first_token(entries, set(m.resumed), m.seen, clock),
                "resumed": m.resumed,
                "restarted": m.restarted,
                "completed": m.completed,
                "reprefilled_tokens": m.reprefilled_tokens,
                "adopted_by": m.adopted_by,
                "tokens_so_far": m.tokens,
                # migrate=kv: (request id, output tokens whose KV came from the mirror, positions computed again)
                "adopted": _adopted(router, m, adoptions),
                **_outage(router, m, entries),
            }
        )
    entries = router.topology.entries if router.topology.takers else ()
    return {
        "migrate": router.migrate,
        "deaths": deaths,
        # DejaVu: prefilled requests adopted with their prompt group's KV by a token group
        # (source, request id, output tokens whose KV came, positions computed again); the others were prefilled again
        "hand_offs": [a[:4] for a in adoptions if Endpoint(a[0]).group in entries],
        "ready_s": ready,
        "served_by": {rid: eps for rid, eps in sorted(router.book.routed.items())},
        "observed": [list(o) for o in router.observed],  # ("died" | "ready", endpoint), as the router saw them
        "weights_digest": digests,  # rank -> generation -> digest
        "journal_steps": {e: len(t) for e, t in journals.items()},
    }

"""``generate`` with supervised ranks (``fault.migrate``): failures stay in their engine group.

Every torchrun worker supervises its rank's engine, run as a child process
(:class:`reshard.parallel.fault.supervisor.Supervisor`); rank 0's supervisor also runs the router
(:class:`reshard.parallel.engine.router.Router`), which outlives every engine. An engine
that dies is respawned in the job, in its group's next generation, with a process group of its
own; the other groups keep serving, and the dead one's requests go on elsewhere (or wait for it).
torchrun's whole-job restart stays the fallback for a lost supervisor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from reshard.mesh import end_groups
from reshard.parallel.engine.admission import Endpoint
from reshard.parallel.engine.channel import Channel, GroupLayout, Topology
from reshard.parallel.engine.inbox import publish_tokens
from reshard.parallel.engine.request import Completion, EngineStats
from reshard.parallel.engine.router import Router
from reshard.parallel.fault.donor import WeightDonor, take_weights
from reshard.parallel.fault.fork_server import frozen_preload
from reshard.parallel.fault.host import MirrorHost, spec_key
from reshard.parallel.fault.journal import GroupJournal, silent_for
from reshard.parallel.fault.mirror import KVMirror, Peers, mirror_engine
from reshard.parallel.fault.restart import job_store, restart_count
from reshard.parallel.fault.supervisor import ChildSpec, Supervisor, group_store_prefix
from reshard.parallel.model.checkpoint import config_value
from reshard.parallel.model.parallelize import load_checkpoint
from reshard.recipes.config import GenerateConfig
from reshard.recipes.exits import RANKS_LOG
from reshard.recipes.fault_report import fault_summary
from reshard.recipes.launch import collective_timeout

CHANNEL = "supervised"
WARM = ("reshard.recipes.supervised", "reshard.parallel.strategies.tp", "transformers")  # a spare's imports


def run_supervised(cfg: GenerateConfig, run_dir: Path, path: Path, site=None) -> dict:
    """Supervise this rank's engine until the router has every completion; rank 0 writes the
    outputs. Returns the summary (rank 0; ``{}`` elsewhere). ``site``: ``reshard serve``'s
    (:class:`reshard.recipes.serve.Site`): the router takes the HTTP server's requests, until a
    drain, and writes no outputs."""
    from reshard.recipes.prompts import build_requests

    world, rank = dist.get_world_size(), dist.get_rank()
    index, members, topology = engine_group_of(cfg, world, rank)
    store = _supervision_store()
    channel = Channel(CHANNEL, store=store)
    router = None
    t0 = time.time()
    if rank == 0:
        if restart_count() == 0:  # the supervisors append their events and their children's last words
            (run_dir / "supervision.jsonl").unlink(missing_ok=True)
            (run_dir / RANKS_LOG).unlink(missing_ok=True)
        channel.put("start", time.time())
        own = _supervision_store()  # the router's thread has a store client of its own
        generation = lambda g: int(own.get(f"gen/{g}"))  # noqa: E731
        routed = Channel(CHANNEL, store=own)
        kept, keep = _kept_finished(run_dir, cfg.generation.n)
        die_after = cfg.fault.kill_router_after if restart_count() == 0 else None
        # one group of every rank (Seesaw, SiDP, Shift) takes each request as it arrives: its
        # policy need not report room
        routing = cfg.engine.routing if topology.groups > 1 else "round_robin"
        if site is None:
            requests = build_requests(cfg, path, _vocab_size(path))
            router = Router(
                routed, requests, topology, t0, routing, cfg.fault.migrate, generation,
                kept=kept, keep=keep, die_after=die_after,
            )  # fmt: skip
        else:
            from reshard.recipes.serve import serving

            router = serving(site, routed, topology, routing, migrate=cfg.fault.migrate, generation=generation)
    supervisor = Supervisor(
        store,
        rank,
        index,
        members,
        serve_child,
        (cfg, str(path), channel.get("start"), site is not None),
        max_respawns=cfg.fault.max_respawns,
        warm_spare=cfg.fault.warm_spare,
        ready=lambda spec: channel.ready(f"ready/{spec.endpoint}"),
        warm=(*WARM, *_model_modules(path)),
        log=_event_log(run_dir / "supervision.jsonl"),
        done=lambda: channel.ready("all_done"),
        silent=lambda spec: silent_for(channel, spec.endpoint),
        hung_after=cfg.fault.hung_after_s,  # the group's leader beats twice a heartbeat period
        recovered_log=run_dir / RANKS_LOG,  # the tracebacks of children the job goes on without
    )
    host = _host(topology, members, rank)
    dist.barrier()  # every supervisor set its group's generation (and hosts announced) before the router reads it
    with router or contextlib.nullcontext() as router, host or contextlib.nullcontext():
        supervisor.run(stop_on=(signal.SIGINT,) if site is not None else (signal.SIGINT, signal.SIGTERM))
    dist.barrier()  # every child is done: its statistics are in the store
    if rank != 0 or site is not None:
        return {}
    return _finish(cfg, run_dir, path, router, channel, store, time.time() - t0, topology.groups)


def _host(topology: Topology, members: tuple[int, ...], rank: int) -> MirrorHost | None:
    """The mirror this rank's supervisor keeps of its ring predecessor's KV in a hosted topology
    (a lockstep group under ``fault.migrate=kv``), announced ready in the store."""
    if not topology.hosted:
        return None
    # torch's own variable: a link's two ends must agree on lazy gloo, and the children's are lazy
    # (see _init_group); this supervisor's own groups are built already
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    position, me = (members.index(rank) - 1) % len(members), f"{topology.host}.0"
    store = _supervision_store()
    store.set(f"gen/{topology.host}", "0")
    channel = Channel(CHANNEL, store=store)
    host = MirrorHost(_supervision_store, CHANNEL, me, 0, position, lambda st, g: _live_endpoint(st, g, position))
    channel.put(f"ready/{me}/{position}", time.time())
    channel.put(f"ready/{me}", time.time())
    return host


def _kept_finished(run_dir: Path, n: int) -> tuple[list[Completion], Callable[[Completion], None]]:
    """What an earlier attempt of this job finished (``run_dir/finished.jsonl``, kept when the
    router's process was lost and torchrun restarted the job), and the function that appends
    each new completion there (a lost router loses none of them)."""
    from reshard.recipes.launch import FINISHED
    from reshard.recipes.report import OutputFormat, append_finished

    path = run_dir / FINISHED
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = path.read_text().splitlines() if restart_count() > 0 and path.exists() else []
    fields = ("id", "prompt_ids", "output_ids", "finish_reason")  # a line's text and sample keys are derived
    kept = [Completion(**{k: v for k, v in json.loads(line).items() if k in fields}) for line in lines]
    path.write_text("")
    fmt = OutputFormat(n=n)
    append_finished(path, kept, fmt)
    return kept, lambda c: append_finished(path, [c], fmt)


def engine_group_of(cfg: GenerateConfig, world: int, rank: int) -> tuple[int, tuple[int, ...], Topology]:
    """This rank's engine group under ``fault.migrate``: its index, its ranks and the job's
    :class:`Topology` (the strategy's :meth:`Strategy.supervised_layout`; ``ValueError`` for a
    layout supervision does not take)."""
    size, topology = cfg.parallel.supervised_layout(world, cfg.fault.migrate)
    index = rank // size
    return index, tuple(range(index * size, (index + 1) * size)), topology


def serve_child(spec: ChildSpec, cfg: GenerateConfig, path: str, start: float, streams: bool = False) -> None:
    """One engine child: its group's own process group (this generation's), the engine (its
    weights from a live replica when one serves, else the checkpoint), the journal, then serve
    what the router hands this generation of the group. ``streams`` (a server's job): the
    leader publishes each step's tokens, before the journal records them (a stream never
    misses a token the journal resumes after)."""
    from reshard.recipes.prompts import output_tokenizer, stop_tokenizer

    store = job_store(restart_count())
    _init_group(spec, store)
    world = int(os.environ["WORLD_SIZE"])
    topology = engine_group_of(cfg, world, spec.rank)[2]
    engine, source = _build_engine(cfg, spec, path, topology)
    engine.tokenizer = stop_tokenizer(cfg, Path(path)) or output_tokenizer(Path(path))  # (its EOS ends requests too)
    group = engine.engine_group or GroupLayout(0, 1, spec.members)  # a strategy's one group of every rank
    assert group.index == spec.group and group.ranks == spec.members, (group, spec)
    supervision = _supervision_store()  # a client of its own: the process group waits on `store`
    channel = Channel(CHANNEL, store=supervision)
    if streams and group.is_leader:
        publish_tokens(engine, functools.partial(channel.append, "tokens"))
    hang, beat_s = cfg.fault.inject == "hang", cfg.fault.heartbeat_s / 2
    journal = GroupJournal(
        engine, channel, spec, _kill_step(cfg, spec), leader=group.is_leader, hang=hang, beat_s=beat_s
    )
    report = (lambda a: channel.append("adoptions", (*a, spec.endpoint))) if group.is_leader else None
    mirror = _mirror(cfg, engine, spec, report, topology)
    position = spec.members.index(spec.rank)
    replicas = cfg.parallel.replica_groups  # this rank gives a respawned group its weights
    donor = WeightDonor(engine.runner.model, _supervision_store, spec.endpoint, position) if replicas else None
    channel.put(f"digest/{spec.rank}.{spec.generation}", weights_digest(engine))
    channel.put(f"weights_from/{spec.rank}.{spec.generation}", source)  # (where, seconds to build with them)
    channel.put(f"ready/{spec.endpoint}", time.time())
    channel.put(f"ready/{spec.endpoint}/{position}", time.time())  # this rank built, its donor answers
    if mirror is not None and topology.hosted:  # what this rank's host keeps
        channel.put(spec_key(spec.endpoint, position), (mirror.cache.spec, mirror.cache.layout))
    hands_off = spec.group in topology.entries and bool(topology.takers)  # a prompt group
    if mirror is not None:  # serve mirrored from the first step when the next group is up (a prompt group, or a
        starting = hands_off or topology.hosted  # hosted group: once it is; its host always is)
        mirror.wait_connected(starting=starting, done=lambda: channel.ready("all_done"))
    with engine:
        engine.serve_routed(channel, spec.endpoint, beat=journal.beat, layout=group, keep=not streams)
    channel.put(f"left/{spec.endpoint}", time.time())  # no mirror (or weight taker) waits for it any more
    for closing in (mirror, donor):
        if closing is not None:
            closing.close()
    if group.is_leader:
        channel.put(f"stats/{spec.endpoint}", engine.stats)
    end_groups()


def _build_engine(cfg: GenerateConfig, spec: ChildSpec, path: str, topology: Topology) -> tuple:
    """This child's engine and where its weights came from, with the seconds that took: a live
    replica's endpoint (a respawned group, while another group serves; ``fault.respawn_weights``),
    else ``"checkpoint"``."""
    from reshard.recipes.generate import _workload_shape

    config = cfg.engine_config()
    world, store = int(os.environ["WORLD_SIZE"]), _supervision_store()
    position = spec.members.index(spec.rank)
    others = (_live_endpoint(store, g, position) for g in range(topology.groups) if g != spec.group)
    live = [e for e in others if e]
    wanted = spec.generation > 0 and cfg.fault.respawn_weights == "replica" and cfg.parallel.replica_groups
    donor = live[0] if wanted and live else None
    t0 = time.perf_counter()
    strategy = cfg.parallel.group_strategy(path, world, _workload_shape(cfg))  # what builds this group's engine
    if donor is None:
        return strategy.build(path, config), ("checkpoint", time.perf_counter() - t0)
    engine = strategy.build(path, dataclasses.replace(config, load_weights=False))
    group = Endpoint(donor).group
    gone = lambda: _live_endpoint(store, group, position) != donor  # noqa: E731 - it died or finished
    if take_weights(engine.runner.model, _supervision_store, donor, spec.endpoint, position, gone):
        return engine, (donor, time.perf_counter() - t0)
    load_checkpoint(engine.runner.model, path, allow_unused=cfg.model.allow_unused_weights)
    return engine, ("checkpoint", time.perf_counter() - t0)


def _live_endpoint(store: dist.Store, g: int, position: int | None = None) -> str | None:
    """Group ``g``'s generation that is serving (ready, not yet left), if any; with ``position``,
    only once that rank of it is ready (built, its weight donor answering: a group is ready when
    its first rank is, and a respawned rank must not ask one that is itself still asking)."""
    endpoint, channel = f"{g}.{int(store.get(f'gen/{g}'))}", Channel(CHANNEL, store=store)
    ready = f"ready/{endpoint}" + ("" if position is None else f"/{position}")
    return endpoint if channel.ready(ready) and not channel.ready(f"left/{endpoint}") else None


def _mirror(cfg: GenerateConfig, engine, spec: ChildSpec, report, topology: Topology) -> KVMirror | None:
    """This rank's KV mirrors, where the topology has any for its group (``fault.migrate=kv``,
    and a disaggregated job's hand-offs): streamed to the rank of the same position of the
    successor group, the source groups' kept."""

    kv = cfg.fault.migrate == "kv"
    successor, sources = topology.successor(spec.group, kv), topology.sources(spec.group, kv)
    if successor is None and not sources:
        return None
    ends = (topology.host,) if topology.hosted else ()  # the supervisors' hosts end their replay
    peers = Peers(spec.group, spec.members.index(spec.rank), successor, sources, _live_endpoint, ends)
    hands_off = spec.group in topology.entries and topology.takers  # each prompt's KV leaves after its step
    every = 1 if hands_off else cfg.fault.replicate_every
    return mirror_engine(
        engine,
        _supervision_store,
        spec.endpoint,
        peers,
        every=every,
        group=engine.agreement_group(),
        report=report,
        handoff_wait_s=cfg.fault.handoff_wait_s,
    )


def _supervision_store() -> dist.Store:
    """A new client of the job's store, under the supervised keys' prefix (a client serves one
    thread: a wait in one blocks the others)."""
    return dist.PrefixStore("reshard/isolated", job_store(restart_count()))


def _init_group(spec: ChildSpec, store: dist.Store) -> None:
    """This child's default process group: the job's ranks under this generation's prefix, of
    which only the group's ever connect (gloo connects lazily, NCCL always does)."""
    # torch's own variable, set at this child's entry (serve_child's first call) for the whole
    # process: its default group, and any group over the job's ranks, holds ranks that are not
    # this generation's (they live in other children, under other prefixes) and eager gloo would
    # wait for them. No reshard setting reads it; links build their groups on their own threads.
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(group_store_prefix(spec), store),
        rank=spec.rank,
        world_size=world,
        timeout=collective_timeout(),
    )
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


def _kill_step(cfg: GenerateConfig, spec: ChildSpec) -> int | None:
    """``fault.kill_at``'s step for this child: the pairs naming a rank apply, in order, to its
    group's generations 0, 1, ..."""
    steps = [step for rank, step in cfg.fault.kills() if rank == spec.rank]
    return steps[spec.generation] if spec.generation < len(steps) else None


def weights_digest(engine) -> str:
    """SHA-256 over this rank's local shards of every parameter and buffer, in name order."""
    h = hashlib.sha256()
    model = engine.runner.model
    for name, t in sorted([*model.named_parameters(), *model.named_buffers()]):
        local = t.to_local() if hasattr(t, "to_local") else t
        h.update(name.encode())
        h.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _event_log(path: Path):
    """Appends each supervisor's events (a child started, ready, died) to ``path``, one JSON
    line each (lines this short are appended whole by every rank)."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def log(event: dict) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")

    return log


def _model_modules(path: Path) -> tuple[str, ...]:
    """The transformers modules the checkpoint's model class lives in (a spare imports them)."""
    return _family_modules(str(config_value(path, "model_type")))


def _family_modules(model_type: str) -> tuple[str, ...]:
    kind = model_type.replace("-", "_")
    return ("transformers.models.auto.modeling_auto", f"transformers.models.{kind}.modeling_{kind}")


def fork_server_preload(overrides: Sequence[str]) -> tuple[str, ...]:
    """What a supervised rank's fork server imports, forked before the job's config is composed
    (:func:`reshard.recipes.launch.init_distributed`): :data:`WARM` and the modules of the model
    the overrides name (a local checkpoint's ``config.json``; without ``model.path``, the built-in
    Llama). A guess: a child imports what it lacks itself."""
    given = dict(o.split("=", 1) for o in overrides if "=" in o)
    config = Path(given.get("model.path", "")).expanduser() / "config.json"
    model: tuple[str, ...] = ()
    if "model.path" not in given:
        model = _family_modules("llama")
    elif config.is_file():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            model = _family_modules(json.loads(config.read_text())["model_type"])
    return frozen_preload((*WARM, *model))


def _vocab_size(path: Path) -> int:
    return int(config_value(path, "vocab_size"))


def _finish(cfg, run_dir: Path, path: Path, router: Router, channel: Channel, store, seconds, groups) -> dict:
    """Rank 0: outputs in request order and the summary of a supervised run."""
    from reshard.recipes.launch import FINISHED
    from reshard.recipes.prompts import output_tokenizer
    from reshard.recipes.report import OutputFormat, write_outputs

    completions = [router.book.completions[rid] for rid in sorted(router.book.completions)]
    endpoints = [f"{g}.{k}" for g in range(groups) for k in range(int(store.get(f"gen/{g}")) + 1)]
    stats = EngineStats.total([channel.get(f"stats/{e}") for e in endpoints if channel.ready(f"stats/{e}")])
    summary = _summary(cfg, path, completions, stats, seconds, groups)
    digests, adoptions = _per_generation(cfg, channel, store, "digest"), channel.read_list("adoptions")
    summary["fault"] = fault_summary(router, channel, store, endpoints, digests, adoptions)
    summary["fault"]["kept_from_earlier_attempts"] = router.book.kept
    # rank -> generation -> [where its weights came from: "checkpoint" or a live replica's endpoint,
    # seconds its engine took to build with them]
    summary["fault"]["weights_from"] = _per_generation(cfg, channel, store, "weights_from")
    # (no strategy's own keys: its engines are the children's)
    fmt = OutputFormat(output_tokenizer(path), cfg.generation.n, cfg.generation.sampling_params())
    write_outputs(run_dir, completions, summary, None, fmt)
    (run_dir / FINISHED).unlink(missing_ok=True)  # outputs.jsonl holds them all
    return summary


def _summary(cfg, path: Path, completions, stats: EngineStats, seconds: float, groups: int) -> dict:
    """:func:`run_summary` of the engine groups' counters (phase times summed over the groups)."""
    from reshard.recipes.report import PhaseSeconds, run_summary

    phases = PhaseSeconds(0.0, stats.prefill_seconds, stats.decode_seconds, stats.mixed_seconds, 0.0, seconds)
    layouts = cfg.parallel.layouts(dist.get_world_size())
    compiled = cfg.engine_config().compile is True  # (supervised groups compile only when asked)
    kw = dict(stats=stats, seconds=phases, groups=groups, compiled=compiled)
    summary = run_summary(cfg, path, completions, layouts, **kw)
    return {**summary, "failures": restart_count()}  # whole-job restarts (torchrun's)


def _per_generation(cfg, channel: Channel, store, name: str) -> dict[int, dict[int, object]]:
    """``name/<rank>.<generation>`` of every rank, for each generation of its group that wrote it."""
    world, out = dist.get_world_size(), {}
    for rank in range(world):
        group = engine_group_of(cfg, world, rank)[0]
        keys = [(k, f"{name}/{rank}.{k}") for k in range(int(store.get(f"gen/{group}")) + 1)]
        out[rank] = {k: channel.get(key) for k, key in keys if channel.ready(key)}
    return out


__all__ = ["engine_group_of", "fork_server_preload", "run_supervised", "serve_child", "weights_digest"]

"""``Engine.generate`` over several engine groups: a router on the entry groups' first rank (on the
engine's router thread, one for its life) hands each group its requests; every rank gathers every
group's completions at the end."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence as Seq

import torch.distributed as dist
from tqdm import tqdm

from reshard.mesh import all_gather_objects
from reshard.parallel.engine.admission import RoutedAdmission, endpoint_of
from reshard.parallel.engine.channel import Channel, Topology
from reshard.parallel.engine.checks import check_posted_requests, seeded
from reshard.parallel.engine.core import EngineCore
from reshard.parallel.engine.request import Completion, Request
from reshard.parallel.engine.router import Router
from reshard.parallel.engine.sampling import fresh_seed


def generate_routed(engine, requests: Seq[Request], bar: tqdm, seed: int | None) -> list[Completion]:
    """This rank's group (``engine.engine_group``) serves what the router (on the job's first
    rank's router thread) hands it; then every rank gathers every group's completions and counters."""
    group = engine.engine_group
    channel = Channel(f"{group.channel}/call{engine.routed_calls}")  # every rank counts its calls alike
    engine.routed_calls += 1
    ranks = dist.get_process_group_ranks(group.job or dist.group.WORLD)
    first = dist.get_rank() == min(ranks)
    if first:  # the call's fresh seed (where it names none), then its start
        channel.put("seed", fresh_seed() if seed is None else seed)
        channel.put("start", time.time())
    channel.wait("start", f"engine group {group.index} waiting for the router's start time", engine.group_timeout)
    requests = seeded(requests, channel.get("seed"), None)
    check_posted_requests(requests, channel, ranks, engine.group_timeout)
    start = channel.get("start")
    router = None
    if first:  # the entries only: the other groups take what entries hand them
        entries = group.entry_groups
        topology = Topology(len(entries), entries)
        router = Router(channel, requests, topology, start, engine.config.routing, worker=engine.router_worker())
    with router or contextlib.nullcontext():
        admission = RoutedAdmission(channel, group, bar if dist.get_rank() == 0 else None, engine.group_timeout)
        done = EngineCore(engine, admission, start=start).run()
    mine = (group.index, list(done.values()) if group.is_leader else None, engine.stats)
    everyone = all_gather_objects(mine, group.job)  # (every rank's stats: some fields are its share)
    if router is not None:
        channel.clear(channel.job_keys([endpoint_of(g) for g in range(group.count)]))
    dist.barrier(group=group.job)  # no rank starts another call before the keys are gone
    engine.group_stats = [  # (a leader's, its per-rank fields summed over its group)
        stats.with_ranks([s for g, _, s in everyone if g == index])
        for index, done, stats in everyone
        if done is not None
    ]
    by_id = {c.id: c for _, completions, _ in everyone for c in completions or ()}
    return [by_id[r.id] for r in requests]

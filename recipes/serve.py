"""``reshard serve``: an OpenAI-compatible HTTP server over the job's engine groups.

    reshard serve --nproc 2 [--host 127.0.0.1] [--port 8000] [overrides]
    torchrun --standalone --nproc-per-node 2 -m reshard.recipes.serve [overrides]

The same config as ``generate`` (model, parallel, engine, fault) with a ``serve:`` section. Every
rank builds its engine group and serves what the router hands it (the router: a thread of rank
0's process; under ``fault.migrate``, of rank 0's supervisor, which outlives every engine). The
HTTP server runs in that same process (:mod:`reshard.parallel.serve`): each request enters the
router as it arrives. Rank 0 writes ``server.json`` (its pid, then the URL once it listens) into
the run directory. SIGTERM drains: new requests get 503, those accepted finish (up to
``serve.grace_s``, then they are cancelled), the groups end and the job exits 0.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch.distributed as dist

from reshard.background import Background
from reshard.parallel.engine.admission import endpoint_of
from reshard.parallel.engine.channel import Channel, GroupLayout, Topology
from reshard.parallel.engine.inbox import publish_tokens
from reshard.parallel.engine.request import Request
from reshard.parallel.engine.router import Router
from reshard.parallel.model.checkpoint import checkpoint_eos_ids, config_value, generation_defaults
from reshard.recipes.config import GenerateConfig
from reshard.recipes.launch import hydra_main

SERVER_FILE = "server.json"  # rank 0's pid and, once it listens, the server's URL
HTTP_PACKAGES = ("fastapi", "uvicorn")  # the HTTP side's imports (base dependencies in pyproject.toml)


@dataclass(frozen=True)
class Site:
    """What rank 0's server needs of the job: its config, checkpoint, run directory and the
    event SIGTERM sets (a drain)."""

    cfg: GenerateConfig
    path: Path
    run_dir: Path
    drain: threading.Event


def run_serve(cfg: GenerateConfig, run_dir: Path, drain: threading.Event) -> dict:
    """Serve until drained (SIGTERM); every rank returns ``{}``."""
    from reshard.recipes.generate import _model_path, _workload_shape, keep_compiled_code

    check_http_packages()  # every rank: a rank that cannot serve fails as its peers do
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg.fault.check_world(world)
    if rank == 0:
        announce(run_dir, url=None)
    path = _model_path(cfg)
    keep_compiled_code(cfg)
    site = Site(cfg, path, run_dir, drain)
    if cfg.fault.migrate is not None:  # supervised ranks: the server lives in rank 0's supervisor
        from reshard.recipes.supervised import run_supervised

        run_supervised(cfg, run_dir, path, site=site)
        return {}
    cfg = replace(cfg, parallel=cfg.parallel.planned(path, world, _workload_shape(cfg)))
    cfg.parallel.layouts(world)
    engine = cfg.parallel.build(path, cfg.engine_config())
    engine.tokenizer = tokenizer_of(path)
    group = engine.engine_group or GroupLayout(0, 1, tuple(range(world)))  # a lockstep strategy: one group
    channel = Channel(_call_name())
    if rank == 0:
        channel.put("start", time.time())
    topology = Topology(len(group.entry_groups), group.entry_groups)
    routing = cfg.engine.routing if topology.groups > 1 else "round_robin"  # (one group: each as it comes)
    with engine:
        check = lambda r: engine.validate([r])  # noqa: E731 - what the engine refuses, refused at the door
        server = serving(site, channel, topology, routing, check=check) if rank == 0 else contextlib.nullcontext()
        with server as router:
            if group.is_leader:  # each step's tokens to the front end: straight to it where it is this process's
                to_router = functools.partial(channel.append, "tokens")
                publish_tokens(engine, to_router if router is None else router.server.on_tokens)
            engine.serve_routed(channel, endpoint_of(group.index), layout=group, keep=False)
    return {}


def check_http_packages() -> None:
    """``ValueError`` (one line naming the pip command) unless FastAPI and uvicorn import here (an
    install from before they were base dependencies lacks them)."""
    missing = [name for name in HTTP_PACKAGES if not _imports(name)]
    if missing:
        raise ValueError(
            f"reshard serve needs {' and '.join(missing)}, which this Python cannot import: reinstall reshard "
            f"(`pip install -e .` in its repository) or run `pip install 'fastapi>=0.110' 'uvicorn>=0.29'`"
        )


def _imports(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def _call_name() -> str:
    """This call's keys in the job's store, rank 0's pick (a process that serves twice, or a store
    that outlives a job, keeps each call's keys apart)."""
    name = [f"serve/{uuid.uuid4().hex}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return name[0]


@contextlib.contextmanager
def serving(
    site: Site,
    channel: Channel,
    topology: Topology,
    routing: str,
    *,
    migrate: str = "none",
    generation: Callable[[int], int] | None = None,
    check: Callable[[Request], None] | None = None,
) -> Iterator[Router]:
    """Rank 0's router fed by the HTTP server, and the drain watcher, for the ``with`` block (the
    job's serving); ``channel`` holds the job's ``start``."""
    from reshard.parallel.serve import Front, HttpServer, Metrics, ServeLimits, Text, build_app
    from reshard.parallel.serve.protocol import Limits

    cfg, s = site.cfg, site.cfg.serve
    front = Front(ServeLimits(s.max_waiting, s.retry_after_s, s.grace_s), Metrics(), check=check)
    front.start = channel.get("start")
    router = Router(
        channel, [], topology, front.start, routing, migrate, generation,
        inbox=front.inbox, keep=front.complete, on_tokens=front.tokens,
    )  # fmt: skip
    tokenizer = tokenizer_of(site.path)
    name = s.model_name or site.path.name
    defaults = generation_defaults(site.path)  # (the checkpoint's sampling values, as vLLM's server takes them)
    limits = Limits(name, _max_seq_len(cfg, site.path), tokenizer_vocab(site.path), generation is None, defaults)
    eos = checkpoint_eos_ids(site.path) | {tokenizer.eos_token_id} - {None}  # (a stream holds a stop token's text back)
    app = build_app(front, limits, Text(tokenizer, eos), lambda: dict(router.server.loads))
    closing = threading.Event()
    with router, HttpServer(app, s.host, s.port) as http:
        url = f"http://{s.host}:{http.port}/v1"
        announce(site.run_dir, url)
        print(f"serving {name!r} at {url} ({dist.get_world_size()} ranks; SIGTERM drains)", flush=True)
        watcher = Background(lambda: _watch(site.drain, front, router, closing), "reshard-drain", "the drain")
        try:
            yield router
        finally:
            closing.set()
            cancelled = watcher.result()
    served = sum(front.metrics.finished.values())
    print(f"drained: {served} requests ended ({cancelled} cancelled at the grace period's end)", flush=True)


def _watch(drain: threading.Event, front, router: Router, closing: threading.Event) -> int:
    """Wait for SIGTERM (``drain``), then drain the front end; returns the requests it cancelled
    (0 when the job ends otherwise: ``closing``, or the router gone)."""
    while not drain.wait(0.1):
        if closing.is_set() or router.ended:
            return 0
    return front.drain(stopped=lambda: closing.is_set() or router.ended)


def announce(run_dir: Path, url: str | None) -> None:
    """``run_dir/server.json``: this process's pid (the launcher forwards SIGTERM to it) and the URL."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{SERVER_FILE}.tmp"
    tmp.write_text(json.dumps({"pid": os.getpid(), "url": url}))
    tmp.replace(run_dir / SERVER_FILE)


def tokenizer_of(path: Path):
    """The checkpoint's tokenizer (``ValueError`` naming the checkpoint when it has none)."""
    from reshard.recipes.prompts import output_tokenizer

    tokenizer = output_tokenizer(path)
    if tokenizer is None:
        raise ValueError(f"reshard serve takes and returns text: the checkpoint {path} has no tokenizer")
    return tokenizer


def tokenizer_vocab(path: Path) -> int:
    return int(config_value(path, "vocab_size"))


def _max_seq_len(cfg: GenerateConfig, path: Path) -> int:
    """The context a request must fit in: ``engine.max_seq_len``, else the model's."""
    return cfg.engine.max_seq_len or int(config_value(path, "max_position_embeddings"))


def main() -> None:
    hydra_main("serve", run_serve, drains=True)


if __name__ == "__main__":
    main()

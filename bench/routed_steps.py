"""A routed group's step: the leader in the router's process counting the router's posts there
(``Channel.posted_here``, the default) against looking at the store each step for new requests
(the path before, and still that of a leader in another process), side by side in one job.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/routed_steps.py \
        [--requests 32] [--new-tokens 64] [--repeats 6]

Every rank is a data-parallel engine group of the tiny Llama (hidden 64, 2 layers); the router
runs on rank 0, whose group counts its posts in process, while rank 1's looks at the store each
step either way. Each repeat runs ``Engine.generate`` of the same ``--requests`` greedy requests
(``--new-tokens`` each, EOS ignored) once with the store look (the router not registering its
groups) and once without, interleaved; wall-time medians, rank 0's clock; tokens checked equal.
Also printed: one store look's round trip on this machine. Run it in a session of its own.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_sizes, fill_sizes, med, parser, rerun_command

DEFAULTS = {"requests": 32, "new_tokens": 64, "repeats": 6}
SMALL = {"requests": 8, "new_tokens": 8, "repeats": 1}


def store_look_us(channel, looks: int = 2000) -> float:
    """Microseconds of one ``Channel.ready`` on a key that is not set (a step's look)."""
    t0 = time.perf_counter()
    for _ in range(looks):
        channel.ready("no-such-key")
    return (time.perf_counter() - t0) / looks * 1e6


def timed(engine, requests, local: bool) -> tuple[float, list]:
    """Seconds of one ``generate`` (ranks start together) and its tokens; ``local=False``: the
    router registers no group, so every leader looks at the store each step."""
    import torch.distributed as dist

    from reshard.parallel.engine.channel import Channel

    register = Channel.posts_only_here
    Channel.posts_only_here = register if local else (lambda self, groups: None)
    try:
        dist.barrier()
        t0 = time.perf_counter()
        out = engine.generate(requests)
        return time.perf_counter() - t0, [c.output_ids for c in out]
    finally:
        Channel.posts_only_here = register


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    add_sizes(p, DEFAULTS, SMALL)
    args = fill_sizes(p.parse_args(argv), DEFAULTS, SMALL)
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims, Request, SamplingParams, parallelize
    from reshard.parallel.engine.channel import Channel
    from reshard.parallel.model.tiny_models import make_tiny_checkpoint

    dist.init_process_group("gloo")
    path = [str(Path(tempfile.mkdtemp(prefix="routed-steps-")) / "tiny") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    if dist.get_rank() == 0:
        make_tiny_checkpoint("llama", path[0])
    dist.barrier()
    engine = Engine(parallelize(path[0], ParallelDims.from_world(dp=dist.get_world_size())), EngineConfig())
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    requests = [Request(i, torch.randint(3, 200, (16,), generator=gen).tolist(), params) for i in range(args.requests)]

    for local in (True, False):  # warm-up
        timed(engine, requests, local)
    times: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list] = {}
    for _ in range(args.repeats):
        for local in (False, True):
            seconds, tokens[local] = timed(engine, requests, local)
            times[local].append(seconds)
    assert tokens[True] == tokens[False], "the two paths gave different tokens"
    if dist.get_rank() == 0:
        look = store_look_us(Channel("routed-steps-look"))
        store, here = med(times[False]), med(times[True])
        print(f"# {rerun_command('routed_steps.py', dist.get_world_size(), argv=argv)}")
        print(f"store look each step {store:.3f} s, counted in process {here:.3f} s: {here / store:.3f}x")
        print(f"runs (s): store {[round(t, 3) for t in times[False]]}, in process {[round(t, 3) for t in times[True]]}")
        print(f"one store look: {look:.0f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Per call: the layers' collectives in eager inference (c10d's own, in place) against the
functional collectives they used before (which trace under torch.compile, where they remain).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/collectives.py [--rows 1,8,64] [--calls 500]

Each rank holds a ``(rows, 256)`` fp32 tensor of a TP layer's partial output; for each size, the
row-parallel all-reduce (``reshard.layers._comm.all_reduce``) and the gather of a gathered
column-parallel output (``all_gather_last``), each timed against the functional call it replaced
(the same functions with the functional collectives, as under compile), interleaved,
``--repeats`` rounds of ``--calls`` calls after a warm-up, medians, rank 0's clock. Outputs are
checked equal. Run it in a session of its own on a quiet machine.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_sizes, fill_sizes, med, parser, rerun_command

DEFAULTS = {"rows": [1, 8, 64], "calls": 500, "repeats": 3}
WIDTH = 256


def _per_call(fn: Callable[[], torch.Tensor], calls: int, functional: bool = False) -> float:
    """Microseconds per call of ``fn``, every rank starting together; ``functional``: with the
    layers' collectives the functional ones (as before, and as under torch.compile)."""
    from reshard.layers import _comm

    dist.barrier()
    with mock.patch.object(_comm, "_eager", lambda x: False) if functional else contextlib.nullcontext():
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls * 1e6


def pairs(mesh, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """Each collective of the layers, on ``x`` (the all-reduce sums a copy: it writes in place)."""
    from reshard.layers._comm import all_gather_last, all_reduce

    width = WIDTH * mesh.size(0)
    return {
        "all-reduce": lambda: all_reduce(x.clone(), mesh, 0),
        "gather last dim": lambda: all_gather_last(x, mesh, width, 0),
    }


def _functional_once(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    from reshard.layers import _comm

    with mock.patch.object(_comm, "_eager", lambda x: False):
        return fn()


def main() -> None:
    p = parser(__doc__)
    add_sizes(p, DEFAULTS)
    args = fill_sizes(p.parse_args(), DEFAULTS)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(dist.get_rank())
    lines = [f"{'collective':16s} {'rows':>5s} {'ours us':>9s} {'functional us':>14s} {'functional/ours':>16s}"]
    for rows in args.rows:
        x = torch.randn(rows, WIDTH)
        for name, fn in pairs(mesh, x).items():
            assert torch.equal(fn(), _functional_once(fn)), name
            _per_call(fn, 20), _per_call(fn, 20, functional=True)
            times = [(_per_call(fn, args.calls), _per_call(fn, args.calls, True)) for _ in range(args.repeats)]
            a, b = med([t[0] for t in times]), med([t[1] for t in times])
            lines.append(f"{name:16s} {rows:5d} {a:9.0f} {b:14.0f} {b / a:16.2f}")
    if dist.get_rank() == 0:
        print("\n".join(lines))
        print(f"\ncommand: {rerun_command('collectives.py', dist.get_world_size())}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

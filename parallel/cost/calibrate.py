"""``this_machine``: a :class:`parallel.profiles.Hardware` measured here, so that the cost model's
predictions can be checked against our own benches (``bench/seesaw.py``, ``bench/shift.py``).

A short sweep (~5-10 s): one torch thread per process, as the benches run each rank,

- GEMM FLOP/s: ``F.linear`` of a (256, 1024) x (1024, 1024) fp32 product;
- memory bandwidth: a GEMV over a 64 MiB fp32 weight (a decode step's access pattern);
- gloo with 2 processes: ``all_reduce``, ``all_to_all_single`` and ``send``/``recv`` at a small and
  a large size; latency and bandwidth fitted to the same formulas :mod:`parallel.cost` uses.

The result is cached as JSON in ``<reshard cache>/calibration/this_machine.json`` (keyed by the
torch version and CPU count); ``this_machine(refresh=True)`` measures again.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from reshard.parallel.cost.profiles import Hardware

# The 2 gloo processes load this file alone (no package import: ~1.5 s instead of ~4 s, and no
# unguarded __main__ re-run as with multiprocessing's spawn), so module level imports only torch.
_CHILD = (
    "import importlib.util as u, sys; s = u.spec_from_file_location('reshard_calibrate', sys.argv[1]); "
    "m = u.module_from_spec(s); s.loader.exec_module(m); m._collective_main(*map(int, sys.argv[2:]))"
)

SMALL, LARGE = 8, 4 << 20  # bytes of the two message sizes each collective is timed at
CACHE_NAME = "this_machine.json"


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_flops(m: int = 256, k: int = 1024, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of an fp32 ``F.linear`` (``2 m k n`` FLOPs) on this process's threads."""
    x, w = torch.randn(m, k), torch.randn(n, k)
    with torch.inference_mode():
        return 2 * m * k * n / _median_seconds(lambda: F.linear(x, w), repeats)


def measure_mem_bw(rows: int = 8192, cols: int = 2048, repeats: int = 5) -> float:
    """Bytes/s of a GEMV over a ``rows x cols`` fp32 weight (weight bytes / seconds)."""
    x, w = torch.randn(1, cols), torch.randn(rows, cols)
    with torch.inference_mode():
        return w.numel() * 4 / _median_seconds(lambda: F.linear(x, w), repeats)


def _fit(t_small: float, t_large: float, data_large: float, hops: int) -> tuple[float, float]:
    """``(latency per hop, bandwidth)`` from ``t = hops * lat + data / bw`` at two sizes."""
    bw = data_large / max(t_large - t_small, 1e-9)
    return max(t_small, 1e-9) / hops, bw


def _collective_main(rank: int, port: int, repeats: int) -> None:
    """One of the 2 calibration processes; rank 0 prints the timings as JSON."""
    import torch.distributed as dist

    from reshard.mesh import end_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = {
        kind: [_time_collective(kind, n, rank, repeats) for n in (SMALL, LARGE)]
        for kind in ("all_reduce", "all_to_all", "send")
    }
    end_groups()
    if rank == 0:
        print(json.dumps(out), flush=True)


def _time_collective(kind: str, nbytes: int, rank: int, repeats: int) -> float:
    """Seconds of one ``kind`` of ``nbytes`` (fp32) per rank between the 2 processes: the best of
    3 trials of ``repeats`` back-to-back calls (send: half a ping-pong)."""
    import torch.distributed as dist

    buf, out = torch.ones(max(nbytes // 4, 2)), torch.empty(max(nbytes // 4, 2))

    def once() -> None:
        if kind == "all_reduce":
            dist.all_reduce(buf)
        elif kind == "all_to_all":
            dist.all_to_all_single(out, buf)
        elif rank == 0:
            dist.send(buf, 1)
            dist.recv(out, 1)
        else:
            dist.recv(out, 0)
            dist.send(buf, 0)

    once()  # warm-up
    best = math.inf
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(repeats):
            once()
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best / 2 if kind == "send" else best


def measure_collectives(repeats: int = 7, timeout: float = 60.0) -> dict[str, tuple[float, float]]:
    """``{kind: (latency s, bandwidth B/s)}`` for gloo between 2 spawned processes on this host,
    fitted to :mod:`parallel.cost`'s formulas at ``n = 2``: all-reduce ``bytes/bw + 2 lat``,
    all-to-all ``bytes/2/bw + lat``, send ``bytes/bw + lat``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, __file__, str(r), str(port), str(repeats)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"calibration processes failed: {[o[1][-500:] for o in outs]}")
    raw = json.loads(outs[0][0].strip().splitlines()[-1])
    data = {"all_reduce": (LARGE, 2), "all_to_all": (LARGE / 2, 1), "send": (LARGE, 1)}
    return {k: _fit(raw[k][0], raw[k][1], data[k][0], data[k][1]) for k in data}


def calibrate(*, repeats: int = 7, report: Callable[[str], None] = lambda line: None) -> Hardware:
    """Measure this machine now (one torch thread per process); about 5-10 s. ``report`` gets a
    line per measurement as it finishes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        flops, mem_bw = measure_flops(), measure_mem_bw()
    finally:
        torch.set_num_threads(threads)
    report(f"  compute {flops / 1e9:.1f} GFLOP/s, memory {mem_bw / 1e9:.1f} GB/s (one thread)")
    comm = measure_collectives(repeats)
    lat, bw = comm["all_reduce"]
    report(f"  collectives over gloo between 2 processes: all-reduce {lat * 1e6:.0f} us + {bw / 1e9:.2f} GB/s")
    from reshard.parallel.cost.profiles import Hardware

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    lat, bw = comm["send"]
    return Hardware(
        name="this_machine",
        memory=float(ram),
        mem_bw=mem_bw,
        flops=flops,
        link="gloo",
        link_bw=bw,
        link_latency=lat,
        collectives=comm,
    )


def cache_path(cache_dir: str | os.PathLike | None = None) -> Path:
    from reshard.parallel.model.tiny_models import default_cache_dir

    return Path(cache_dir or default_cache_dir()) / "calibration" / CACHE_NAME


def _key() -> str:
    return f"torch {torch.__version__}, {os.cpu_count()} cpus"


def this_machine(
    *,
    refresh: bool = False,
    cache_dir: str | os.PathLike | None = None,
    report: Callable[[str], None] = lambda line: None,
) -> Hardware:
    """The calibrated profile, from the cache when it was measured with this torch and CPU count
    (``report``: a line saying which, and one per measurement while calibrating)."""
    path = cache_path(cache_dir)
    if not refresh and path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("key") == _key():
            report(f"this_machine: the calibration cached in {path} ({_key()})")
            return from_json(saved["hardware"])
    report(f"this_machine: calibrating (once for {_key()}, about 10 s; cached in {path})")
    hw = calibrate(report=report)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": _key(), "hardware": to_json(hw)}, indent=2) + "\n")
    return hw


def to_json(hw: Hardware) -> dict:
    return {
        "name": hw.name,
        "memory": hw.memory,
        "mem_bw": hw.mem_bw,
        "flops": hw.flops,
        "link": hw.link,
        "link_bw": hw.link_bw,
        "link_latency": hw.link_latency,
        "collectives": {k: list(v) for k, v in hw.collectives.items()},
    }


def from_json(d: dict) -> Hardware:
    from reshard.parallel.cost.profiles import Hardware

    values = [d[k] for k in ("memory", "mem_bw", "flops", "link_bw", "link_latency")]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"calibration file holds non-positive or non-finite numbers: {d}")
    return Hardware(
        name=d["name"],
        memory=d["memory"],
        mem_bw=d["mem_bw"],
        flops=d["flops"],
        link=d["link"],
        link_bw=d["link_bw"],
        link_latency=d["link_latency"],
        collectives={k: tuple(v) for k, v in d.get("collectives", {}).items()},
    )


def oversubscribed(hw: Hardware, *, ranks: int, cores: int) -> Hardware:
    """``hw`` as each of ``ranks`` single-threaded processes sees it on ``cores`` cores: compute and
    memory bandwidth shared (``cores / ranks`` each when ranks exceed cores); links unchanged."""
    from reshard.parallel.cost.profiles import Hardware

    share = min(1.0, cores / ranks)
    return Hardware(
        name=f"{hw.name}/{ranks}on{cores}",
        memory=hw.memory / ranks,
        mem_bw=hw.mem_bw * share,
        flops=hw.flops * share,
        link=hw.link,
        link_bw=hw.link_bw,
        link_latency=hw.link_latency,
        collectives=hw.collectives,
    )

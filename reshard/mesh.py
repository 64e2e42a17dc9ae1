"""Device meshes and process groups, created once per default process group: the one cache of the
project's meshes and groups (foreground collectives and every background thread's group); and the
small object exchanges after which every rank may raise (nothing left in the backend's threads)."""

from __future__ import annotations

import datetime
import pickle
import time
import weakref
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

T = TypeVar("T")


def device_type() -> str:
    """``cuda`` when the default process group runs NCCL, else ``cpu`` (never hard-coded)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return "cuda"
    return "cpu"


def rank_tensor(ranks) -> torch.Tensor:
    """``ranks`` (nested lists, tuples or a ``range``) as a rank grid: a host tensor, whatever the
    backend. Rank grids are metadata: ``DeviceMesh`` keeps its ranks on the CPU (it moves a device
    tensor there), and the index math on layouts reads them back as Python ints."""
    return torch.tensor(ranks, device="cpu")


_MESHES: dict = {}  # "world": the default process group they belong to; key -> DeviceMesh or group


def _cache() -> dict:
    """The meshes and groups of the current default process group (a new one: the old are dead)."""
    world = dist.group.WORLD if dist.is_initialized() else None
    if _MESHES.get("world") is not world:
        _MESHES.clear()
        _MESHES["world"] = world
    return _MESHES


def cached_mesh(grid: torch.Tensor, names: tuple[str, ...]) -> DeviceMesh:
    """``DeviceMesh(grid, names)``, created once per process group.

    Every DeviceMesh creates a process group per axis, and gloo keeps threads per group; engines
    rebuilt in a loop (tests, benchmarks, an RL loop re-parallelizing a model) would otherwise
    pile up thousands of threads. Collective on first use, like ``DeviceMesh`` itself: every rank
    must ask for the same meshes in the same order, including meshes it is not part of.
    """
    cache = _cache()
    key = (device_type(), tuple(grid.flatten().tolist()), tuple(grid.shape), names)
    if key not in cache:
        cache[key] = DeviceMesh(device_type(), grid, mesh_dim_names=names)
    return cache[key]


def cached_group(
    ranks: Iterable[int] | torch.Tensor | None = None, *, purpose: str = "collectives"
) -> dist.ProcessGroup:
    """The process group of ``purpose`` over ``ranks`` (default: every rank of the job), created
    once per default group with the job's collective timeout (:func:`job_timeout`).

    A thread that communicates in the background needs a group no other thread uses (gloo and
    NCCL order a group's operations per group): each background job names its own ``purpose``
    (``"kv-transport"``, ``"sidp-fetch"``, ...); foreground collectives share the default one.
    Collective on first use: every rank of the job asks for the same groups in the same order,
    including groups it is not part of.
    """
    if isinstance(ranks, torch.Tensor):
        ranks = ranks.flatten().tolist()
    members = tuple(sorted(range(dist.get_world_size()) if ranks is None else ranks))
    cache = _cache()
    key = ("group", purpose, members)
    if key not in cache:
        cache[key] = dist.new_group(list(members), timeout=job_timeout())
    return cache[key]


def job_timeout() -> datetime.timedelta | None:
    """How long a collective of the default process group may wait (``init_process_group``'s
    ``timeout``); ``None`` where the backend does not say (torch's default then applies)."""
    try:
        return dist.group.WORLD._get_backend(torch.device(device_type())).options._timeout
    except (AttributeError, RuntimeError):
        return None


def collective_exit_wait() -> float:
    """How long an exit waits for a background thread inside a collective: the job's collective
    timeout (a collective stuck on a peer that never answers fails by then; torch's default where
    the backend does not say), and a minute more."""
    from torch.distributed.constants import default_pg_timeout

    return (job_timeout() or default_pg_timeout).total_seconds() + 60.0


def from_rank0(fn: Callable[[], T]) -> T:
    """``fn()`` computed on rank 0 alone and sent to every rank (collective over the job); an
    exception it raises is raised on every rank."""
    box: tuple = (None, None)
    if dist.get_rank() == 0:
        try:
            box = (fn(), None)
        except Exception as e:  # every rank must leave the exchange, then raise
            box = (None, e)
    value, error = all_gather_objects(box if dist.get_rank() == 0 else None)[0]
    if error is not None:
        raise error
    return value


# ---- exchanges that leave nothing behind in the backend --------------------------------------------
RELEASE_TIMEOUT_S = 2.0  # the longest a collective's tensors are waited for (gloo: under a millisecond)


def let_go(exchanged: list[torch.Tensor], *, timeout: float = RELEASE_TIMEOUT_S) -> None:
    """Return once the process group's threads have dropped ``exchanged``: the tensors a finished
    collective used, whose only Python references the caller hands over (the list is emptied).

    ``wait()`` returns before the backend's thread (gloo's worker) drops its hold on a
    collective's tensors, and dropping a tensor Python created takes the GIL. If the
    interpreter is already finalizing by then (an error that every rank raises right after an
    exchange ends the script at once), that thread is ended inside a C++ destructor and the
    process aborts after printing the error: ``terminate called without an active exception``,
    SIGABRT. Sleeping here releases the GIL so the thread can finish; weak references show when
    it has (``timeout`` bounds the wait).
    """
    refs = [weakref.ref(t) for t in exchanged]
    exchanged.clear()
    deadline = time.monotonic() + timeout
    while any(r() is not None for r in refs) and time.monotonic() < deadline:
        time.sleep(1e-4)


BACKEND_GRACE_S = 0.1  # asleep before the groups go: a backend thread's last drop takes the GIL


def end_groups() -> None:
    """Destroy every process group once the backend's threads could drop what they hold.

    A backend thread that has just finished a collective drops the collective's tensors after
    ``wait()`` returned, and that drop takes the GIL (:func:`let_go`). ``destroy_process_group``
    does not join the threads while anything still references a group (an engine, a mesh), so
    a script that ends right after its last collective can finalize the interpreter first: the
    thread is ended inside a C++ destructor and the process aborts (``terminate called without
    an active exception``). Measured here, two ranks exiting right after an all-reduce with a
    group still referenced: 12 of 25 runs aborted, none of 25 after 20 ms asleep first. Every
    caller that ends the job's groups ends them here.
    """
    time.sleep(BACKEND_GRACE_S)  # (the GIL released: threads waiting for it finish)
    dist.destroy_process_group()


def all_gather_objects(obj: object, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's ``obj`` (small, picklable) in ``group``'s rank order, as
    ``dist.all_gather_object`` gives them, returned once the backend let go of the exchanged
    tensors (:func:`let_go`): an error every rank raises on the result ends the process cleanly."""
    exchanged: list[torch.Tensor] = []
    objects = _all_gather_pickles(pickle.dumps(obj), group, exchanged)
    let_go(exchanged)
    return [pickle.loads(data) for data in objects]


def all_gather_checked(obj: object, error: str | None, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's ``obj`` (:func:`all_gather_objects`), once every rank's check is known: a
    check only some ranks can make (``error``: this rank's one-line message, ``None`` if it found
    nothing) becomes the same one-line ``ValueError`` on every rank, each message once with the
    ranks that gave it, so no rank raises while the others wait in a collective."""
    everyone = all_gather_objects((error, obj if error is None else None), group)
    failed: dict[str, list[int]] = {}
    for rank, (message, _) in zip(group_ranks(group), everyone):
        if message is not None:
            failed.setdefault(message, []).append(rank)
    if failed:
        raise ValueError("; ".join(f"{m} ({_ranks(ranks)})" for m, ranks in list(failed.items())[:3]))
    return [o for _, o in everyone]


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def group_ranks(group: dist.ProcessGroup | None = None) -> list[int]:
    """The global ranks of ``group`` (default: the job's) in its rank order, the order of its
    all-gathers' results."""
    return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)


def _all_gather_pickles(data: bytes, group, exchanged: list[torch.Tensor]) -> list[bytes]:
    """Every rank's ``data``: two all-gathers (sizes, then the bytes padded to the longest); the
    tensors they used are appended to ``exchanged`` and referenced nowhere else."""
    device, world = device_type(), dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.long, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s) for s in sizes]
    mine = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    exchanged += [size, *sizes, mine, *gathered]
    return [bytes(g.cpu().numpy()[:n]) for g, n in zip(gathered, lengths)]


__all__ = [
    "all_gather_checked",
    "all_gather_objects",
    "cached_group",
    "cached_mesh",
    "device_type",
    "from_rank0",
    "group_ranks",
    "job_timeout",
    "let_go",
    "rank_tensor",
]

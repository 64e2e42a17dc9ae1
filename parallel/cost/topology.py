"""Where a machine's GPUs sit and where a layout puts its groups on them (:mod:`parallel.cost`).

A :class:`Level` is a block of GPUs that reach each other over one path; a machine lists its levels
innermost first (:attr:`parallel.cost.profiles.Hardware.topology`). A layout's ranks are the
runtime's ascending ``(dp, pp, sp, tp)`` grid (:func:`reshard.parallel.model.dims.rank_grid`): a tp
group is ``tp`` consecutive GPUs, an sp group strides ``tp`` and spans ``sp * tp``, a replica's
stages span ``pp * sp * tp``. Each collective is costed at the level its group's block crosses
(:mod:`parallel.cost.collectives`), its slowest link.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reshard.parallel.cost.profiles import Hardware
    from reshard.parallel.cost.roofline import ParallelConfig

GB = 10**9  # decimal, as vendors and NCCL quote link bandwidth (profiles.GB; not imported: profiles imports this)
LINK_KINDS = ("pcie", "nvlink", "socket")
SOCKET_BW = 16 * GB  # NVIDIA/nccl src/graph/topo.h "#define AMD_BW 16.0": NCCL's GB/s between two AMD sockets


@dataclass(frozen=True)
class Level:
    """One level of a machine's topology: GPUs ``0..size-1``, ``size..2*size-1``, ... (aligned
    blocks of ``size``) reach each other through it. A group crosses every level up to the
    innermost whose block holds it, and pays the slowest ``bw`` (bytes/s per direction per GPU)
    and the largest ``latency`` (seconds per message) on that path. Each level holds its own link
    (a PCIe switch or root complex, the link between sockets, an NVLink domain)."""

    name: str
    size: int
    kind: str  # "pcie" | "nvlink" | "socket" (the link between CPU sockets): which efficiency factor scales it
    bw: float
    latency: float

    def __post_init__(self) -> None:
        if self.kind not in LINK_KINDS:
            raise ValueError(f"level {self.name!r}: kind must be one of {LINK_KINDS}, got {self.kind!r}")
        if not (self.size >= 1 and self.bw > 0 and self.latency >= 0):
            raise ValueError(
                f"level {self.name!r} needs size >= 1, bw > 0 and latency >= 0; got size {self.size}, "
                f"bw {self.bw}, latency {self.latency}"
            )


def crossed(levels: tuple[Level, ...], span: int, machine: str) -> tuple[Level, ...]:
    """The ``levels`` a group spanning ``span`` GPUs crosses, innermost first (``()`` without a
    topology); ``ValueError`` for a group larger than the machine (no network is modelled)."""
    if not levels:
        return ()
    if span > levels[-1].size:
        raise ValueError(
            f"{machine} holds {levels[-1].size} GPUs; a group of {span} spans machines, "
            "whose network the cost model does not have"
        )
    inner = next(i for i, lv in enumerate(levels) if lv.size >= span)
    return levels[: inner + 1]


def two_sockets(link_bw: float, link_latency: float) -> tuple[Level, ...]:
    """An 8-GPU PCIe machine of two CPU sockets, 4 GPUs on each socket's root complex, no
    peer-to-peer (AWS g5.48xlarge: aws/aws-ofi-nccl topology/g5.48xl-topo.xml puts GPUs 0-3 on
    NUMA node 0 and 4-7 on node 1, commit 5baeddcf "G5.48xlarge has two NUMA nodes"; traffic goes
    through host memory, NVIDIA/TensorRT-LLM#1034 "peer access is not supported"): GPUs of one
    socket talk at their own link, a group across the sockets through it and the socket link (the
    slower of the two), paying two root complexes' latency (assumed)."""
    return (
        Level("in-socket", 4, "pcie", link_bw, link_latency),
        Level("cross-socket", 8, "socket", SOCKET_BW, 2 * link_latency),
    )


def placement(cfg: ParallelConfig, hw: Hardware) -> dict:
    """Where ``cfg`` puts its groups on ``hw``: the GPUs of each tp group and, per kind of traffic
    (tp all-reduce, sp all-to-all, the sends between stages, a MoE layer's expert all-to-all), the
    outermost level it crosses (``"link"`` on a machine without a topology, ``None`` where the
    layout has no such traffic)."""
    levels = {}
    for axis, (degree, span) in cfg.spans.items():
        path = hw.path(span)
        levels[axis] = None if degree == 1 else (path[-1].name if path else "link")
    groups = [list(range(start, start + cfg.tp)) for start in range(0, cfg.gpus, cfg.tp)]
    return {"tp_groups": groups, "crosses": levels}

"""Published measurements the cost model is validated against, as data with their sources.

Each row names the paper, the figure or table, and the line of the paper's text in
``../shared/seeds`` it is read from. Only what the papers state is here; how the model's
prediction compares is ``bench/cost_vs_papers.py``'s business.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

SEESAW = "Seesaw (Su et al. 2025), ../shared/seeds/000_1b995ee7312ad9dc.txt"
SHIFT = "Shift Parallelism (Snowflake 2025), ../shared/seeds/001_204e28c7c271ee4f.txt"
DEJAVU = "DejaVu (Strati et al. 2024), ../shared/seeds/003_1c77894d1722ee85.txt"

# The kind of serving engine each paper measured on (parallel.cost.fit.ENGINES, which says what the
# kinds are): Seesaw ran its own engine (section 5.1) against vLLM 0.5.4 (line 967), Shift vLLM
# v0.9.2 (line 597), SiDP vLLM 0.10.1 (line 73). The papers name the versions; the kinds are ours.
SEESAW_ENGINE, SHIFT_ENGINE, SIDP_ENGINE = "sync", "async", "async"

# Seesaw's baseline runs vLLM 0.5.4 (section 6.1, line 967; Seesaw reuses vLLM's model implementation,
# line 970), whose scheduler holds at most max_num_seqs = 256 sequences per replica
# (vllm/engine/arg_utils.py, EngineArgs default)
VLLM_MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class LayoutWinner:
    """One bar pair of Seesaw's Fig. 10: the best static vLLM layout the authors found by sweeping
    every single parallelism, and the Seesaw pair (prefill -> decode) they ran, on ``gpus`` GPUs."""

    hardware: str
    model: str
    workload: str
    gpus: int
    best_static: str
    seesaw_pair: str
    source: str
    engine: str  # the kind of serving engine it ran on (parallel.cost.fit.ENGINES)

    @property
    def key(self) -> str:
        return f"{self.hardware} {self.model} {self.workload}"


def _fig10(hw: str, line: int, labels: list[tuple[str, str]]) -> list[LayoutWinner]:
    """Fig. 10's labels in the text's order: arxiv 15B, 34B, 70B, then sharegpt 15B, 34B, 70B.
    15B runs on 4 GPUs, 34B and 70B on 8 (section 6.2, line 1036)."""
    shapes = [("llama3-15b", 4), ("codellama-34b", 8), ("llama2-70b", 8)]
    rows = []
    for i, (static, pair) in enumerate(labels):
        model, gpus = shapes[i % 3]
        data = "arxiv" if i < 3 else "sharegpt"
        rows.append(LayoutWinner(hw, model, data, gpus, static, pair, f"{SEESAW}, Fig. 10, line {line}", SEESAW_ENGINE))
    return rows


# Fig. 10 (a) A10, labels at lines 1079-1092; (b) L4, lines 1105-1119 (the machines of section
# 6.1: profiles a10-g5 and l4-g6)
SEESAW_FIG10: tuple[LayoutWinner, ...] = tuple(
    _fig10(
        "a10-g5",
        1079,
        [
            ("D2T2", "P4->T4"),
            ("D2T2P2", "D2P4->D2T4"),
            ("T2P4", "P8->T4P2"),
            ("D2P2", "P4->T4"),
            ("D2T2P2", "D2P4->D2T4"),
            ("T4P2", "P8->T4P2"),
        ],
    )
    + _fig10(
        "l4-g6",
        1105,
        [
            ("T2P2", "P4->T4"),
            ("D2T4", "D2P4->D2T4"),
            ("T4P2", "P8->T4P2"),
            ("P4", "P4->T4"),
            ("D2T4", "P8->T4P2"),
            ("T4P2", "P8->T4P2"),
        ],
    )
)


@dataclass(frozen=True)
class Trend:
    """Seesaw's Fig. 13 (lines 1204-1229): 70B on eight A10s, input fixed at 3000 tokens, output
    growing; the best static layout moves ``static_winners`` in that order (``PP8`` near output 1,
    ``TP2PP4`` in between, ``TP4PP2`` once decoding dominates), and the Seesaw pair is the best
    "across all data points" (at output 1 "similar" to PP8)."""

    hardware: str = "a10-g5"
    model: str = "llama2-70b"
    gpus: int = 8
    input_len: int = 3000
    outputs: tuple[int, ...] = (1, 50, 150, 300, 600, 900)  # the figure's D:P axis runs 0 to 0.3
    statics: tuple[str, ...] = ("P8", "T2P4", "T4P2")
    static_winners: tuple[str, ...] = ("P8", "T2P4", "T4P2")
    seesaw_pair: str = "P8->T4P2"
    source: str = f"{SEESAW}, Fig. 13, lines 1204-1229"
    engine: str = SEESAW_ENGINE  # the kind of serving engine it ran on (parallel.cost.fit.ENGINES)


SEESAW_FIG13 = Trend()


# section 6.2, lines 1039-1044: Seesaw over the best static layout, geometric mean and maximum
SEESAW_SPEEDUP = MappingProxyType({"a10-g5": {"geomean": 1.45, "max": 1.78}, "l4-g6": {"geomean": 1.29, "max": 1.52}})


@dataclass(frozen=True)
class Ratio:
    """A throughput ratio the paper reports: ``numerator`` over ``denominator``, each ``(hardware,
    kind)`` with kind ``static`` (the best static layout) or ``seesaw`` (the best Seesaw pair)."""

    model: str
    workload: str
    gpus: int
    numerator: tuple[str, str]
    denominator: tuple[str, str]
    value: float
    source: str
    engine: str  # the kind of serving engine it ran on (parallel.cost.fit.ENGINES)

    @property
    def key(self) -> str:
        (a, ka), (b, kb) = self.numerator, self.denominator
        return f"{self.model} {self.workload} {a} {ka} / {b} {kb}"


def _fig11(workload: str, pcie_static: float, pcie_seesaw: float, nvlink_seesaw: float) -> list[Ratio]:
    """Fig. 11 (lines 1131-1143, text lines 1158-1171): LLaMA3-70B on eight A100s, normalized to
    vLLM on NVLink; the bars, in order, are vLLM and Seesaw on PCIe, then on NVLink."""
    src = f"{SEESAW}, Fig. 11"
    pcie, nvl, model = "a100-40g-pcie", "a100-40g-nvlink", "llama3-70b"
    return [
        Ratio(model, workload, 8, (pcie, "static"), (nvl, "static"), pcie_static, src, SEESAW_ENGINE),
        Ratio(model, workload, 8, (pcie, "seesaw"), (pcie, "static"), pcie_seesaw / pcie_static, src, SEESAW_ENGINE),
        Ratio(model, workload, 8, (nvl, "seesaw"), (nvl, "static"), nvlink_seesaw, src, SEESAW_ENGINE),
    ]


SEESAW_FIG11: tuple[Ratio, ...] = tuple(_fig11("arxiv", 0.61, 0.89, 1.00) + _fig11("sharegpt", 0.62, 0.82, 1.13))


@dataclass(frozen=True)
class Measured:
    """One absolute number: ``metric`` (``ttft_ms`` and ``tpot_ms`` of one request at a time,
    ``throughput``: peak combined input + output tokens/s) of ``technique`` (``DP`` | ``TP`` |
    ``SP`` | ``Shift``) on ``gpus`` GPUs, a uniform workload of ``input_len`` / ``output_len``."""

    hardware: str
    model: str
    gpus: int
    input_len: int
    output_len: int
    metric: str
    technique: str
    value: float
    source: str
    engine: str  # the kind of serving engine it ran on (parallel.cost.fit.ENGINES)

    @property
    def key(self) -> str:
        return f"{self.model} {self.metric} {self.technique}"


def _fig9(model: str, values: dict[str, tuple[float, float, float, float]]) -> list[Measured]:
    """Shift's Fig. 9(c) (table flattened at line 698; setup lines 669-674: 8 x H200, FP8, 4k
    input and 250 output tokens; latency one request at a time, throughput at saturation)."""
    src = f"{SHIFT}, Fig. 9(c), line 698"
    techniques = ("DP", "TP", "SP", "Shift")
    return [
        Measured("h200-fp8", model, 8, 4096, 250, metric, t, v, src, SHIFT_ENGINE)
        for metric, row in values.items()
        for t, v in zip(techniques, row)
    ]


SHIFT_FIG9: tuple[Measured, ...] = tuple(
    _fig9(
        "llama3-70b-fp8",
        {
            "ttft_ms": (614, 159, 103, 102),
            "tpot_ms": (22.5, 9.34, 32.5, 10.1),
            "throughput": (45.9e3, 24.7e3, 37.2e3, 37.4e3),
        },
    )
    + _fig9(
        "qwen3-32b-fp8",
        {
            "ttft_ms": (385, 113, 79.8, 86.41),
            "tpot_ms": (18.8, 8.68, 24.4, 9.48),
            "throughput": (70.1e3, 38.3e3, 52.3e3, 53.8e3),
        },
    )
)


@dataclass(frozen=True)
class StreamRow:
    """DejaVu's Table 6 (lines 596-609; a simulation): BLOOM-176B on 7 machines, 3 prompt and 4
    token, micro-batches of 8 prompts of 1000 tokens; the prompt KV streamed at ``gbps`` takes
    ``transfer_s``, of which ``extra_s`` outlasts the ``prompt_s`` it overlaps."""

    gbps: float
    transfer_s: float
    extra_s: float
    prompt_s: float = 3.1
    model: str = "bloom-176b"
    prompt_stages: int = 3
    seqs: int = 8
    prompt_len: int = 1000
    source: str = f"{DEJAVU}, Table 6"


DEJAVU_TABLE6: tuple[StreamRow, ...] = tuple(
    StreamRow(g, t, x)
    for g, t, x in (
        (100, 0.856, 0),
        (80, 1.07, 0),
        (60, 1.43, 0),
        (40, 2.14, 0),
        (20, 4.28, 1.18),
        (10, 8.56, 5.46),
        (1, 85.6, 82.5),
    )
)


@dataclass(frozen=True)
class Ordering:
    """A throughput ordering Shift's Fig. 14 shows for a mixture-of-experts model (8 x H200, FP8,
    uniform inputs of 2k-128k tokens and 250 output tokens, peak combined tokens/s): ``above``
    beats each of ``below``. ``base``: the (SP, TP) layout the paper ran Shift's base (and SP) in
    (section 4.6, lines 812-819: Algorithm 1 for Qwen-30B-A3B's 4 KV heads over SP=8; Algorithm 2,
    SP=4 x TP=2, for Llama-17B-16E, whose weights leave no KV room at SP=8)."""

    model: str
    above: str
    below: tuple[str, ...]
    base: str
    source: str
    engine: str  # the kind of serving engine it ran on (parallel.cost.fit.ENGINES)
    hardware: str = "h200-fp8"
    gpus: int = 8
    output_len: int = 250
    input_lens: tuple[int, ...] = (2048, 4096, 8192, 16384, 32768, 65536, 131072)  # Fig. 14's x axis

    @property
    def key(self) -> str:
        return f"{self.model}: {self.above} > {'/'.join(self.below)}"


SHIFT_FIG14: tuple[Ordering, ...] = (
    # lines 838-841: "Compared to TP, Shift parallelism shows excellent performance on both sparse
    # models: Up to 50% higher throughput without increasing the latency."
    Ordering("qwen3-30b-a3b-fp8", "Shift", ("TP",), "S8", f"{SHIFT}, Fig. 14, lines 838-841", SHIFT_ENGINE),
    Ordering("llama4-scout-fp8", "Shift", ("TP",), "S4T2", f"{SHIFT}, Fig. 14, lines 838-841", SHIFT_ENGINE),
    # lines 842-847: Qwen-30B-A3B "attains a much higher throughput (250k tokens/sec.) ... with DP,
    # and the throughput suddenly drops either with TP and SP"
    Ordering("qwen3-30b-a3b-fp8", "DP", ("TP", "SP", "Shift"), "S8", f"{SHIFT}, Fig. 14, lines 842-847", SHIFT_ENGINE),
)


SIDP = "SiDP, ../shared/seeds/002_ac3a9c59a31419dc.txt"


@dataclass(frozen=True)
class Claim:
    """A qualitative result of SiDP's section 5.2 (its figures' numbers did not survive the text's
    extraction): ``kind`` is ``tp_pp_below_tp`` (the best TP x PP layout below full TP),
    ``sidp_above_static`` (SiDP above every static TP / PP / DP layout) or ``sidp_matches_dp`` (SiDP
    within 10% of the best DP x TP layout), at ``input_len`` tokens per request; 8 x H200, the
    engine's large fixed batch (no ``max_num_seqs`` cap, section 5.1)."""

    kind: str
    model: str
    input_len: int
    source: str
    engine: str  # the kind of serving engine it ran on (parallel.cost.fit.ENGINES)
    hardware: str = "h200"
    gpus: int = 8
    output_len: int = 256  # assumed: the paper gives only the workloads' average lengths, 1K / 2K / 4K

    @property
    def key(self) -> str:
        return f"{self.model} {self.input_len}: {self.kind}"


# line 78: "a TP+PP baseline ... generally below TP in our single-node setting"; "at short sequences
# (1K) ... SiDP closely matches its throughput"; "for memory-bound offline workloads, the
# best-performing configuration with SiDP lies strictly above any TP/PP/DP combination" (4K).
# Llama-3.1-70B has Llama-3-70B's shape (config.json); Qwen2.5-72B has no profile here.
SIDP_CLAIMS: tuple[Claim, ...] = tuple(
    Claim(kind, m, n, f"{SIDP}, section 5.2, line 78", SIDP_ENGINE)
    for m in ("qwen3-32b", "llama3-70b")
    for kind, lens in (("tp_pp_below_tp", (1024, 4096)), ("sidp_matches_dp", (1024,)), ("sidp_above_static", (4096,)))
    for n in lens
)

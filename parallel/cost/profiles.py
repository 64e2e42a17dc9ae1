"""Hardware, model and workload profiles for the cost model (:mod:`parallel.cost`), as data.

Every number carries its source in a comment on its line: a vendor datasheet, a Hugging Face
``config.json``, a paper, or the word "assumed". Units: bytes, bytes/s, FLOP/s, seconds.
``this_machine`` is not here: :func:`parallel.calibrate.this_machine` measures it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from reshard.parallel.cost.topology import Level, crossed, two_sockets

GB = 10**9  # vendors quote memory bandwidth and link bandwidth in decimal GB/s
GiB = 2**30
TFLOPS = 10**12  # vendors quote tensor throughput in decimal TFLOPS
US = 1e-6  # one microsecond


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its links to its peers.

    ``memory`` bytes per device, ``mem_bw`` bytes/s (HBM/GDDR), ``flops`` dense fp16/bf16 FLOP/s,
    ``link_bw`` bytes/s per direction per device, ``link_latency`` seconds per message (per ring
    hop). ``topology``: the machine's :class:`Level` s, innermost first; a group of GPUs whose
    aligned block spans ``span`` GPUs talks over the first level of at least that size (the last
    beyond it), and a machine without one over ``link_bw`` / ``link_latency`` alone.
    ``collectives`` optionally overrides ``(latency s, bandwidth B/s)`` per collective kind
    (``all_reduce``, ``all_to_all``, ``send``), as a calibration measures them on its own group.
    """

    name: str
    memory: float
    mem_bw: float
    flops: float
    link: str  # "pcie" | "nvlink" | "gloo"
    link_bw: float
    link_latency: float
    collectives: dict = field(default_factory=dict, compare=False, hash=False)
    step_overhead: float = 0.0  # seconds per forward step of a stage (launches, scheduling): 0 unless fitted
    topology: tuple[Level, ...] = ()

    def comm(self, kind: str, span: int = 1) -> tuple[float, float]:
        """``(latency s, bandwidth B/s)`` of collective ``kind`` over a group of GPUs spanning an
        aligned block of ``span``: a calibrated override, else the path through every level up to
        the one it crosses (the slowest bandwidth, the largest latency on it), else the link."""
        if kind in self.collectives:
            return tuple(self.collectives[kind])
        path = self.path(span)
        if not path:
            return self.link_latency, self.link_bw
        return max(lv.latency for lv in path), min(lv.bw for lv in path)

    def path(self, span: int) -> tuple[Level, ...]:
        """The levels a group spanning ``span`` GPUs crosses (:func:`parallel.cost.topology.crossed`)."""
        return crossed(self.topology, span, self.name)


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape (HF ``config.json`` names in comments); ``dtype_bytes``
    per weight / KV element. A mixture-of-experts model (``experts > 0``) routes each token of the
    layers in ``moe_layers`` to ``experts_per_token`` of ``experts`` FFNs of width
    ``expert_intermediate`` (plus a shared expert of width ``shared_intermediate``, if any); its
    other layers have a dense MLP of width ``intermediate`` (sizes: :mod:`parallel.cost.moe`)."""

    name: str
    layers: int  # num_hidden_layers
    hidden: int  # hidden_size
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim (default hidden_size // num_attention_heads)
    intermediate: int  # intermediate_size
    vocab: int  # vocab_size
    dtype_bytes: int = 2
    tied_embeddings: bool = False  # tie_word_embeddings
    experts: int = 0  # num_experts / num_local_experts: routed experts per MoE layer (0: a dense model)
    experts_per_token: int = 0  # num_experts_per_tok (top-k)
    expert_intermediate: int = 0  # moe_intermediate_size (Mixtral, Llama 4: intermediate_size)
    shared_intermediate: int = 0  # shared_expert_intermediate_size (Qwen2-MoE), intermediate_size (Llama 4)
    moe_layers: tuple[int, ...] = ()  # decoder layers with a MoE FFN (the others: dense MLP of `intermediate`)
    expert_skew: float = 1.0  # busiest EP rank's routed tokens / the mean: a routing property, 1.0 = even

    @property
    def moe(self) -> bool:
        return self.experts > 0


@dataclass(frozen=True)
class Workload:
    """Mean ``input_len`` / ``output_len`` tokens per request, ``requests`` in the job."""

    name: str
    input_len: float
    output_len: float
    requests: int


# ---- hardware (vendor datasheets; links per direction) -----------------------------------------
PCIE4_X16 = 32 * GB  # PCIe Gen4 x16: 64 GB/s bidirectional = 32 GB/s per direction (PCI-SIG spec)
PCIE_LATENCY = 10 * US  # assumed: per message / ring hop over PCIe through the host bridge
NVLINK_LATENCY = 5 * US  # assumed: per message / ring hop over NVLink + NVSwitch

HARDWARE: MappingProxyType[str, Hardware] = MappingProxyType(
    {
        "a10": Hardware(
            name="a10",
            memory=24 * GB,  # NVIDIA A10 datasheet: 24 GB GDDR6
            mem_bw=600 * GB,  # NVIDIA A10 datasheet: 600 GB/s
            flops=125 * TFLOPS,  # NVIDIA A10 datasheet: BF16/FP16 tensor 125 TF dense (250 sparse)
            link="pcie",
            link_bw=PCIE4_X16,  # NVIDIA A10 datasheet: PCIe Gen4 64 GB/s (no NVLink)
            link_latency=PCIE_LATENCY,  # assumed (see PCIE_LATENCY)
        ),
        "l4": Hardware(
            name="l4",
            memory=24 * GB,  # NVIDIA L4 datasheet: 24 GB GDDR6
            mem_bw=300 * GB,  # NVIDIA L4 datasheet: 300 GB/s
            flops=121 * TFLOPS,  # NVIDIA L4 datasheet: BF16/FP16 tensor 242 TF with sparsity = 121 dense
            link="pcie",
            link_bw=PCIE4_X16,  # NVIDIA L4 datasheet: PCIe Gen4 x16 64 GB/s (no NVLink)
            link_latency=PCIE_LATENCY,  # assumed (see PCIE_LATENCY)
        ),
        # the machines Seesaw measured on (section 6.1, ../shared/seeds/000_*.txt lines 922-930): AWS
        # g5.48xlarge (A10) and g6.48xlarge (L4) give each GPU PCIe 4.0 x8, 16 GiB/s
        "a10-g5": Hardware(
            name="a10-g5",
            memory=24 * GiB,  # Seesaw Table 1: A10 24 GiB
            mem_bw=600 * GiB,  # Seesaw Table 1: A10 600 GiB/s
            flops=125 * TFLOPS,  # Seesaw Table 1: A10 125T
            link="pcie",
            link_bw=16 * GiB,  # Seesaw section 6.1: "PCIe 4.0 8x, providing 16 GiB/s bandwidth"
            link_latency=PCIE_LATENCY,  # assumed (see PCIE_LATENCY)
            topology=two_sockets(16 * GiB, PCIE_LATENCY),  # g5.48xlarge: see two_sockets
        ),
        "l4-g6": Hardware(
            name="l4-g6",
            memory=24 * GiB,  # Seesaw Table 1: L4 24 GiB
            mem_bw=300 * GiB,  # Seesaw Table 1: L4 300 GiB/s
            flops=121 * TFLOPS,  # Seesaw Table 1: L4 121T
            link="pcie",
            link_bw=16 * GiB,  # Seesaw section 6.1: "PCIe 4.0 8x, providing 16 GiB/s bandwidth"
            link_latency=PCIE_LATENCY,  # assumed (see PCIE_LATENCY)
            topology=two_sockets(16 * GiB, PCIE_LATENCY),  # g6.48xlarge: assumed as g5's (AWS gives no topology file)
        ),
        "a100-40g-pcie": Hardware(
            name="a100-40g-pcie",
            memory=40 * GiB,  # Seesaw Table 1: A100 40 GiB
            mem_bw=1555 * GiB,  # Seesaw Table 1: A100 1,555 GiB/s
            flops=312 * TFLOPS,  # Seesaw Table 1: A100 312T
            link="pcie",
            link_bw=16 * GiB,  # Seesaw section 6.1: "PCIe 4.0 8x, providing 16 GiB/s bandwidth"
            link_latency=PCIE_LATENCY,  # assumed (see PCIE_LATENCY)
        ),
        "a100-40g-nvlink": Hardware(
            name="a100-40g-nvlink",
            memory=40 * GiB,  # Seesaw Table 1: A100 40 GiB
            mem_bw=1555 * GiB,  # Seesaw Table 1: A100 1,555 GiB/s
            flops=312 * TFLOPS,  # Seesaw Table 1: A100 312T
            link="nvlink",
            link_bw=300 * GiB,  # Seesaw section 6.1: NVLink "600 GiB/s" (both directions) = 300 per direction
            link_latency=NVLINK_LATENCY,  # assumed (see NVLINK_LATENCY)
        ),
        "a100-40g": Hardware(
            name="a100-40g",
            memory=40 * GB,  # NVIDIA A100 datasheet (SXM): 40 GB HBM2
            mem_bw=1555 * GB,  # NVIDIA A100 datasheet (SXM 40GB): 1,555 GB/s
            flops=312 * TFLOPS,  # NVIDIA A100 datasheet: BF16/FP16 tensor 312 TF dense
            link="nvlink",
            link_bw=300 * GB,  # NVIDIA A100 datasheet: NVLink 600 GB/s bidirectional = 300 per direction
            link_latency=NVLINK_LATENCY,  # assumed (see NVLINK_LATENCY)
        ),
        "a100-80g": Hardware(
            name="a100-80g",
            memory=80 * GB,  # NVIDIA A100 datasheet (SXM): 80 GB HBM2e
            mem_bw=2039 * GB,  # NVIDIA A100 datasheet (SXM 80GB): 2,039 GB/s
            flops=312 * TFLOPS,  # NVIDIA A100 datasheet: BF16/FP16 tensor 312 TF dense
            link="nvlink",
            link_bw=300 * GB,  # NVIDIA A100 datasheet: NVLink 600 GB/s bidirectional = 300 per direction
            link_latency=NVLINK_LATENCY,  # assumed (see NVLINK_LATENCY)
        ),
        "h100": Hardware(
            name="h100",
            memory=80 * GB,  # NVIDIA H100 datasheet (SXM): 80 GB HBM3
            mem_bw=3350 * GB,  # NVIDIA H100 datasheet (SXM): 3.35 TB/s
            flops=989 * TFLOPS,  # NVIDIA H100 datasheet (SXM): BF16 tensor 1,979 TF with sparsity = 989 dense
            link="nvlink",
            link_bw=450 * GB,  # NVIDIA H100 datasheet: NVLink 900 GB/s bidirectional = 450 per direction
            link_latency=NVLINK_LATENCY,  # assumed (see NVLINK_LATENCY)
        ),
        "h200-fp8": Hardware(
            name="h200-fp8",
            memory=141 * GB,  # NVIDIA H200 datasheet (SXM): 141 GB HBM3e
            mem_bw=4800 * GB,  # NVIDIA H200 datasheet (SXM): 4.8 TB/s
            flops=1979 * TFLOPS,  # NVIDIA H200 datasheet (SXM): FP8 tensor 3,958 TF with sparsity = 1,979 dense
            link="nvlink",
            link_bw=450 * GB,  # NVIDIA H200 datasheet: NVLink 900 GB/s bidirectional = 450 per direction
            link_latency=NVLINK_LATENCY,  # assumed (see NVLINK_LATENCY)
        ),
        "h200": Hardware(
            name="h200",
            memory=141 * GB,  # NVIDIA H200 datasheet (SXM): 141 GB HBM3e
            mem_bw=4800 * GB,  # NVIDIA H200 datasheet (SXM): 4.8 TB/s
            flops=989 * TFLOPS,  # NVIDIA H200 datasheet (SXM): BF16 tensor 1,979 TF with sparsity = 989 dense
            link="nvlink",
            link_bw=450 * GB,  # NVIDIA H200 datasheet: NVLink 900 GB/s bidirectional = 450 per direction
            link_latency=NVLINK_LATENCY,  # assumed (see NVLINK_LATENCY)
        ),
    }
)
MACHINES = MappingProxyType({"g5.48xlarge": "a10-g5", "g6.48xlarge": "l4-g6"})  # by their AWS names (Seesaw 6.1)


# ---- models (public HF config.json values; fp16/bf16 weights as the papers run them) ------------
# Shift Parallelism's runs use FP8 weights and KV ("all FP8", ../shared/seeds/001_*.txt line 606)
_FP8 = ("llama3-70b", "qwen3-32b", "qwen3-30b-a3b", "llama4-scout", "mixtral-8x7b")
_PAPER_MODELS: tuple[ModelShape, ...] = (
    # Seesaw's "15B variety of LLaMA3" is elinas/Llama-3-15B-Instruct-zeroed; the paper gives no
    # shape. Assumed: Llama-3-8B's config.json with its 32 layers doubled to 64 by the passthrough
    # merge (64 x 218M layer params + 1.05B embeddings = 15.0B, matching the name).
    ModelShape(
        name="llama3-15b",
        layers=64,  # assumed: 2 x Llama-3-8B's num_hidden_layers (32), see above
        hidden=4096,  # meta-llama/Meta-Llama-3-8B config.json hidden_size
        heads=32,  # meta-llama/Meta-Llama-3-8B config.json num_attention_heads
        kv_heads=8,  # meta-llama/Meta-Llama-3-8B config.json num_key_value_heads
        head_dim=128,  # meta-llama/Meta-Llama-3-8B config.json: hidden_size / num_attention_heads
        intermediate=14336,  # meta-llama/Meta-Llama-3-8B config.json intermediate_size
        vocab=128256,  # meta-llama/Meta-Llama-3-8B config.json vocab_size
        dtype_bytes=2,  # Seesaw section 6: "We use float16"
    ),
    ModelShape(
        name="codellama-34b",
        layers=48,  # codellama/CodeLlama-34b-hf config.json num_hidden_layers
        hidden=8192,  # codellama/CodeLlama-34b-hf config.json hidden_size
        heads=64,  # codellama/CodeLlama-34b-hf config.json num_attention_heads
        kv_heads=8,  # codellama/CodeLlama-34b-hf config.json num_key_value_heads
        head_dim=128,  # codellama/CodeLlama-34b-hf config.json: hidden_size / num_attention_heads
        intermediate=22016,  # codellama/CodeLlama-34b-hf config.json intermediate_size
        vocab=32000,  # codellama/CodeLlama-34b-hf config.json vocab_size
        dtype_bytes=2,  # config.json torch_dtype bfloat16; Seesaw runs float16
    ),
    ModelShape(
        name="llama2-70b",
        layers=80,  # meta-llama/Llama-2-70b-hf config.json num_hidden_layers
        hidden=8192,  # meta-llama/Llama-2-70b-hf config.json hidden_size
        heads=64,  # meta-llama/Llama-2-70b-hf config.json num_attention_heads
        kv_heads=8,  # meta-llama/Llama-2-70b-hf config.json num_key_value_heads
        head_dim=128,  # meta-llama/Llama-2-70b-hf config.json: hidden_size / num_attention_heads
        intermediate=28672,  # meta-llama/Llama-2-70b-hf config.json intermediate_size
        vocab=32000,  # meta-llama/Llama-2-70b-hf config.json vocab_size
        dtype_bytes=2,  # config.json torch_dtype float16
    ),
    ModelShape(
        name="llama3-70b",
        layers=80,  # meta-llama/Meta-Llama-3-70B config.json num_hidden_layers
        hidden=8192,  # meta-llama/Meta-Llama-3-70B config.json hidden_size
        heads=64,  # meta-llama/Meta-Llama-3-70B config.json num_attention_heads
        kv_heads=8,  # meta-llama/Meta-Llama-3-70B config.json num_key_value_heads
        head_dim=128,  # meta-llama/Meta-Llama-3-70B config.json: hidden_size / num_attention_heads
        intermediate=28672,  # meta-llama/Meta-Llama-3-70B config.json intermediate_size
        vocab=128256,  # meta-llama/Meta-Llama-3-70B config.json vocab_size
        dtype_bytes=2,  # config.json torch_dtype bfloat16
    ),
    ModelShape(
        name="bloom-176b",
        layers=70,  # bigscience/bloom config.json n_layer
        hidden=14336,  # bigscience/bloom config.json hidden_size
        heads=112,  # bigscience/bloom config.json n_head
        kv_heads=112,  # bigscience/bloom: multi-head attention (no GQA)
        head_dim=128,  # bigscience/bloom config.json: hidden_size / n_head
        intermediate=57344,  # bigscience/bloom: 4 x hidden_size (MLP dense_h_to_4h)
        vocab=250880,  # bigscience/bloom config.json vocab_size
        dtype_bytes=2,  # DejaVu serves it in fp16 (its KV per micro-batch, 10.7 GB, implies 2 bytes)
        tied_embeddings=True,  # bigscience/bloom: tie_word_embeddings
    ),
    ModelShape(
        name="qwen3-32b",
        layers=64,  # Qwen/Qwen3-32B config.json num_hidden_layers
        hidden=5120,  # Qwen/Qwen3-32B config.json hidden_size
        heads=64,  # Qwen/Qwen3-32B config.json num_attention_heads
        kv_heads=8,  # Qwen/Qwen3-32B config.json num_key_value_heads
        head_dim=128,  # Qwen/Qwen3-32B config.json head_dim
        intermediate=25600,  # Qwen/Qwen3-32B config.json intermediate_size
        vocab=151936,  # Qwen/Qwen3-32B config.json vocab_size
        dtype_bytes=2,  # config.json torch_dtype bfloat16
    ),
    # mixture-of-experts (Shift's Table 4 has Qwen-30B-A3B and Llama-17B-16E; issue 37 adds Mixtral)
    ModelShape(
        name="qwen3-30b-a3b",
        layers=48,  # Qwen/Qwen3-30B-A3B config.json num_hidden_layers
        hidden=2048,  # Qwen/Qwen3-30B-A3B config.json hidden_size
        heads=32,  # Qwen/Qwen3-30B-A3B config.json num_attention_heads
        kv_heads=4,  # Qwen/Qwen3-30B-A3B config.json num_key_value_heads
        head_dim=128,  # Qwen/Qwen3-30B-A3B config.json head_dim
        intermediate=6144,  # Qwen/Qwen3-30B-A3B config.json intermediate_size (dense layers: none here)
        vocab=151936,  # Qwen/Qwen3-30B-A3B config.json vocab_size
        dtype_bytes=2,  # config.json torch_dtype bfloat16
        experts=128,  # Qwen/Qwen3-30B-A3B config.json num_experts
        experts_per_token=8,  # Qwen/Qwen3-30B-A3B config.json num_experts_per_tok
        expert_intermediate=768,  # Qwen/Qwen3-30B-A3B config.json moe_intermediate_size
        moe_layers=tuple(range(48)),  # config.json decoder_sparse_step 1, mlp_only_layers []: all 48
    ),
    ModelShape(
        name="mixtral-8x7b",
        layers=32,  # mistralai/Mixtral-8x7B-v0.1 config.json num_hidden_layers
        hidden=4096,  # mistralai/Mixtral-8x7B-v0.1 config.json hidden_size
        heads=32,  # mistralai/Mixtral-8x7B-v0.1 config.json num_attention_heads
        kv_heads=8,  # mistralai/Mixtral-8x7B-v0.1 config.json num_key_value_heads
        head_dim=128,  # mistralai/Mixtral-8x7B-v0.1 config.json: hidden_size / num_attention_heads
        intermediate=14336,  # mistralai/Mixtral-8x7B-v0.1 config.json intermediate_size
        vocab=32000,  # mistralai/Mixtral-8x7B-v0.1 config.json vocab_size
        dtype_bytes=2,  # config.json torch_dtype bfloat16
        experts=8,  # mistralai/Mixtral-8x7B-v0.1 config.json num_local_experts
        experts_per_token=2,  # mistralai/Mixtral-8x7B-v0.1 config.json num_experts_per_tok
        expert_intermediate=14336,  # mistralai/Mixtral-8x7B-v0.1 config.json intermediate_size (per expert)
        moe_layers=tuple(range(32)),  # Mixtral: every layer sparse
    ),
    ModelShape(
        name="llama4-scout",
        layers=48,  # meta-llama/Llama-4-Scout-17B-16E config.json text_config.num_hidden_layers
        hidden=5120,  # meta-llama/Llama-4-Scout-17B-16E text_config.hidden_size
        heads=40,  # meta-llama/Llama-4-Scout-17B-16E text_config.num_attention_heads
        kv_heads=8,  # meta-llama/Llama-4-Scout-17B-16E text_config.num_key_value_heads
        head_dim=128,  # meta-llama/Llama-4-Scout-17B-16E text_config.head_dim
        intermediate=16384,  # meta-llama/Llama-4-Scout-17B-16E text_config.intermediate_size_mlp (dense: none)
        vocab=202048,  # meta-llama/Llama-4-Scout-17B-16E text_config.vocab_size
        dtype_bytes=2,  # config.json torch_dtype bfloat16
        experts=16,  # meta-llama/Llama-4-Scout-17B-16E text_config.num_local_experts
        experts_per_token=1,  # meta-llama/Llama-4-Scout-17B-16E text_config.num_experts_per_tok
        expert_intermediate=8192,  # meta-llama/Llama-4-Scout-17B-16E text_config.intermediate_size
        shared_intermediate=8192,  # Llama 4's shared expert is an MLP of intermediate_size (HF Llama4TextMoe)
        moe_layers=tuple(range(48)),  # text_config.interleave_moe_layer_step 1: all 48 layers MoE
    ),
)
MODELS: MappingProxyType[str, ModelShape] = MappingProxyType(
    {m.name: m for m in _PAPER_MODELS}
    | {
        f"{m.name}-fp8": dataclasses.replace(m, name=f"{m.name}-fp8", dtype_bytes=1)
        for m in _PAPER_MODELS
        if m.name in _FP8
    }
)

# ---- workloads (Seesaw section 6; means of the length distributions of its Figure 9) -----------
WORKLOADS: MappingProxyType[str, Workload] = MappingProxyType(
    {
        "arxiv": Workload(
            name="arxiv",
            # Seesaw Fig. 9(a) spreads inputs over 0-4000 tokens (articles of ~6k words, Cohan et al.
            # 2018, cut to the context), inputs "much longer than outputs"; the figure gives no mean
            input_len=3000,  # assumed mean, read off Seesaw Fig. 9(a)
            output_len=250,  # assumed mean: Fig. 9(a) outputs peak at a few hundred (abstracts ~220 words)
            requests=500,  # Seesaw section 6: "500 requests from arxiv-summarization"
        ),
        "sharegpt": Workload(
            name="sharegpt",
            # Seesaw Fig. 9(b): "input and output have comparable lengths", mass under ~1000 tokens;
            # means of the same ShareGPT set as reported by the vLLM paper (Kwon et al. 2023, Fig. 11)
            input_len=161,  # vLLM paper (Kwon et al. 2023) Fig. 11: ShareGPT mean input 161.31
            output_len=338,  # vLLM paper (Kwon et al. 2023) Fig. 11: ShareGPT mean output 337.99
            requests=2000,  # Seesaw section 6: "We sample 2000 requests from the sharegpt dataset"
        ),
    }
)


def workload(name: str, *, input_len: float = 512, output_len: float = 512, requests: int = 1000) -> Workload:
    """A named workload, or ``constant`` with the given lengths (Seesaw section 6.5's shape)."""
    if name == "constant":
        for key, v in (("input_len", input_len), ("output_len", output_len), ("requests", requests)):
            if not v >= 1:
                raise ValueError(f"workload {key} must be >= 1, got {v!r}")
        return Workload("constant", float(input_len), float(output_len), int(requests))
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {sorted(WORKLOADS) + ['constant']}")
    return WORKLOADS[name]


def hardware(name: str, report: Callable[[str], None] = lambda line: None) -> Hardware:
    """A datasheet profile by name, or ``this_machine`` (calibrated, cached; see :mod:`parallel.calibrate`;
    ``report`` gets its progress lines)."""
    if name == "this_machine":
        from reshard.parallel.cost.calibrate import this_machine

        return this_machine(report=report)
    name = MACHINES.get(name, name)
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; known: {sorted(HARDWARE) + sorted(MACHINES) + ['this_machine']}")
    return HARDWARE[name]


def model(name: str) -> ModelShape:
    """A named model shape, or the shape read from an HF ``config.json`` (a file or a checkpoint directory)."""
    if name in MODELS:
        return MODELS[name]
    path = Path(name) / "config.json" if os.path.isdir(name) else Path(name)
    if path.name.endswith(".json") and path.is_file():
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"model {name!r}: {path} is not a JSON config ({e})") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"model {name!r}: {path} holds a {type(cfg).__name__}, not an HF config object")
        return model_from_config(cfg, name=str(name))
    raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)} or a path to an HF config.json")


_DTYPE_BYTES = MappingProxyType(
    {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}
)  # bytes per element (IEEE 754 / OCP FP8)


def model_from_config(cfg: dict, *, name: str) -> ModelShape:
    """The shape of an HF ``config.json`` dict (``text_config`` of multimodal configs is read; the
    experts of the MoE families in :data:`parallel.cost.moe.FAMILIES`)."""
    from reshard.parallel.cost.moe import moe_fields

    cfg = cfg.get("text_config", cfg)
    missing = [
        k
        for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
        if k not in cfg
    ]
    if missing:
        raise ValueError(f"config.json of {name!r} lacks {missing}")
    moe = moe_fields(cfg, name=name)  # {} for a dense model
    heads = cfg["num_attention_heads"]
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return ModelShape(
        name=name,
        layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab=cfg["vocab_size"],
        dtype_bytes=_DTYPE_BYTES.get(dtype, 2),  # unknown torch_dtype: assumed 2 bytes (fp16/bf16)
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        intermediate=moe.pop("intermediate", cfg["intermediate_size"]),  # Llama 4: its dense layers' width
        **moe,
    )

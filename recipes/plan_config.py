"""The planner's config behind conf/plan.yaml (checked by Hydra: :mod:`reshard.recipes.schema`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PlanConfig:
    model: str = "llama3-15b"  # a name in parallel.profiles.MODELS or a path to an HF config.json
    # the Seesaw paper's machines, 8 GPUs in two sockets of 4: g5.48xlarge (= a10-g5), g6.48xlarge (= l4-g6);
    # the papers' a100-40g-pcie, a100-40g-nvlink, h200-fp8; datasheet cards with one flat link, no socket
    # topology: a10, l4, a100-40g, a100-80g, h100, h200 (parallel.cost.profiles.HARDWARE); or this_machine
    hardware: str = "g5.48xlarge"
    num_gpus: int = 4  # a power of two
    workload: str = "arxiv"  # arxiv | sharegpt | constant
    input_len: float = 512.0  # constant workload: prompt tokens per request
    output_len: float = 512.0  # constant workload: generated tokens per request
    requests: int = 1000  # constant workload: requests in the job
    max_batch: int | None = 256  # static layouts' sequences per replica, vLLM's max_num_seqs (null: KV decides)
    seesaw_change_dp: bool = False  # also rank Seesaw pairs that change dp (D2P2->T4): unvalidated, no paper ran one
    efficiency: str = "fitted"  # fitted (validated on the papers: bench/cost_vs_papers.py) | datasheet (peaks)
    engine: str = "sync"  # sync: CPU work in the step loop (reshard's, vLLM 0.5) | async: beside it (vLLM V1)
    rate: float | None = None  # online: requests/s arriving; ranks by TTFT + output_len x TPOT (null: offline)
    top: int = 20  # rows of the ranked table printed (plan.json holds all)
    expert_skew: float = 1.0  # MoE: the busiest expert-parallel rank's routed tokens / the mean (1.0: even)

    def __post_init__(self) -> None:
        from reshard.parallel.cost.roofline import check_gpus

        check_gpus(self.num_gpus)
        for key in ("input_len", "output_len", "requests", "top"):
            if not getattr(self, key) >= 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)!r}")
        from reshard.parallel.cost.fit import EFFICIENCIES, overhead_of

        if self.efficiency not in EFFICIENCIES:
            raise ValueError(f"efficiency must be one of {sorted(EFFICIENCIES)}, got {self.efficiency!r}")
        overhead_of(self.engine)  # ValueError naming a kind of engine the model has no overhead for
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s or null, got {self.rate!r}")
        if not self.expert_skew >= 1.0:
            raise ValueError(f"expert_skew must be >= 1.0 (the busiest rank over the mean), got {self.expert_skew!r}")
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 or null, got {self.max_batch!r}")

"""RL rollout in training code: a policy trained with FSDP2, rolled out in an inference layout.

The training model is the HF model itself, ``fully_shard``-ed over the training ranks (parameters
``Shard(0)``). The rollout model is built by :func:`parallelize` in the TP or Shift layout over the
rollout ranks, the same ranks (colocated) or others (split). Weights move between them with
:func:`parallel.weight_sync.model_sync`, in place, every iteration. The policy-gradient pieces
(group-normalized advantages, the GRPO loss) are plain functions of tensors.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from reshard.mesh import cached_mesh, rank_tensor
from reshard.parallel.engine import Engine, EngineConfig, Strategy, registered, strategy_class
from reshard.parallel.model.checkpoint import hf_bars_off
from reshard.parallel.model.dims import ParallelDims
from reshard.parallel.model.info import parallel_info


@dataclass(frozen=True)
class RankSplit:
    """Which ranks train and which roll out: all ranks both (colocated), or two disjoint halves."""

    train: tuple[int, ...]
    rollout: tuple[int, ...]

    @staticmethod
    def of(world_size: int, colocated: bool, train_ranks: int | None = None) -> RankSplit:
        """Colocated: every rank does both. Split: the first ``train_ranks`` (default half) train,
        the others roll out."""
        if colocated:
            ranks = tuple(range(world_size))
            return RankSplit(ranks, ranks)
        n = train_ranks if train_ranks is not None else world_size // 2
        if not 0 < n < world_size:
            raise ValueError(
                f"split placement needs 1..{world_size - 1} training ranks of the job's {world_size}, got {n}"
            )
        return RankSplit(tuple(range(n)), tuple(range(n, world_size)))

    @property
    def colocated(self) -> bool:
        return self.train == self.rollout


TRAIN_LAYOUTS = ("fsdp", "fsdp_tp", "hsdp")

# torchtitan's Llama TP plan on HF's module names: column-parallel in, row-parallel out
_TP_PLAN = MappingProxyType(
    {
        "self_attn.q_proj": "colwise",
        "self_attn.k_proj": "colwise",
        "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise",
        "mlp.gate_proj": "colwise",
        "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise",
    }
)


def train_model(
    path: str | os.PathLike, ranks: Sequence[int], layout: str = "fsdp", *, inner: int = 2
) -> nn.Module | None:
    """The HF model of ``path`` in fp32 train mode, in a training ``layout`` over ``ranks``;
    ``None`` on other ranks. Collective: every rank of the job calls it.

    ``fsdp``: FSDP2 over all ``ranks`` (parameters ``Shard(0)``). ``fsdp_tp``: torchtitan's 2-D
    layout, TP over ``inner`` consecutive ranks and FSDP2 over the rest (a weight TP already
    sharded on dim 0 becomes ``(_StridedShard(0, sf=inner), Shard(0))``, one sharded on dim 1
    ``(Shard(0), Shard(1))``). ``hsdp``: FSDP2 within groups of ``inner`` ranks, replicated
    across them (``(Replicate(), Shard(0))``).
    """
    from torch.distributed.fsdp import fully_shard

    mesh = _train_mesh(ranks, layout, inner)  # built on every rank (collective)
    if dist.get_rank() not in ranks:
        return None
    model = _load_train(path)
    if layout == "fsdp_tp":
        _tensor_parallel(model, mesh["tp"])
    shard_mesh = mesh["dp"] if layout == "fsdp_tp" else mesh
    for layer in model.model.layers:
        fully_shard(layer, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return model.train()


def _train_mesh(ranks: Sequence[int], layout: str, inner: int):
    """``fsdp``: 1-D ``("fsdp",)``; ``fsdp_tp``: ``("dp", "tp")``; ``hsdp``: ``("replicate", "shard")``."""
    if layout not in TRAIN_LAYOUTS:
        raise ValueError(f"train layout must be one of {TRAIN_LAYOUTS}, got {layout!r}")
    if layout == "fsdp":
        return cached_mesh(rank_tensor(list(ranks)), ("fsdp",))
    least = 2 if layout == "fsdp_tp" else 1  # HSDP's shard groups may be single ranks (pure replicas)
    if inner < least or len(ranks) % inner or len(ranks) == inner:
        raise ValueError(
            f"train layout {layout!r} needs groups of {inner} ranks (at least {least}) and at least two "
            f"groups; got {len(ranks)} training ranks"
        )
    names = ("dp", "tp") if layout == "fsdp_tp" else ("replicate", "shard")
    return cached_mesh(rank_tensor(list(ranks)).view(-1, inner), names)


def _load_train(path: str | os.PathLike) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with hf_bars_off():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")


def _tensor_parallel(model: nn.Module, tp_mesh) -> None:
    """torch's ``parallelize_module`` with :data:`_TP_PLAN` on every decoder layer (attention
    heads and MLP columns split over ``tp_mesh``; embeddings, norms and the head replicated)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    heads = model.config.num_key_value_heads
    if heads % tp_mesh.size():
        raise ValueError(f"fsdp_tp over {tp_mesh.size()} ranks needs KV heads divisible by it; the model has {heads}")
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, {name: styles[kind]() for name, kind in _TP_PLAN.items()})


def rollout_layouts() -> list[str]:
    """The strategies a rollout can run in: those that build one model in one layout."""
    return [name for name in registered() if strategy_class(name).single_model()]


def rollout_strategy(layout: str, **keys) -> Strategy:
    """The registered strategy ``layout`` configured from those of ``keys`` it has (others ignored:
    ``tp`` for TP, ``sp``/``threshold`` for Shift; ``None`` keeps the strategy's default)."""
    if layout not in rollout_layouts():
        raise ValueError(f"rollout layout must be one of {rollout_layouts()}, got {layout!r}")
    cls = strategy_class(layout)
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in keys.items() if k in known and v is not None})


def rollout_model(
    path: str | os.PathLike,
    layout: str,
    ranks: Sequence[int],
    *,
    tp: int | None = None,
    sp: int = 2,
    pp: int = 1,
    ep: int = 1,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """The rollout model over ``ranks`` (consecutive) in the strategy ``layout``'s layout: ``"tp"``
    (TP of ``tp`` ranks, default all, in ``pp`` pipeline stages, the rest data-parallel
    replicas; a MoE model's experts over ``ep`` groups) or ``"shift"`` (Shift parallelism, ``sp``
    x rest), in ``dtype`` (default the checkpoint's). Built on every rank of the job (collective);
    ranks outside ``ranks`` hold empty shards."""
    if ep != 1 and layout != "tp":
        raise ValueError(f"ep ({ep}) is the tp rollout layout's expert parallelism; layout {layout!r} has none")
    strategy = rollout_strategy(layout, tp=tp, sp=sp, pp=pp, ep=ep)
    config = EngineConfig(dtype=None if dtype is None else str(dtype).removeprefix("torch."))
    return strategy.build_model(path, rollout_dims(strategy, ranks), config)


def rollout_engine(
    model: nn.Module, layout: str, *, max_batch_size: int, max_seq_len: int, threshold: int = 64
) -> Engine:
    """The engine of a :func:`rollout_model` by its strategy: continuous batching in the TP layout,
    or Shift's two modes over one KV cache (steps of more than ``threshold`` tokens run SP)."""
    strategy = rollout_strategy(layout, threshold=threshold, sp=parallel_info(model).dims.sp)
    # eager: a rollout frees its KV and weights for training every iteration, which would make
    # CUDA graphs re-record each time (EngineConfig.compile)
    config = EngineConfig(max_batch_size=max_batch_size, max_seq_len=max_seq_len, compile=False)
    return strategy.build_engine(model, config)


def rollout_dims(strategy: Strategy, ranks: Sequence[int]) -> ParallelDims:
    """``strategy``'s layout over the consecutive ``ranks``: its dims for ``len(ranks)`` ranks,
    starting at ``ranks[0]``."""
    n, first = len(ranks), ranks[0]
    if list(ranks) != list(range(first, first + n)):
        raise ValueError(f"rollout ranks must be consecutive, got {list(ranks)}")
    try:
        dims = strategy.dims(n)
    except ValueError as e:  # the strategy names its keys as parallel.*; here they are rollout.*
        raise ValueError(f"rollout on {n} ranks: {str(e).replace('parallel.', 'rollout.')}") from None
    return dataclasses.replace(dims, first_rank=first)


# ---- GRPO ----------------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """``(P * G,)`` rewards (G completions per prompt, prompt-major) -> advantages normalized
    within each group: ``(r - mean) / (std + eps)``; a group whose rewards are all equal gets 0."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.view(-1, group_size)  # (P, G)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True, unbiased=False) + eps)).flatten()


def completion_logprobs(
    model: nn.Module, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities of each completion given its prompt (teacher forcing).

    Returns ``(logp, mask)``, both ``(B, Tc)`` (right-padded to the longest completion).
    """
    device = next(model.parameters()).device
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
    width, tc = max(map(len, seqs)), max(map(len, completions))
    ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], attn[i, : len(s)] = torch.tensor(s, device=device), 1
    logits = model(input_ids=ids, attention_mask=attn).logits.float()  # (B, W, V)
    logp_all = F.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, W-1)
    logp = torch.zeros(len(seqs), tc, device=device)
    mask = torch.zeros(len(seqs), tc, device=device)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        logp[i, : len(c)] = logp_all[i, len(p) - 1 : len(p) - 1 + len(c)]
        mask[i, : len(c)] = 1
    return logp, mask


def grpo_loss(logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """On-policy GRPO (one update per batch, so the ratio is 1 and the clip inactive): the
    negative advantage-weighted log-likelihood, averaged over each completion's tokens and then
    over completions."""
    per_seq = (logp * mask).sum(1) / mask.sum(1).clamp(min=1)
    return -(advantages.to(per_seq.device) * per_seq).mean()

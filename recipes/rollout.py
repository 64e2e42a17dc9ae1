"""An RL loop in training code: train with FSDP2, sync weights in place, roll out, repeat.

    torchrun --standalone --nproc-per-node 4 -m reshard.recipes.rollout [hydra overrides]

With no overrides: the built-in tiny policy (seeded, vocab 64) learns a verifiable toy task with
GRPO on 4 ranks, training and rolling out on every rank (TP4). Each iteration syncs the training
weights (FSDP2 ``Shard(0)``) into the rollout layout in place, samples ``group_size``
completions per prompt (seeded), scores them, and takes one policy-gradient step with
group-normalized advantages. The task (verifiable, learnable in a minute on CPU): answer any
prompt with even tokens; the reward is the fraction of the ``max_new_tokens`` answer tokens that
are even ordinary (not special) tokens (a uniform policy scores about 0.48, a perfect one 1.0).

Rank 0 shows progress and writes ``metrics.jsonl`` (one line per iteration: reward, loss, sync
bytes against the lower bound, sync seconds, peak memory per phase, digests of the rollout
weights and tokens), ``summary.json`` and ``rollout.png`` (reward and sync time) into Hydra's
run directory.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from reshard.mesh import all_gather_objects, device_type
from reshard.parallel import Request, SamplingParams
from reshard.parallel.model.tiny_models import cached_checkpoint
from reshard.parallel.model.weight_sync import model_sync, rollout_tensors
from reshard.parallel.strategies.rollout import (
    RankSplit,
    completion_logprobs,
    group_advantages,
    grpo_loss,
    rollout_engine,
    rollout_model,
    train_model,
)
from reshard.recipes.launch import hydra_main
from reshard.recipes.rl_task import Task
from reshard.recipes.rollout_config import POLICY, POLICY_NAME, RolloutJobConfig, TrainConfig


# ---- the job ------------------------------------------------------------------------------------
class RolloutJob:
    """The models, the sync and the engine of one run, on this rank."""

    def __init__(self, cfg: RolloutJobConfig, path: Path) -> None:
        self.cfg, self.rank = cfg, dist.get_rank()
        r = cfg.rollout
        self.split = RankSplit.of(dist.get_world_size(), r.colocated, r.train_ranks)
        _check_batch(cfg.train, self.split)
        self.train = train_model(path, self.split.train, cfg.train.layout, inner=cfg.train.inner)
        self.opt = torch.optim.Adam(self.train.parameters(), lr=cfg.train.learning_rate) if self.train else None
        dtype = getattr(torch, r.dtype) if r.dtype is not None else None
        rollout = rollout_model(path, r.layout, self.split.rollout, tp=r.tp, sp=r.sp, dtype=dtype)
        self.rollout = rollout if self.rank in self.split.rollout else None
        self.task = Task(cfg.train, path, rollout.config.vocab_size)
        self.engine = self._engine() if self.rollout is not None else None
        self.sync = model_sync(
            self.train,
            self.rollout,
            bucket_bytes=int(cfg.sync.bucket_mb * 2**20),
            method=cfg.sync.method,
            delta=cfg.sync.delta,
        )

    def _engine(self):
        t = self.cfg.train
        slots = min(self.cfg.rollout.max_batch_size, t.prompts * t.group_size)
        return rollout_engine(
            self.rollout,
            self.cfg.rollout.layout,
            max_batch_size=slots,
            max_seq_len=self.task.max_prompt_len + t.max_new_tokens,
            threshold=self.cfg.rollout.threshold,
        )

    def iteration(self, it: int) -> dict:
        """Sync the weights of training step ``it``, roll out, score, take one GRPO step."""
        t = self.cfg.train
        memory = {"sync": self._resident()}
        t0 = time.perf_counter()
        every = self.cfg.sync.verify_every
        stats = self.sync.sync(it, verify=every > 0 and it % every == 0)  # verify: a RuntimeError if wrong
        sync_s = time.perf_counter() - t0
        memory["sync"] += stats.peak_extra_bytes
        asked = [p for p in self.task.prompts(it) for _ in range(t.group_size)]
        prompts = [p.ids for p in asked]
        completions, memory["rollout"] = self._roll_out(prompts, it)
        rewards = torch.tensor(self.task.rewards(asked, completions), device=device_type())
        loss, memory["train"] = self._train_step(prompts, completions, group_advantages(rewards, t.group_size))
        return self._metrics(it, rewards, loss, stats, sync_s, memory, completions)

    def _roll_out(self, prompts: list[list[int]], it: int) -> tuple[list[list[int]], int]:
        t = self.cfg.train
        params = SamplingParams(temperature=t.temperature, max_new_tokens=t.max_new_tokens, ignore_eos=True)
        outs, peak = None, 0
        if self.engine is not None:  # each iteration's call seed: its noise is its own
            requests = [Request(i, p, params) for i, p in enumerate(prompts)]
            outs = [c.output_ids for c in self.engine.generate(requests, seed=t.seed * 7919 + it)]
            peak = self._resident()  # the KV cache is held now
            if self.split.colocated:
                self.engine.release_memory()  # training needs the memory next
        if not self.split.colocated:  # the trainers learn the completions from the first rollout rank
            box = [outs]
            dist.broadcast_object_list(box, src=self.split.rollout[0])
            outs = box[0]
        return outs, peak

    def _train_step(self, prompts, completions, advantages: torch.Tensor) -> tuple[float, int]:
        """This training rank's share of the batch (a TP group's ranks share one) through the
        training model; one optimizer step."""
        loss, peak = torch.zeros((), device=device_type()), 0
        if self.train is not None:
            shards = self.cfg.train.data_shards(len(self.split.train))
            n = len(prompts) // shards
            a = self.split.train.index(self.rank) // (len(self.split.train) // shards) * n
            logp, mask = completion_logprobs(self.train, prompts[a : a + n], completions[a : a + n])
            loss = grpo_loss(logp, mask, advantages[a : a + n])
            loss.backward()  # FSDP2 averages the gradients over the training ranks
            peak = self._resident()
            self.opt.step()
            self.opt.zero_grad(set_to_none=False)
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)
        return float(total) / len(self.split.train), peak

    def _resident(self) -> int:
        """Bytes of the storages this rank holds: training shards, grads, optimizer state, rollout
        shards and weight copies, the KV cache when allocated (activations not counted)."""
        tensors = []
        if self.train is not None:
            for p in self.train.parameters():
                tensors += [p] + ([p.grad] if p.grad is not None else [])
            tensors += [v for s in self.opt.state.values() for v in s.values() if torch.is_tensor(v)]
        if self.rollout is not None:
            tensors += list(rollout_tensors(self.rollout).values())
            if self.engine.kv.allocated:
                tensors += self.engine.kv.k + self.engine.kv.v
        return storage_bytes(tensors)

    def _metrics(self, it, rewards, loss, stats, sync_s, memory, completions) -> dict:
        agg = torch.tensor(
            [stats.bytes_received, sync_s, memory["sync"], memory["rollout"], memory["train"]],
            dtype=torch.float64,
            device=device_type(),
        )
        summed, peak = agg.clone(), agg.clone()
        dist.all_reduce(summed)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return {
            "iteration": it,
            "reward": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "loss": loss,
            "sync_bytes": int(summed[0]),
            "lower_bound_bytes": self.sync.lower_bound_bytes,
            "sync_seconds": float(peak[1]),
            "peak_mib": {
                "sync": peak[2].item() / 2**20,
                "rollout": peak[3].item() / 2**20,
                "train": peak[4].item() / 2**20,
            },
            "weights_version": it,
            "weights_digest": self._weights_digest(),
            "tokens_digest": _digest(json.dumps(completions).encode()),
        }

    def _weights_digest(self) -> str:
        """One digest of every rollout rank's shards (the same on every rank)."""
        mine = ""
        if self.rollout is not None:
            mine = _digest(
                b"".join(
                    t.to_local().detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
                    for _, t in sorted(rollout_tensors(self.rollout).items())
                )
            )
        everyone = all_gather_objects(mine)
        return _digest("".join(everyone).encode())


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _check_batch(cfg: TrainConfig, split: RankSplit) -> None:
    n, shards = cfg.prompts * cfg.group_size, cfg.data_shards(len(split.train))
    if n % shards:
        raise ValueError(
            f"train.prompts ({cfg.prompts}) x train.group_size ({cfg.group_size}) = {n} "
            f"sequences do not split evenly over the {shards} data-parallel training ranks"
        )


# ---- outputs ------------------------------------------------------------------------------------
def run_rollout(cfg: RolloutJobConfig, run_dir: Path) -> dict:
    """The whole loop; rank 0 writes the outputs. Returns the summary on every rank."""
    job = RolloutJob(cfg, _policy_path(cfg))
    rank0 = dist.get_rank() == 0
    history = []
    if rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
    bar = tqdm(range(cfg.train.iterations), desc="rollout", unit="it", disable=not (cfg.progress and rank0))
    for it in bar:
        history.append(job.iteration(it))
        bar.set_postfix(reward=f"{history[-1]['reward']:.3f}", sync=f"{history[-1]['sync_seconds'] * 1e3:.0f}ms")
        if rank0:
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(history[-1]) + "\n")
    summary = _summary(cfg, job, history)
    if rank0:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot(history, run_dir / "rollout.png", run_title(summary, dist.get_world_size()))
        print(
            f"reward {summary['reward_first5']:.3f} (first 5 iterations) -> {summary['reward_last5']:.3f} "
            f"(last 5); sync {summary['sync_bytes']} bytes/iteration, lower bound "
            f"{summary['lower_bound_bytes']}\noutputs written to {run_dir.resolve()}",
            flush=True,
        )
    return summary


def _summary(cfg: RolloutJobConfig, job: RolloutJob, history: list[dict]) -> dict:
    rewards = [h["reward"] for h in history]
    k = min(5, len(rewards))
    return {
        "iterations": len(history),
        "layout": cfg.rollout.layout,
        "colocated": job.split.colocated,
        "train_ranks": list(job.split.train),
        "rollout_ranks": list(job.split.rollout),
        "train_layout": cfg.train.layout,
        "rollout_dtype": cfg.rollout.dtype or "checkpoint's",
        "sync_method": cfg.sync.method,
        "sync_delta": cfg.sync.delta,
        "reward_first5": sum(rewards[:k]) / k,
        "reward_last5": sum(rewards[-k:]) / k,
        "sync_bytes": history[-1]["sync_bytes"],
        "lower_bound_bytes": history[-1]["lower_bound_bytes"],
        "median_sync_seconds": sorted(h["sync_seconds"] for h in history)[len(history) // 2],
        "final_weights_digest": history[-1]["weights_digest"],
    }


def run_title(s: dict, world: int) -> str:
    """Which run a plot is of: ranks, layouts, dtype and sync method."""
    ranks = "colocated" if s["colocated"] else f"train ranks {s['train_ranks']} -> rollout ranks {s['rollout_ranks']}"
    delta = ", delta" if s["sync_delta"] else ""
    return (
        f"RL rollout on {world} ranks ({ranks}): train {s['train_layout']} -> rollout {s['layout']} "
        f"({s['rollout_dtype']}), sync {s['sync_method']}{delta}, {s['iterations']} iterations"
    )


def plot(history: list[dict], path: Path, title: str = "") -> None:
    """Reward per iteration (left) and sync time per iteration (right) as a PNG titled ``title``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [h["iteration"] for h in history]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.plot(its, [h["reward"] for h in history], marker=".")
    a.set(xlabel="iteration", ylabel="mean reward", title="reward")
    b.plot(its, [h["sync_seconds"] * 1e3 for h in history], marker=".", color="tab:orange")
    b.set(xlabel="iteration", ylabel="weight sync time (ms)", title="weight sync time per iteration")
    fig.suptitle(title, fontsize=9, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _policy_path(cfg: RolloutJobConfig) -> Path:
    """The configured checkpoint, or the built-in policy (rank 0 creates it, the others wait)."""
    if cfg.model.path is not None:
        from reshard.parallel import resolve_checkpoint

        return resolve_checkpoint(cfg.model.path)
    if dist.get_rank() == 0:
        cached_checkpoint(POLICY_NAME, POLICY, cfg.model.cache_dir)
    dist.barrier()
    return cached_checkpoint(POLICY_NAME, POLICY, cfg.model.cache_dir)


def main() -> None:
    hydra_main("rollout", run_rollout)


if __name__ == "__main__":
    main()

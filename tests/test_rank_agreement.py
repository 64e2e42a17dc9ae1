"""Ranks that must agree are checked before the first collective that depends on it: an ``LLM``
built with different arguments on different ranks is one ``ValueError`` on every rank naming the
value and the ranks, never a wait for the collective timeout."""

from __future__ import annotations

import pytest

from tests import dist_harness


def _build(path: str, per_rank: dict):
    """Rank r builds ``LLM(path, **per_rank[r])``; the error each rank got (None: it built one)."""
    import torch.distributed as dist

    from reshard import LLM

    try:
        with LLM(path, max_model_len=64, **per_rank[dist.get_rank()]):
            return None
    except ValueError as e:
        return str(e)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "per_rank, message",
    [
        ({0: {"tp": 2}, 1: {"tp": 1}}, "tp=2 on rank 0, tp=1 on rank 1"),
        ({0: {"max_num_seqs": 4}, 1: {"max_num_seqs": 8}}, "max_batch_size=4 on rank 0, max_batch_size=8 on rank 1"),
        ({0: {"dp_prompts": "local"}, 1: {}}, "dp_prompts='local' on rank 0, dp_prompts='shared' on rank 1"),
    ],
    ids=["tp", "engine-key", "dp-prompts"],
)
def test_ranks_building_different_llms_get_one_error_each(checkpoints, per_rank, message):
    errors = dist_harness.run(2, _build, checkpoints["llama"], per_rank)
    assert all(e is not None and message in e and "every rank builds the same LLM" in e for e in errors), errors


def test_ranks_building_the_same_llm_agree(checkpoints):
    same = {0: {"tp": 2}, 1: {"tensor_parallel_size": 2}}  # vLLM's name is the same setting
    assert dist_harness.run(2, _build, checkpoints["llama"], same) == [None, None]

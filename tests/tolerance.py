"""Tolerances set by the reductions a result follows, not by a fixed number.

A sharded computation adds the same products as the unsharded reference in another order
(partial sums per rank, then an all-reduce or a gather), so the two differ by rounding only, and
each lies within the rounding error of the same chain of reductions from the exact result. The
fp32 reference's own distance from a float64 run of the same computation measures that error for
this computation, these inputs and their magnitudes; a sharded result may be off the float64
result by a few times it (``FACTOR``), and never less than one fp32 epsilon of its largest value.
Where a fixed ``atol`` ignores the order of the ranks' partial sums, this bound follows it.
"""

from __future__ import annotations

import torch

FACTOR = 4.0  # how many times the fp32 reference's own rounding error a reordered sum may add


def reduction_atol(expected: torch.Tensor, expected64: torch.Tensor, factor: float = FACTOR) -> float:
    """The absolute tolerance of a reordering of the reductions that computed ``expected``."""
    own_error = (expected.double() - expected64).abs().max().item()
    floor = torch.finfo(expected.dtype).eps * expected64.abs().max().item()
    return factor * max(own_error, floor)


def assert_close_reduced(
    actual: torch.Tensor, expected: torch.Tensor, expected64: torch.Tensor, *, factor: float = FACTOR, msg: str = ""
) -> None:
    """``actual`` (a sharded fp32 result) is within :func:`reduction_atol` of the float64 reference."""
    assert actual.shape == expected64.shape, (msg, actual.shape, expected64.shape)
    atol = reduction_atol(expected, expected64, factor)
    error = (actual.double() - expected64).abs().max().item()
    assert error <= atol, (
        f"{msg} max |actual - float64 reference| = {error:.3g} exceeds {factor} x the fp32 reference's "
        f"own error ({atol / factor:.3g})"
    )


def hf_prompt_kv(path, prompts, dtype):
    """Per prompt, per layer: HF's cached (keys, values) after the prompt, [kv_heads, len, head_dim]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            cache = hf(torch.tensor([p]), use_cache=True).past_key_values
            out.append([(layer.keys[0], layer.values[0]) for layer in cache.layers])
    return out

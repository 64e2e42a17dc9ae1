"""DejaVu's resource planner: split D machines between prompt processing and token generation.

Pure arithmetic from DejaVu (Strati et al., ICML 2024), Section 4.2.1 and Appendix D; no processes.
Symbols follow the paper:

- ``D`` machines, each with ``M`` GB of aggregate GPU memory; a model of ``L`` layers;
- ``Y`` ms: prompt processing of one microbatch on all ``D`` machines; ``t`` ms: one token step;
- ``N`` new tokens per microbatch; ``m >= 1`` the prompt slowdown due to KV cache streaming;
- per layer: ``W0`` GB of weights, ``C0`` GB of prompt KV cache, ``K0`` GB of token KV cache.

Inverse throughputs (ms per microbatch; lower is better):

- baseline, prompt and tokens on one D-stage pipeline, (4): ``I_c = (D-1)(Y-t)/D + Y + N*t``;
- token pipeline on ``D_t`` machines: ``I_t = N*D*t / D_t``; prompt pipeline on ``D_p`` machines:
  ``I_p = m*D*Y / D_p``; the disaggregated system: ``I_dis = max(I_t, I_p)``.

``I_t = I_p`` with ``D_p + D_t = D`` gives formula (1) (= (6), (7)) and ``I_dis = m*Y + N*t``;
that is below ``I_c`` iff ``(m-1)*D*Y < (D-1)*(Y-t)``, i.e. inequality (5)
``Y/t > (D-1) / (D*(2-m) - 1)`` when ``D*(2-m) - 1 > 0``, and never otherwise (``N`` cancels).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from numbers import Integral, Real

_REL_TOL = 1e-9  # float slack for ceilings and ties: 3.0000000001 machines is 3 machines


@dataclass(frozen=True)
class DejaVuPlan:
    """An integer split of ``D`` machines (``D_p + D_t == D``) and its inverse throughputs (ms)."""

    D: int
    D_p: int  # prompt processing machines
    D_t: int  # token generation machines
    D_p_real: float  # formula (1), before rounding and memory limits
    D_t_real: float
    min_D_p: int  # lower limit (2), 1 without memory arguments
    min_D_t: int  # lower limit (3), 1 without memory arguments
    I_p: float  # m*D*Y / D_p
    I_t: float  # N*D*t / D_t
    I_dis: float  # max(I_t, I_p) of this integer split
    I_ideal: float  # m*Y + N*t: I_dis of the real split (1)
    I_c: float  # baseline, (4)
    pays: bool  # inequality (5): the real split (1) beats the baseline
    plan_pays: bool  # this integer split beats the baseline: I_dis < I_c

    def as_dict(self) -> dict[str, int | float | bool]:
        return asdict(self)


def split_machines(D: int, Y: float, t: float, N: float, m: float) -> tuple[float, float]:
    """Formula (1): real ``(D_p, D_t)`` with ``I_p == I_t`` and ``D_p + D_t == D``."""
    _check_workload(D, Y, t, N, m)
    total = m * Y + N * t
    return D * m * Y / total, D * N * t / total


def baseline_inverse_throughput(D: int, Y: float, t: float, N: float) -> float:
    """Equation (4): ``I_c = (D-1)(Y-t)/D + Y + N*t``, one D-stage pipeline doing both phases."""
    _check_workload(D, Y, t, N, 1.0)
    return (D - 1) * (Y - t) / D + Y + N * t


def prompt_inverse_throughput(D: int, Y: float, m: float, D_p: int) -> float:
    """``I_p = m*Y_dis = m*D*Y / D_p`` (Appendix D): a D_p-stage prompt pipeline."""
    _check_workload(D, Y, 1.0, 1.0, m)
    _check_machines(D, D_p=D_p)
    return m * D * Y / D_p


def token_inverse_throughput(D: int, t: float, N: float, D_t: int) -> float:
    """``I_t = N*t_dis = N*D*t / D_t`` (Appendix D): a D_t-stage token pipeline."""
    _check_workload(D, 1.0, t, N, 1.0)
    _check_machines(D, D_t=D_t)
    return N * D * t / D_t


def disaggregation_pays(D: int, Y: float, t: float, m: float) -> bool:
    """Inequality (5): ``Y/t > (D-1) / (D*(2-m) - 1)``, i.e. ``m*Y + N*t < I_c``.

    Derived from ``I_t < I_c`` with ``D_t`` of (6): ``(m-1)*D*Y < (D-1)*(Y-t)``. When
    ``D*(2-m) - 1 <= 0`` (``m >= 2 - 1/D``, so any ``m >= 2``) the left side can never win.
    """
    _check_workload(D, Y, t, 1.0, m)
    denom = D * (2 - m) - 1
    return denom > 0 and Y / t > (D - 1) / denom


def min_prompt_machines(L: int, M: float, W0: float, C0: float) -> int:
    """Lower limit (2): ``D_p >= ceil(L*(C0+W0) / M)``: weights and prompt KV of all layers fit."""
    _check_memory(L, M, W0, C0, 0.0)
    return max(1, _ceil(L * (C0 + W0) / M))


def min_token_machines(L: int, M: float, W0: float, C0: float, K0: float) -> int:
    """Lower limit (3): ``D_t >= L*W0 / (M - L*(C0+K0))``; each stage holds KV of all L layers."""
    _check_memory(L, M, W0, C0, K0)
    free = M - L * (C0 + K0)  # per machine, after the KV cache of D_t in-flight microbatches
    if free <= 0:
        raise ValueError(
            f"token generation cannot fit: the KV cache L*(C0+K0) = {L}*({C0}+{K0}) = "
            f"{L * (C0 + K0)} GB fills M ({M}) GB, leaving no room for weights (3)"
        )
    return max(1, _ceil(L * W0 / free))


def plan_disaggregation(
    D: int,
    Y: float,
    t: float,
    N: float,
    m: float,
    *,
    L: int | None = None,
    M: float | None = None,
    W0: float | None = None,
    C0: float | None = None,
    K0: float | None = None,
) -> DejaVuPlan:
    """Integer ``D_p + D_t == D`` minimizing ``I_dis = max(I_t, I_p)`` within limits (2) and (3).

    Rounding rule: ``D_t`` is ``floor`` or ``ceil`` of formula (1)'s ``D_t`` (the optimum of a max
    of a decreasing and an increasing function), clamped to ``[min_D_t, D - min_D_p]``; the one
    with the lower ``I_dis`` wins, ties going to the larger ``D_t``. Memory arguments are all
    given or all omitted; ``ValueError`` naming the limits when ``min_D_p + min_D_t > D``.
    """
    D_p_real, D_t_real = split_machines(D, Y, t, N, m)
    min_p, min_t = _memory_limits(L=L, M=M, W0=W0, C0=C0, K0=K0)
    if min_p + min_t > D:
        raise ValueError(
            f"{D} machines cannot hold both pipelines: prompt needs D_p >= {min_p} (2) "
            f"and tokens D_t >= {min_t} (3), {min_p + min_t} in all"
        )
    lo, hi = min_t, D - min_p
    D_t = _round_split(D, Y, t, N, m, [min(max(c, lo), hi) for c in _floor_ceil(D_t_real)])
    I_p, I_t = prompt_inverse_throughput(D, Y, m, D - D_t), token_inverse_throughput(D, t, N, D_t)
    I_c = baseline_inverse_throughput(D, Y, t, N)
    return DejaVuPlan(
        D=D,
        D_p=D - D_t,
        D_t=D_t,
        D_p_real=D_p_real,
        D_t_real=D_t_real,
        min_D_p=min_p,
        min_D_t=min_t,
        I_p=I_p,
        I_t=I_t,
        I_dis=max(I_p, I_t),
        I_ideal=m * Y + N * t,
        I_c=I_c,
        pays=disaggregation_pays(D, Y, t, m),
        plan_pays=max(I_p, I_t) < I_c,
    )


def best_split(D: int, Y: float, t: float, N: float, m: float, token_machines: list[int]) -> int:
    """The ``D_t`` among ``token_machines`` (splits a layout accepts) with the lowest
    ``I_dis = max(I_t, I_p)``; ties to the larger ``D_t``."""
    _check_workload(D, Y, t, N, m)
    if not token_machines or not all(0 < c < D for c in token_machines):
        raise ValueError(f"token machines must be a non-empty list within 1..{D - 1}, got {token_machines}")
    return _round_split(D, Y, t, N, m, token_machines)


def _round_split(D: int, Y: float, t: float, N: float, m: float, candidates: list[int]) -> int:
    """The candidate ``D_t`` with the lowest ``max(I_t, I_p)``; ties to the larger ``D_t``."""

    def cost(D_t: int) -> float:
        return max(token_inverse_throughput(D, t, N, D_t), prompt_inverse_throughput(D, Y, m, D - D_t))

    best = max(candidates)
    for c in candidates:
        if cost(c) < cost(best) and not math.isclose(cost(c), cost(best), rel_tol=_REL_TOL):
            best = c
    return best


def _memory_limits(**mem: float | None) -> tuple[int, int]:
    """``(min_D_p, min_D_t)`` from (2) and (3), or ``(1, 1)`` when no memory argument is given."""
    missing = [k for k, v in mem.items() if v is None]
    if len(missing) == len(mem):
        return 1, 1
    if missing:
        raise ValueError(
            f"memory limits need all of L, M, W0, C0, K0; missing {missing} "
            f"(given {[k for k, v in mem.items() if v is not None]})"
        )
    return (
        min_prompt_machines(mem["L"], mem["M"], mem["W0"], mem["C0"]),
        min_token_machines(mem["L"], mem["M"], mem["W0"], mem["C0"], mem["K0"]),
    )


def _floor_ceil(x: float) -> list[int]:
    return [math.floor(x), math.ceil(x)]


def _ceil(x: float) -> int:
    """``ceil`` that ignores float noise: ``_ceil(3 * (1 + 1e-15)) == 3``."""
    return math.ceil(x - _REL_TOL * max(1.0, abs(x)))


def _check_workload(D: int, Y: float, t: float, N: float, m: float) -> None:
    if not _is_int(D) or D < 2:
        raise ValueError(f"D (machines) must be an integer >= 2 to split, got {D!r}")
    for name, v in (("Y", Y), ("t", t), ("N", N)):
        if not _is_real(v) or not v > 0 or not math.isfinite(v):
            raise ValueError(f"{name} must be a positive finite number, got {v!r}")
    if not _is_real(m) or not m >= 1 or not math.isfinite(m):
        raise ValueError(f"m (prompt streaming overhead) must be a finite number >= 1, got {m!r}")


def _check_machines(D: int, **counts: int) -> None:
    for name, n in counts.items():
        if not _is_int(n) or not 1 <= n <= D - 1:
            raise ValueError(f"{name} must be an integer in [1, D-1] = [1, {D - 1}], got {n!r}")


def _check_memory(L: int, M: float, W0: float, C0: float, K0: float) -> None:
    if not _is_int(L) or L < 1:
        raise ValueError(f"L (layers) must be a positive integer, got {L!r}")
    if not _is_real(M) or not M > 0 or not math.isfinite(M):
        raise ValueError(f"M (GB per machine) must be a positive finite number, got {M!r}")
    for name, v in (("W0", W0), ("C0", C0), ("K0", K0)):
        if not _is_real(v) or not v >= 0 or not math.isfinite(v):
            raise ValueError(f"{name} (GB per layer) must be a finite number >= 0, got {v!r}")


def _is_int(x: object) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)

"""DejaVu's Appendix D planner: formula (1), limits (2)/(3), inverse throughputs (4), inequality (5)."""

import json
import math

import pytest

from reshard.parallel.cost.dejavu_planner import (
    DejaVuPlan,
    baseline_inverse_throughput,
    disaggregation_pays,
    min_prompt_machines,
    min_token_machines,
    plan_disaggregation,
    prompt_inverse_throughput,
    split_machines,
    token_inverse_throughput,
)


def test_split_machines_formula_1():
    # D=4, Y=10, t=1, N=10, m=1 (Figure 22: prompt 10x a token step): m*Y + N*t = 10 + 10 = 20
    # D_t = 4*10*1/20 = 2, D_p = 4*1*10/20 = 2
    assert split_machines(4, 10, 1, 10, 1) == (2.0, 2.0)
    # D=5, Y=30, t=2, N=20, m=1.2: m*Y = 36, N*t = 40, sum 76
    # D_p = 5*36/76 = 180/76, D_t = 5*40/76 = 200/76
    D_p, D_t = split_machines(5, 30, 2, 20, 1.2)
    assert D_p == pytest.approx(180 / 76) and D_t == pytest.approx(200 / 76)
    assert D_p + D_t == pytest.approx(5)


def test_inverse_throughputs():
    # (4): I_c = (D-1)(Y-t)/D + Y + N*t = 3*9/4 + 10 + 10 = 26.75
    assert baseline_inverse_throughput(4, 10, 1, 10) == pytest.approx(26.75)
    # I_t = N*D*t/D_t = 10*4*1/2 = 20; I_p = m*D*Y/D_p = 1.5*4*10/3 = 20
    assert token_inverse_throughput(4, 1, 10, 2) == pytest.approx(20)
    assert prompt_inverse_throughput(4, 10, 1.5, 3) == pytest.approx(20)


def test_baseline_matches_phase_sum():
    # (4) is (S1 + S2 + S3) / D with S1 = D*Y, S2 = (D-1)*Y, S3 = (N-1)*D*t + t
    D = 3
    Y = 7.0
    t = 0.5
    N = 12
    phases = (D * Y + (D - 1) * Y + (N - 1) * D * t + t) / D
    assert baseline_inverse_throughput(D, Y, t, N) == pytest.approx(phases)


def test_plan_figure_22_example():
    plan = plan_disaggregation(4, 10, 1, 10, 1)
    assert (plan.D_p, plan.D_t) == (2, 2)
    # I_t = I_p = m*Y + N*t = 20 < I_c = 26.75; (5): Y/t = 10 > (D-1)/(D*(2-m)-1) = 3/3 = 1
    assert plan.I_t == plan.I_p == plan.I_dis == plan.I_ideal == pytest.approx(20)
    assert plan.I_c == pytest.approx(26.75)
    assert plan.pays and plan.plan_pays
    assert (plan.min_D_p, plan.min_D_t) == (1, 1)


def test_rounding_minimizes_max_not_nearest():
    # D=10, Y=7, t=1, N=1, m=1: D_t = 10*1/(7+1) = 1.25, nearest integer 1
    # D_t=1: I_t = 1*10*1/1 = 10, I_p = 1*10*7/9 = 7.78 -> max 10
    # D_t=2: I_t = 10/2 = 5,      I_p = 70/8 = 8.75   -> max 8.75 (better)
    plan = plan_disaggregation(10, 7, 1, 1, 1)
    assert plan.D_t_real == pytest.approx(1.25)
    assert (plan.D_p, plan.D_t) == (8, 2)
    assert plan.I_dis == pytest.approx(8.75)


def test_rounding_second_example():
    # D=5, Y=30, t=2, N=20, m=1.2: D_t = 200/76 = 2.63
    # D_t=2: I_t = 20*5*2/2 = 100, I_p = 1.2*5*30/3 = 60 -> 100
    # D_t=3: I_t = 200/3 = 66.7,   I_p = 180/2 = 90     -> 90 (chosen)
    plan = plan_disaggregation(5, 30, 2, 20, 1.2)
    assert (plan.D_p, plan.D_t) == (2, 3)
    assert plan.I_dis == pytest.approx(90)
    assert plan.D_p + plan.D_t == plan.D == 5


def test_rounding_tie_goes_to_token_side():
    # D=3, Y=t=N=m=1: D_t = 3*1/(1+1) = 1.5
    # D_t=1: max(3/1, 3/2) = 3;  D_t=2: max(3/2, 3/1) = 3 -> tie, larger D_t
    plan = plan_disaggregation(3, 1, 1, 1, 1)
    assert (plan.D_p, plan.D_t) == (1, 2)


@pytest.mark.parametrize(
    "D,Y,t,N,m", [(2, 1, 100, 50, 1), (2, 100, 1, 1, 1.9), (64, 1, 1, 1000, 1.0), (64, 1000, 1, 1, 1.0)]
)
def test_extremes_keep_one_machine_each(D, Y, t, N, m):
    plan = plan_disaggregation(D, Y, t, N, m)
    assert plan.D_p >= 1 and plan.D_t >= 1 and plan.D_p + plan.D_t == D


def test_memory_limits_2_and_3():
    # L=40, W0=3, C0=1, K0=0.5, M=80
    # (2): ceil(40*(1+3)/80) = ceil(2) = 2
    # (3): 40*3 / (80 - 40*(1+0.5)) = 120/20 = 6
    assert min_prompt_machines(40, 80, 3, 1) == 2
    assert min_token_machines(40, 80, 3, 1, 0.5) == 6
    # (2): ceil(40*4/70) = ceil(2.29) = 3; (3): 120/(70-60) = 12
    assert min_prompt_machines(40, 70, 3, 1) == 3
    assert min_token_machines(40, 70, 3, 1, 0.5) == 12
    # a tiny model still needs one machine per pipeline
    assert min_prompt_machines(2, 80, 0.1, 0.1) == 1 and min_token_machines(2, 80, 0.1, 0.1, 0.1) == 1


def test_memory_ceil_ignores_float_noise():
    # 3*(0.1+0.2)/0.3 = 3.0000000000000004 in floats: 3 machines, not 4
    assert min_prompt_machines(3, 0.3, 0.1, 0.2) == 3


def test_memory_limit_overrides_formula_1():
    # D=8, Y=10, t=1, N=10, m=1: formula (1) gives D_t = 8*10/20 = 4
    # memory (as above): D_p >= 2, D_t >= 6 -> D_t clamped to 6, D_p = 2
    # I_t = 10*8*1/6 = 13.33, I_p = 1*8*10/2 = 40 -> I_dis = 40
    # I_c = 7*9/8 + 10 + 10 = 27.875: (5) says the real split pays, this forced split does not
    plan = plan_disaggregation(8, 10, 1, 10, 1, L=40, M=80, W0=3, C0=1, K0=0.5)
    assert plan.D_t_real == pytest.approx(4)
    assert (plan.D_p, plan.D_t, plan.min_D_p, plan.min_D_t) == (2, 6, 2, 6)
    assert plan.I_dis == pytest.approx(40) and plan.I_c == pytest.approx(27.875)
    assert plan.pays and not plan.plan_pays


def test_memory_infeasible():
    # D=7 < min_D_p + min_D_t = 2 + 6
    with pytest.raises(ValueError, match=r"D_p >= 2 .*D_t >= 6.*8 in all"):
        plan_disaggregation(7, 10, 1, 10, 1, L=40, M=80, W0=3, C0=1, K0=0.5)
    # (3): L*(C0+K0) = 40*1.5 = 60 >= M = 60: no room for weights
    with pytest.raises(ValueError, match=r"60\.0 GB fills M \(60\)"):
        plan_disaggregation(20, 10, 1, 10, 1, L=40, M=60, W0=3, C0=1, K0=0.5)


def test_memory_arguments_all_or_none():
    with pytest.raises(ValueError, match=r"missing \['C0', 'K0'\]"):
        plan_disaggregation(8, 10, 1, 10, 1, L=40, M=80, W0=3)


@pytest.mark.parametrize(
    "D,Y,t,m,pays",
    [
        (4, 10, 1, 1.0, True),  # threshold (D-1)/(D*(2-m)-1) = 3/3 = 1 < 10
        (4, 1, 1, 1.0, False),  # Y/t = 1 is not > 1
        (4, 4, 1, 1.5, True),  # threshold 3/(4*0.5-1) = 3 < 4: I_dis = 6+N < I_c = 9/4+4+N = 6.25+N
        (4, 3, 1, 1.5, False),  # Y/t = 3 == threshold: I_dis = 4.5+N == I_c = 6/4+3+N
        (10, 9.5, 1, 1.8, True),  # threshold 9/(10*0.2-1) = 9 < 9.5
        (10, 8.5, 1, 1.8, False),
        (4, 1000, 1, 1.9, False),  # D*(2-m)-1 = -0.6 <= 0: never pays
        (2, 1000, 1, 1.6, False),  # m < 2 is not enough: D*(2-m)-1 = -0.2 (needs m < 2 - 1/D)
        (8, 1000, 1, 2.0, False),  # m >= 2: never pays
    ],
)
def test_pays_inequality_5(D, Y, t, m, pays):
    assert disaggregation_pays(D, Y, t, m) is pays
    assert plan_disaggregation(D, Y, t, 7, m).pays is pays


def test_inequality_5_equals_direct_comparison():
    # (5) is I_ideal = m*Y + N*t < I_c rearranged; N cancels
    for D in (2, 3, 5, 16):
        for Y in (0.3, 1.7, 4.1, 30.0):
            for m in (1.0, 1.3, 1.55, 1.97):
                for N in (1, 9):
                    ideal, base = m * Y + N * 1.0, baseline_inverse_throughput(D, Y, 1.0, N)
                    if not math.isclose(ideal, base):
                        assert disaggregation_pays(D, Y, 1.0, m) is (ideal < base), (D, Y, m, N)


def test_as_dict_is_json():
    plan = plan_disaggregation(4, 10, 1, 10, 1)
    d = json.loads(json.dumps(plan.as_dict()))
    assert d["D_p"] == 2 and d["pays"] is True and set(d) == set(DejaVuPlan.__dataclass_fields__)


@pytest.mark.parametrize(
    "args,match",
    [
        ((1, 10, 1, 10, 1), r"D \(machines\) must be an integer >= 2 to split, got 1"),
        ((4.0, 10, 1, 10, 1), r"got 4\.0"),
        ((True, 10, 1, 10, 1), r"got True"),
        ((4, 0, 1, 10, 1), r"Y must be a positive finite number, got 0"),
        ((4, 10, -1, 10, 1), r"t must be .* got -1"),
        ((4, 10, 1, 0, 1), r"N must be .* got 0"),
        ((4, 10, 1, math.inf, 1), r"N must be .* got inf"),
        ((4, 10, 1, 10, 0.5), r"m \(prompt streaming overhead\) must be a finite number >= 1, got 0\.5"),
        ((4, 10, 1, 10, math.nan), r"got nan"),
    ],
)
def test_bad_workload(args, match):
    with pytest.raises(ValueError, match=match):
        plan_disaggregation(*args)


@pytest.mark.parametrize(
    "mem,match",
    [
        (dict(L=0, M=80, W0=1, C0=1, K0=1), r"L \(layers\) must be a positive integer, got 0"),
        (dict(L=4, M=0, W0=1, C0=1, K0=1), r"M \(GB per machine\) .* got 0"),
        (dict(L=4, M=80, W0=-1, C0=1, K0=1), r"W0 \(GB per layer\) must be a finite number >= 0, got -1"),
        (dict(L=4, M=80, W0=1, C0=1, K0=math.nan), r"K0 .* got nan"),
    ],
)
def test_bad_memory(mem, match):
    with pytest.raises(ValueError, match=match):
        plan_disaggregation(8, 10, 1, 10, 1, **mem)


def test_bad_machine_counts():
    with pytest.raises(ValueError, match=r"D_t must be an integer in \[1, D-1\] = \[1, 3\], got 4"):
        token_inverse_throughput(4, 1, 10, 4)
    with pytest.raises(ValueError, match=r"D_p must be .* got 0"):
        prompt_inverse_throughput(4, 10, 1, 0)

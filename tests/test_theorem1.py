"""Theorem 1 of §3.2 (stage information, arXiv 2605.10899) as an executable check.

Decision points h carry a probability, a compressed state c = phi(h), a stage label z and values
U(h, a). V_flat = E_c[max_a E[U | c]] and V_stage = E_{c,z}[max_a E[U | c, z]] are computed exactly
(rational arithmetic) by ss_grpo.theorem1_values; here we recompute them independently from the
conditional expectations and check V_stage >= V_flat, with strict inequality under the theorem's
condition (two stages of one compressed state with disjoint arg-max sets).
"""
from fractions import Fraction

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from ss_grpo import theorem1_condition, theorem1_values


@st.composite
def instances(draw, max_h=8, max_c=3, max_z=4, max_a=4):
    """Random finite instance: weights p (some zero), labels phi, z, integer-valued U."""
    h = draw(st.integers(1, max_h))
    n_a = draw(st.integers(1, max_a))
    p = draw(st.lists(st.integers(0, 4), min_size=h, max_size=h))
    assume(sum(p) > 0)
    phi = draw(st.lists(st.integers(0, max_c - 1), min_size=h, max_size=h))
    z = draw(st.lists(st.integers(0, max_z - 1), min_size=h, max_size=h))
    U = draw(st.lists(st.lists(st.integers(-3, 3), min_size=n_a, max_size=n_a),
                      min_size=h, max_size=h))
    return p, phi, z, U


def conditional_tables(p, phi, z, U):
    """Independent reference: P(c), P(z | c) and E[U(., a) | c, z] by explicit conditioning."""
    total = Fraction(sum(p))
    n_a = len(U[0])
    P_c, P_cz, EU_cz = {}, {}, {}
    for c in set(phi):
        P_c[c] = sum(Fraction(ph) for ph, c_ in zip(p, phi) if c_ == c) / total
        for s in set(z_ for c_, z_ in zip(phi, z) if c_ == c):
            idx = [i for i in range(len(p)) if phi[i] == c and z[i] == s]
            w = sum(Fraction(p[i]) for i in idx)
            P_cz[c, s] = w / total
            if w > 0:
                EU_cz[c, s] = [sum(Fraction(p[i]) * U[i][a] for i in idx) / w for a in range(n_a)]
    return P_c, P_cz, EU_cz, n_a


def reference_values(p, phi, z, U):
    P_c, P_cz, EU_cz, n_a = conditional_tables(p, phi, z, U)
    v_flat = Fraction(0)
    for c, pc in P_c.items():
        if pc == 0:
            continue
        # E[U | c] = sum_z P(z | c) E[U | c, z]
        eu_c = [sum(P_cz[c_, s] / pc * EU_cz[c_, s][a] for (c_, s) in EU_cz if c_ == c)
                for a in range(n_a)]
        v_flat += pc * max(eu_c)
    v_stage = sum(P_cz[k] * max(EU_cz[k]) for k in EU_cz)
    return v_flat, v_stage


def no_common_maximiser(p, phi, z, U):
    """True iff some c (P(c) > 0) has no action that is optimal for all its positive-probability
    stages: the exact condition for V_stage > V_flat (max of a sum < sum of maxes)."""
    _, _, EU_cz, n_a = conditional_tables(p, phi, z, U)
    for c in set(phi):
        sets = [{a for a in range(n_a) if EU_cz[k][a] == max(EU_cz[k])} for k in EU_cz if k[0] == c]
        if sets and not set.intersection(*sets):
            return True
    return False


@given(instances())
def test_theorem1_values_match_independent_conditional_expectations(inst):
    assert theorem1_values(*inst) == reference_values(*inst)


@given(instances())
def test_theorem1_stage_value_never_below_flat(inst):
    v_flat, v_stage = theorem1_values(*inst)
    assert v_stage >= v_flat  # exact rational comparison


@given(instances())
def test_theorem1_condition_implies_strict_gap(inst):
    v_flat, v_stage = theorem1_values(*inst)
    if theorem1_condition(*inst):
        assert v_stage > v_flat
    # sharper: a gap exists iff some compressed state has no common maximiser across its stages
    assert (v_stage > v_flat) == no_common_maximiser(*inst)


@given(instances(max_c=2, max_z=3), st.integers(1, 3), st.integers(0, 1), st.data())
def test_theorem1_forced_aliasing_gives_strict_gap(inst, boost, c0, data):
    """Add two decision points in one compressed state c0, stages 'zA' and 'zB', whose values
    favour different actions by a margin larger than anything else: the condition holds."""
    p, phi, z, U = inst
    n_a = len(U[0])
    assume(n_a >= 2)
    a0 = data.draw(st.integers(0, n_a - 1))
    a1 = data.draw(st.integers(0, n_a - 1).filter(lambda a: a != a0))
    big = 1000 * boost
    row0 = [big if a == a0 else 0 for a in range(n_a)]
    row1 = [big if a == a1 else 0 for a in range(n_a)]
    inst2 = (p + [5, 5], phi + [c0, c0], z + ["zA", "zB"], U + [row0, row1])
    assert theorem1_condition(*inst2)
    v_flat, v_stage = theorem1_values(*inst2)
    assert v_stage > v_flat


def test_theorem1_perceptual_aliasing_worked_example():
    """One compressed state, two equally likely stages wanting different actions: a flat policy
    gets 1/2, a stage-aware one gets 1."""
    inst = ([1, 1], ["c", "c"], ["plan", "answer"], [[1, 0], [0, 1]])
    assert theorem1_values(*inst) == (Fraction(1, 2), Fraction(1))
    assert theorem1_condition(*inst)


def test_theorem1_no_gap_without_aliasing_and_zero_probability_stage():
    # each compressed state has one stage: the label adds nothing
    assert theorem1_values([1, 2], [0, 1], [0, 1], [[1, 0], [0, 1]]) == (Fraction(1), Fraction(1))
    # the second stage has probability 0: it cannot create a gap
    inst = ([1, 0], [0, 0], [0, 1], [[1, 0], [0, 1]])
    assert not theorem1_condition(*inst)
    v_flat, v_stage = theorem1_values(*inst)
    assert v_flat == v_stage == 1


def test_theorem1_condition_is_sufficient_not_necessary():
    """Three stages with pairwise-overlapping but jointly disjoint arg-max sets: the theorem's
    pairwise condition fails, yet V_stage > V_flat."""
    U = [[1, 1, 0], [0, 1, 1], [1, 0, 1]]  # arg-max sets {0,1}, {1,2}, {0,2}
    inst = ([1, 1, 1], [0, 0, 0], [0, 1, 2], U)
    assert not theorem1_condition(*inst)
    v_flat, v_stage = theorem1_values(*inst)
    assert (v_flat, v_stage) == (Fraction(2, 3), Fraction(1))


def test_theorem1_floats_are_converted_exactly():
    v_flat, v_stage = theorem1_values([0.25, 0.75], [0, 0], [0, 1], [[0.1, 0.0], [0.0, 0.3]])
    assert v_flat == Fraction(0.75) * Fraction(0.3)
    assert v_stage == Fraction(0.25) * Fraction(0.1) + Fraction(0.75) * Fraction(0.3)


@pytest.mark.parametrize("args, msg", [
    (([1], [0, 0], [0], [[1]]), "equal length"),
    (([], [], [], []), "non-empty"),
    (([1, 1], [0, 0], [0, 1], [[1, 2], [1]]), "same number of actions"),
    (([-1, 2], [0, 0], [0, 1], [[1], [1]]), "nonnegative"),
    (([0, 0], [0, 0], [0, 1], [[1], [1]]), "positive sum"),
])
def test_theorem1_rejects_invalid_instances(args, msg):
    with pytest.raises(ValueError, match=msg):
        theorem1_values(*args)

"""Tests of the windowed curriculum (train.py, §3.5: K = 3, windows of 2K steps, fresh batches with
"similar" retrieval then their replay with "exact" retrieval), the data order, and the configuration
checks that name the offending field."""
import pytest
from hypothesis import given, settings, strategies as st

import ss_grpo
from bank import curriculum
from hparams import CurriculumConfig
from backends.run.data import DataOrder
from backends.run.overrides import apply_overrides
from backends.run.config import validate_config
from backends.run.presets import full_preset, toy_preset


# ---------------------------------------------------------------------------------------------------
# §3.5 windowed curriculum


def test_curriculum_k3_schedule_matches_paper_sec3_5():
    # PAPER §3.5 (1-based): steps 1-3 fresh B1..B3 "similar", steps 4-6 replay B1..B3 "exact".
    expected = [(0, "similar"), (1, "similar"), (2, "similar"), (0, "exact"), (1, "exact"), (2, "exact"),
                (3, "similar"), (4, "similar"), (5, "similar"), (3, "exact"), (4, "exact"), (5, "exact"),
                (6, "similar")]
    assert [curriculum(s, K=3) for s in range(13)] == expected
    assert CurriculumConfig().K == 3 and CurriculumConfig().enabled


@settings(max_examples=40)
@given(K=st.integers(1, 8), windows=st.integers(1, 6))
def test_each_batch_appears_twice_similar_then_exact_k_steps_apart_sec3_5(K, windows):
    n_steps = 2 * K * windows
    seen = {}
    for s in range(n_steps):
        b, mode = curriculum(s, K=K)
        assert mode in ("similar", "exact")
        seen.setdefault(b, []).append((s, mode))
    # Every batch 0 .. K*windows-1 is used, each exactly twice: first "similar", then "exact",
    # exactly K steps later (the gap that lets the reflection of the first pass reach the bank).
    assert sorted(seen) == list(range(K * windows))
    for b, occ in seen.items():
        assert [m for _, m in occ] == ["similar", "exact"]
        assert occ[1][0] - occ[0][0] == K
    # Fresh batches are drawn in order.
    fresh = [curriculum(s, K=K)[0] for s in range(n_steps) if curriculum(s, K=K)[1] == "similar"]
    assert fresh == list(range(K * windows))


@given(step=st.integers(0, 10 ** 6), K=st.integers(1, 10))
def test_curriculum_replay_never_precedes_first_pass_sec3_5(step, K):
    b, mode = curriculum(step, K=K)
    assert b >= 0
    if mode == "exact":
        assert curriculum(step - K, K=K) == (b, "similar")
    else:
        assert curriculum(step + K, K=K) == (b, "exact")


@given(step=st.integers(0, 10 ** 6))
def test_curriculum_disabled_draws_fresh_similar_batches_sec3_5(step):
    assert curriculum(step, K=3, enabled=False) == (step, "similar")


# ---------------------------------------------------------------------------------------------------
# Data order


@settings(max_examples=40)
@given(n=st.integers(1, 60), P=st.integers(1, 16), seed=st.integers(0, 1000))
def test_data_order_is_deterministic_and_covers_every_query_per_epoch_sec3_5(n, P, seed):
    a, b = DataOrder(n, P, seed), DataOrder(n, P, seed)
    n_batches = -(-2 * n // P) + 1  # more than two epochs
    flat = [i for j in range(n_batches) for i in a.batch(j)]
    assert flat == [i for j in range(n_batches) for i in b.batch(j)]
    assert all(len(a.batch(j)) == P for j in range(3))
    assert all(0 <= i < n for i in flat)
    # Position p of the stream is query perm_epoch[p mod n]: each epoch is a permutation.
    for e in range(2):
        assert sorted(flat[e * n:(e + 1) * n]) == list(range(n))


def test_data_order_depends_on_seed_and_reshuffles_per_epoch_sec3_5():
    n, P = 40, 8
    o0, o1 = DataOrder(n, P, 0), DataOrder(n, P, 1)
    first0 = [i for j in range(5) for i in o0.batch(j)]
    second0 = [i for j in range(5, 10) for i in o0.batch(j)]
    first1 = [i for j in range(5) for i in o1.batch(j)]
    assert first0 != first1
    assert first0 != second0 and sorted(first0) == sorted(second0) == list(range(n))


# ---------------------------------------------------------------------------------------------------
# Configuration checks name the field


def test_presets_are_valid_sec3_3():
    validate_config(toy_preset())
    f = full_preset()
    with pytest.raises(ValueError, match="--model"):  # full mode trains a given (SFT) checkpoint
        validate_config(f)
    f.model = "/models/qwen3-8b-sft"
    validate_config(f)
    assert toy_preset().ss_grpo.lam == [list(r) for r in ss_grpo.PAPER_LAMBDA]


def _cfg(**changes):
    c = toy_preset()
    for path, v in changes.items():
        obj = c
        parts = path.split("__")
        for p in parts[:-1]:
            obj = getattr(obj, p)
        setattr(obj, parts[-1], v)
    return c


@pytest.mark.parametrize("changes, field", [
    ({"ss_grpo__lam": [[1, 0, 0, 0], [0.5, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]}, "ss_grpo.lam"),
    ({"ss_grpo__lam": [[1, 0.4, 0.6], [0, 1, 0.4], [0, 0, 1]]}, "ss_grpo.lam"),
    ({"ss_grpo__lam": [[1, 0, 0, 0], [0, 2, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]}, "ss_grpo.lam"),
    ({"ss_grpo__lam": [[1, 0, 0], [0, 1, 0]]}, "ss_grpo.lam"),
    ({"judge__caps": [3, 2, 2]}, "judge.caps"),
    ({"judge__caps": [3, 2, 2, 3, 1]}, "judge.caps"),
    ({"arm": "flat"}, "arm"),
    ({"ss_grpo__agg": "sum"}, "ss_grpo.agg"),
    ({"rollout__n": 1}, "rollout.n"),
    ({"rollout__n": 0}, "rollout.n"),
    ({"rollout__prompts_per_step": 0}, "prompts_per_step"),
])
def test_validate_config_error_names_the_field_sec3_3(changes, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        validate_config(_cfg(**changes))


def test_apply_overrides_sets_known_fields_sec3_5():
    c = apply_overrides(toy_preset(), ["ss_grpo.lr=1e-4", "rollout.n=4", "curriculum.K=2",
                                       "arm=baseline_rl", "judge.caps=[1,1,1,1]"])
    assert c.ss_grpo.lr == 1e-4 and c.rollout.n == 4 and c.curriculum.K == 2
    assert c.arm == "baseline_rl" and c.judge.caps == [1, 1, 1, 1]
    validate_config(c)


@pytest.mark.parametrize("item", ["ss_grpo.nope=1", "nope.lr=1", "nope=1", "rollout.n.x=2"])
def test_apply_overrides_rejects_unknown_fields_sec3_5(item):
    key = item.split("=")[0]
    with pytest.raises(ValueError, match="unknown config field") as e:
        apply_overrides(toy_preset(), [item])
    assert key in str(e.value)


def test_apply_overrides_rejects_items_without_value_sec3_5():
    with pytest.raises(ValueError, match="key=value"):
        apply_overrides(toy_preset(), ["ss_grpo.lr"])

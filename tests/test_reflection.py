"""The reflection branch of Algorithm 1 (§3.4, §3.5): one reflection job per query of the step, all
P x m candidates in one batched sampler call, one bank entry per query, P GRPO groups of m, and
exact retrieval that finds those entries when the batch is replayed."""
import json
import random

import numpy as np
import pytest

from toy import sft
import toyfix as tf
from bank import RubricBank
from judge import ReflectionScore
from reflection import pick_trajectories, run_reflection_branch
from hparams import ReflectionConfig
from runfix import fast_args, metric_rows

import train

from backends.run import build

from backends.run import config as settings

from backends.run import presets


from backends.run import torch_engine

LESSON = "Lesson: search every asked aspect with the full name; cite a snippet for every claim."


class CountingStub:
    """A Sampler that records its calls and answers candidate c of a call with a distinct lesson."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def generate(self, prompts, max_new_tokens, temperature):
        self.calls.append((len(prompts), temperature))
        return [tf.encode(self.tok, f"{LESSON} Variant {c}.<|im_end|>") for c in range(len(prompts))]


class AdmittingJudge:
    """Privileged-judge stand-in: candidate j of every trajectory scores (j + 1) / (m + 1)."""

    def __init__(self):
        self.seen = []

    def score_reflections(self, query, rollout, judged, row, candidates):
        self.seen.append((query.query, row))
        m = len(candidates)
        return [ReflectionScore((j + 1) / (m + 1), (j + 1) / (m + 1), (j + 1) / (m + 1), "ok")
                for j in range(m)]


@pytest.fixture(scope="module")
def step_batch():
    """P = 3 queries x n = 2 scripted rollouts each (query-major, as the rollout engine returns)."""
    qs = list(tf.train_queries()[:3])
    ros = []
    for qi, q in enumerate(qs):
        for j, c in enumerate((tf.CLEAN_TEACHER, tf.mild_teacher(p_skip=1.0, p_tool_fail=0.0,
                                                                   p_defect=0.0))):
            ros.append(tf.replay(q, tf.policy_segments(tf.teacher(q, 10 * qi + j, c).segments))[0])
    return qs, ros


def test_pick_one_trajectory_per_query_uniformly_alg1():
    picks = pick_trajectories(12, 4, 1, random.Random(0))
    assert [p // 4 for p in picks] == [0, 1, 2]  # one per group, inside its group
    seen = {p % 4 for s in range(40) for p in pick_trajectories(12, 4, 1, random.Random(s))}
    assert seen == {0, 1, 2, 3}  # every member of a group can be drawn
    assert pick_trajectories(12, 4, 1, random.Random(7)) == pick_trajectories(12, 4, 1, random.Random(7))
    with pytest.raises(ValueError):
        pick_trajectories(10, 4, 1, random.Random(0))


def test_one_reflection_per_query_in_one_batched_call_alg1_sec3_4(step_batch):
    qs, ros = step_batch
    n, m, P = 2, 4, len(qs)
    tok = tf.tiny_tokenizer()
    judged = {i: (None, i % n) for i in range(len(ros))}
    sampler, judge, bank = CountingStub(tok), AdmittingJudge(), RubricBank()
    cfg = ReflectionConfig(m=m, max_new_tokens=64)
    batch, met = run_reflection_branch(0, ros, judged, judge, bank, sampler, tok, tf.SYSTEM, cfg,
                                       random.Random(0), group_size=n)
    # One sampler call for the whole step: P x m prompts at the reflection temperature.
    assert sampler.calls == [(P * m, cfg.temperature)]
    # One upsert per query: P bank entries, each the best candidate (the last one scores highest).
    assert len(bank) == P and met["reflect/admitted"] == P and met["reflect/trajectories"] == P
    for p, q in enumerate(qs):  # the stub numbers candidates over the flat call: p * m + j
        (e,) = bank.retrieve(q.query, "exact")
        assert e.reflection.endswith(f"Variant {p * m + m - 1}.") and e.score == pytest.approx(m / (m + 1))
    assert [q for q, _ in judge.seen] == [q.query for q in qs]
    # P GRPO groups of m, each normalised on its own.
    assert len(batch.sequences) == P * m and met["reflect/candidates"] == P * m
    A = np.array(batch.advantages).reshape(P, m)
    np.testing.assert_allclose(A.mean(1), 0.0, atol=1e-6)
    assert (np.diff(A, axis=1) > 0).all()
    for p in range(P):  # group p's prompt is the reflection prompt of a trajectory of query p
        prompt = tok.decode(batch.sequences[p * m][: batch.masks[p * m].index(1)])
        assert qs[p].query in prompt


class MarkingJudge(AdmittingJudge):
    """Scores like AdmittingJudge but marks the two best candidates of every trajectory invalid (as the
    toy judge does for degenerate, cut-off or off-topic text), with the highest scores."""

    def score_reflections(self, query, rollout, judged, row, candidates):
        out = super().score_reflections(query, rollout, judged, row, candidates)
        m = len(candidates)
        return [ReflectionScore(r.within, r.cross, r.score, "invalid: degenerate", valid=False)
                if j >= m - 2 else r for j, r in enumerate(out)]


def test_candidates_the_judge_marks_invalid_never_enter_the_bank_sec3_4(step_batch):
    """The best *valid* candidate is upserted: a high-scoring candidate marked invalid is skipped,
    counted, and keeps its score in the GRPO group; a trajectory whose candidates are all invalid
    adds nothing to the bank."""
    qs, ros = step_batch
    n, m = 2, 4
    tok = tf.tiny_tokenizer()
    judged = {i: (None, i % n) for i in range(len(ros))}
    bank = RubricBank()
    cfg = ReflectionConfig(m=m, max_new_tokens=64)
    batch, met = run_reflection_branch(0, ros, judged, MarkingJudge(), bank, CountingStub(tok), tok,
                                       tf.SYSTEM, cfg, random.Random(0), group_size=n)
    assert met["reflect/invalid"] == 2 * len(qs) and met["reflect/admitted"] == len(qs)
    for p, q in enumerate(qs):  # candidate m - 3 is the best valid one
        (e,) = bank.retrieve(q.query, "exact")
        assert e.reflection.endswith(f"Variant {p * m + m - 3}.")
    assert len(batch.sequences) == len(qs) * m  # invalid candidates still train (their low score)

    class AllInvalid(AdmittingJudge):
        def score_reflections(self, query, rollout, judged, row, candidates):
            return [ReflectionScore(1.0, 1.0, 1.0, "invalid: cut off", valid=False) for _ in candidates]

    bank2 = RubricBank()
    _, met2 = run_reflection_branch(0, ros, judged, AllInvalid(), bank2, CountingStub(tok), tok,
                                    tf.SYSTEM, cfg, random.Random(0), group_size=n)
    assert len(bank2) == 0 and met2["reflect/admitted"] == 0 and met2["reflect/invalid"] == len(qs) * m


class ReflectionTextSampler:
    """Wraps the run's sampler: rollouts pass through; reflection calls (temperature 0.7) are
    recorded and answered with a valid lesson, so the bank admission does not hinge on a 2-step SFT
    policy's text."""

    def __init__(self, inner, tok, log):
        self.inner, self.tok, self.log = inner, tok, log

    def __getattr__(self, name):  # the rest of the Sampler interface (stats, sync_weights, ...)
        return getattr(self.inner, name)

    def generate(self, prompts, max_new_tokens, temperature):
        self.log.append((len(prompts), temperature))
        if temperature == ReflectionConfig().temperature:
            ids = tf.encode(self.tok, LESSON + "<|im_end|>")
            return [ids[:b] for b in max_new_tokens]
        return self.inner.generate(prompts, max_new_tokens, temperature)


def patch_sampler(monkeypatch, log):
    orig = build.build_sampler
    monkeypatch.setattr(build, "build_sampler",
                        lambda cfg, model, tok: ReflectionTextSampler(orig(cfg, model, tok), tok, log))


@pytest.mark.slow
def test_replayed_batch_finds_each_querys_own_reflection_sec3_5(tmp_path, toy_cache, monkeypatch):
    """Curriculum K = 1: step 0 draws a fresh batch of 4 queries, step 1 replays it in exact mode."""
    calls = []
    patch_sampler(monkeypatch, calls)
    run = tmp_path / "run"
    assert train.main(fast_args(run, toy_cache, 2, "--set", "curriculum.K=1", "--set",
                                "rollout.prompts_per_step=4", "--set", "reflection.max_new_tokens=96",
                                "--set", "eval.n_questions=0")) == 0
    r0, r1 = metric_rows(run)
    assert r0["reflect/trajectories"] == 4 and r0["reflect/admitted"] == 4 and r0["bank/size"] == 4
    assert r1["retrieval/mode_exact"] == 1 and r1["retrieval/batch"] == r0["retrieval/batch"]
    assert r1["retrieval/hits"] >= 0.9
    assert sum(1 for _, t in calls if t == 0.7) == 2  # one batched reflection call per step
    assert [k for k, t in calls if t == 0.7] == [4 * 2, 4 * 2]  # P x m prompts each


@pytest.mark.slow
@pytest.mark.parametrize("at_temperature", [True, False])
def test_deferred_reflection_batch_joins_the_next_task_update_alg1(tmp_path, toy_cache,
                                                                   monkeypatch, at_temperature):
    """Algorithm 1: step t's reflection GRPO batch is applied at step t+1, in the same optimizer
    steps as that step's task batch (one update, after step t+1's rollouts, one sync): the task
    batch holds task sequences only, the joint batch reflection sequences only. Each part scores
    its sequences at the temperature they were sampled at (reflections 0.7, task rollouts 1.0),
    unless reflection.score_at_temperature is off (then the reflections at 1)."""
    events = []

    class Log(list):
        def append(self, call):
            super().append(call)
            events.append(("generate", call[1]))

    patch_sampler(monkeypatch, Log())
    update = torch_engine.TorchEngine.update
    temps = []

    def logged(self, batch, pad_id, rng, joint=None):
        j = joint if joint is not None and joint.ids else None
        events.append(("update", tuple(sorted(set(batch.kind))), len(batch.ids),
                       tuple(sorted(set(j.kind))) if j else (), len(j.ids) if j else 0))
        temps.append((batch.temperature, j.temperature if j else None))
        return update(self, batch, pad_id, rng, joint)

    monkeypatch.setattr(torch_engine.TorchEngine, "update", logged)
    run = tmp_path / "run"
    assert train.main(fast_args(run, toy_cache, 2, "--set", "reflection.max_new_tokens=96",
                                "--set", "eval.n_questions=0", "--set",
                                f"reflection.score_at_temperature={str(at_temperature).lower()}")) == 0
    P, n, m = 2, 2, 2
    updates = [e for e in events if e[0] == "update"]
    assert updates == [("update", ("task",), P * n, (), 0),
                       ("update", ("task",), P * n, ("reflection",), P * m)]
    # rollout.temperature; reflection.temperature (the paper's 0.7), or 1 with the option off
    assert temps == [(1.0, None), (1.0, 0.7 if at_temperature else 1.0)]
    # Step 1: its rollouts come first, then the one update with step 0's reflection batch.
    i_joint = events.index(updates[1])
    first_refl_gen = next(i for i, e in enumerate(events) if e == ("generate", 0.7))
    assert first_refl_gen < i_joint  # step 0's reflections were sampled first
    step1_rollouts = [i for i, e in enumerate(events) if e == ("generate", 1.0) and i > first_refl_gen]
    assert step1_rollouts and max(step1_rollouts) < i_joint  # then step 1's rollouts, then the update
    r0, r1 = metric_rows(run)
    assert r0["update/reflection_seqs"] == 0 and r1["update/reflection_seqs"] == P * m
    # every metrics line carries every key; a step without a reflection batch logs null there
    assert r1["reflect/loss/total"] is not None and r0.get("reflect/loss/total") is None
    with open(run / "metrics.jsonl") as fh:  # the reflection passes' seconds, apart from the task's
        t0, t1 = [json.loads(x) for x in fh]
    assert t0["time/reflection_update_s"] is None and t1["time/reflection_update_s"] > 0


def test_reflection_update_advantages_scaled_by_loss_coef_sec3_4():
    """The deferred reflection batch gives every reflection token c * A_j (c =
    reflection.loss_coef), the trajectory context 0, at the candidates' temperature; c must be a
    finite number >= 0."""
    from reflection import ReflectionBatch

    pend = ReflectionBatch(0, sequences=[[1, 2, 3, 4], [1, 2, 5]], masks=[[0, 0, 1, 1], [0, 0, 1]],
                           advantages=[1.5, -1.5], scores=[0.9, 0.1])
    for c in (1.0, 0.25, 0.0):
        rb = train.reflection_update_batch(pend, c)
        assert rb.adv == [[0.0, 0.0, 1.5 * c, 1.5 * c], [0.0, 0.0, -1.5 * c]]
        assert rb.kind == ["reflection", "reflection"] and rb.ids == pend.sequences
    assert train.reflection_update_batch(pend, 1.0, 0.7).temperature == 0.7
    assert train.reflection_update_batch(ReflectionBatch(0), 1.0).ids == []
    cfg = presets.toy_preset()
    for bad in (-0.1, float("inf"), float("nan"), True, "1"):
        cfg.reflection.loss_coef = bad
        with pytest.raises(ValueError, match="reflection.loss_coef"):
            settings.validate_config(cfg)


def test_a_long_trajectory_is_cut_in_the_middle_to_fit_the_reflection_prompt(step_batch):
    from reflection import reflection_prompt_ids

    _, ros = step_batch
    tok, ro = tf.tiny_tokenizer(), ros[0]
    full = reflection_prompt_ids(tok, ro.query.query, ro, tf.SYSTEM)
    assert reflection_prompt_ids(tok, ro.query.query, ro, tf.SYSTEM, 0) == full  # 0: no limit
    assert reflection_prompt_ids(tok, ro.query.query, ro, tf.SYSTEM, len(full)) == full  # fits
    cap = len(full) - 60
    cut = reflection_prompt_ids(tok, ro.query.query, ro, tf.SYSTEM, cap)
    assert len(cut) <= cap
    text, traj = tok.decode(cut), ro.judge_text.replace("<|im_end|>", "")
    assert "tokens of the attempt left out" in text and ro.query.query in text
    assert "<structured_plan>" in text and "</answer>" in text  # the plan and the answer survive
    assert traj not in text
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        reflection_prompt_ids(tok, ro.query.query, ro, tf.SYSTEM, 20)  # not even the instruction


def test_the_full_preset_leaves_the_reflection_room_in_the_context():
    c = presets.full_preset()
    context = c.full.max_prompt_tokens + c.rollout.max_response_tokens  # PAPER: 26,624
    assert context == 26624
    assert c.reflection.max_prompt_tokens + c.reflection.max_new_tokens == context
    assert presets.toy_preset().reflection.max_prompt_tokens == 0  # toy trajectories are short


def test_the_reflection_branch_samples_from_prompts_within_the_cap(step_batch):
    qs, ros = step_batch
    tok, n, m = tf.tiny_tokenizer(), 2, 2
    judged = {i: (None, i % n) for i in range(len(ros))}
    longest = max(len(tok.encode(r.judge_text)) for r in ros)
    cfg = ReflectionConfig(m=m, max_new_tokens=16, max_prompt_tokens=longest // 2)
    batch, _ = run_reflection_branch(0, ros, judged, AdmittingJudge(), RubricBank(), CountingStub(tok),
                                     tok, tf.SYSTEM, cfg, random.Random(0), group_size=n)
    prompts = [s[: mk.index(1)] for s, mk in zip(batch.sequences, batch.masks)]
    assert len(prompts) == len(qs) * m and max(map(len, prompts)) <= cfg.max_prompt_tokens

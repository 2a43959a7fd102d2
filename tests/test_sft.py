"""Tests of the SFT warm start (toy/sft.py, appendix): the scripted teacher, the paper's four SFT filters,
masked example encoding (prompt and <tool_output> spans get no loss, §3.3), and the warm-start cache."""
import json

import pytest
import torch


from toy import model as toy_model
import reflection
import scaffold
from toy import sft
from scaffold import CALL_OPEN, format_tool_error
from toy.sft import encode_example, encode_examples, sft_filter

import toyfix as tf
from toyfix import one_thread, tok  # noqa: F401  (module fixtures)


@pytest.fixture(scope="module")
def queries():
    return tf.train_queries()


@pytest.fixture(scope="module")
def good(queries):
    """A clean teacher trajectory with at least two tool calls."""
    for i, q in enumerate(queries):
        tr = tf.teacher(q, i, tf.PERFECT_TEACHER)
        if sum(e for e, _ in tr.segments) >= 2:
            return tr.segments
    raise AssertionError("no teacher trajectory with two calls")


def _replace(segments, old, new, only_policy=True):
    return [(e, t if (e and only_policy) else t.replace(old, new)) for e, t in segments]


# ---------------------------------------------------------------------------------------------------
# The four SFT filters (appendix)


def test_sft_filter_keeps_a_good_teacher_trajectory_appendix(good):
    assert sft_filter(good) is None


def test_sft_filter_1_drops_trajectory_without_closing_answer_appendix(good):
    assert sft_filter(_replace(good, "</answer>", "")) == "no_closing_answer"
    # A teacher answer cut in half (the truncation defect) is dropped the same way.
    cut = list(good)
    cut[-1] = (False, cut[-1][1][: cut[-1][1].index("</answer>") - 3])
    assert sft_filter(cut) == "no_closing_answer"


@pytest.mark.parametrize("bad_call", [
    '<call_tool name="web_browse">Harta year</call_tool>',  # not the search tool
    f"{CALL_OPEN}   </call_tool>",  # empty query
    "Harta year",  # no call at all
    f"{CALL_OPEN}Harta year</call_tool> and then more text",  # the turn does not end in the call
])
def test_sft_filter_2_drops_non_final_turn_without_valid_call_appendix(good, bad_call):
    segs = list(good)
    text = segs[0][1]
    start = text.index(CALL_OPEN)
    segs[0] = (False, text[:start] + bad_call)
    assert segs[1][0]  # the turn is followed by a tool output: it is non-final
    assert sft_filter(segs) == "non_final_turn_without_valid_call"


@pytest.mark.parametrize("tag", ["<structured_plan>", "</structured_plan>", "<state_evaluation>",
                                 "<review>", "</review>", "<answer>"])
def test_sft_filter_3_drops_trajectory_missing_a_required_tag_appendix(good, tag):
    assert sft_filter(_replace(good, tag, "")) == "missing_required_tag"


def test_sft_filter_3_state_evaluation_only_required_with_tool_calls_appendix(good):
    final = [(False, "<structured_plan>p</structured_plan><review>r</review><answer>a</answer>")]
    assert sft_filter(final) is None


def test_sft_filter_4_drops_two_consecutive_tool_errors_appendix(good):
    env = [j for j, (e, _) in enumerate(good) if e]
    err = format_tool_error("search failed")
    one = list(good)
    one[env[0]] = (True, err)
    assert sft_filter(one) is None  # a single tool error is kept
    two = list(one)
    two[env[1]] = (True, err)
    assert sft_filter(two) == "consecutive_tool_errors"
    if len(env) >= 3:
        apart = list(good)
        apart[env[0]] = apart[env[2]] = (True, err)
        assert sft_filter(apart) is None  # errors separated by a success are not consecutive


def test_teacher_that_always_fails_its_tool_is_dropped_by_filter_4_appendix(queries):
    tr = tf.teacher(queries[0], 0, tf.mild_teacher(p_tool_fail=1.0, p_defect=0.0))
    assert sft_filter(tr.segments) == "consecutive_tool_errors"


def test_teacher_defects_are_caught_by_the_matching_filter_appendix(queries):
    expected = {"invalid call": "non_final_turn_without_valid_call",
                "missing review": "missing_required_tag",
                "truncated answer": "no_closing_answer"}
    seen = set()
    cfg = tf.mild_teacher(p_defect=0.3, p_tool_fail=0.0)
    for i in range(60):
        tr = tf.teacher(queries[i % len(queries)], 1000 + i, cfg)
        kind = tr.defects.get("_kind")
        reason = sft_filter(tr.segments)
        if kind is None:
            assert reason is None, (tr.defects, reason)
        else:
            seen.add(kind)
            assert reason == expected[kind], (kind, reason)
    assert seen == set(expected)


def test_teacher_trajectories_pass_sft_filter_without_defects_appendix(queries):
    cfg = tf.mild_teacher(p_defect=0.0, p_tool_fail=0.0)  # other imperfections stay on
    for seed in range(2):
        for i, q in enumerate(queries):
            tr = tf.teacher(q, seed * 1000 + i, cfg)
            assert sft_filter(tr.segments) is None, (q.query, tr.defects)
            assert "_kind" not in tr.defects
            # Policy and environment turns alternate, starting and ending with the policy.
            kinds = [e for e, _ in tr.segments]
            assert kinds[0] is False and kinds[-1] is False
            assert all(a != b for a, b in zip(kinds, kinds[1:]))


# ---------------------------------------------------------------------------------------------------
# Teacher memory (§3.4: what a bank item is for)


def test_memory_missed_parses_fact_keys_sec3_4():
    items = ["missed: Harta year, Kuvebro use. Lesson: search every asked aspect.", "no facts here",
             "missed: Lomi habitat; Lesson: cite."]
    assert sft.memory_missed(items) == {"Harta year", "Kuvebro use", "Lomi habitat"}


def test_teacher_with_memory_naming_a_missed_fact_does_not_skip_it_sec3_4(queries):
    q = next(q for q in queries if len(q.facts) >= 3)
    keys = [sft.fact_key(f) for f in q.facts]
    skipper = tf.mild_teacher(p_skip=1.0, p_vague=0.0, p_tool_fail=0.0, p_defect=0.0)
    base = tf.teacher(q, 0, skipper)
    assert all(base.defects.get(k) == "skipped" for k in keys[1:])  # all but the first are skipped
    reflection = sft.teacher_reflection(q, base)
    assert all(k in reflection for k in keys[1:])
    # A memory that names one missed fact: that fact is searched and answered, the rest still skipped.
    tr = tf.teacher(q, 0, skipper, memory=[f"missed: {keys[1]}. Lesson: search every asked aspect."])
    text = "".join(t for _, t in tr.segments)
    assert tr.defects.get(keys[1]) != "skipped"
    assert f"{CALL_OPEN}{keys[1]}</call_tool>" in text
    assert f"search {keys[1]}" in text
    assert all(tr.defects.get(k) == "skipped" for k in keys[2:])
    # The teacher's own reflection, used as memory: none of the facts it names is skipped again.
    tr2 = tf.teacher(q, 0, skipper, memory=[reflection])
    assert not any(tr2.defects.get(k) == "skipped" for k in keys[1:])
    assert all(f"{CALL_OPEN}{k}</call_tool>" in "".join(t for _, t in tr2.segments) for k in keys[1:])
    assert sft_filter(tr2.segments) is None


# ---------------------------------------------------------------------------------------------------
# Encoding: prompt and tool outputs masked (§3.3, appendix "span masking of <tool_output>")


def _example(q, seed, memory=()):
    tr = tf.teacher(q, seed, memory=memory)
    return scaffold.build_messages(q.query, list(memory), tf.SYSTEM), tr.segments


def _prompt_ids(tok, msgs):
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_encode_example_masks_prompt_and_env_segments_appendix(tok, queries):
    msgs, segs = _example(queries[0], 0)
    ids, mask = encode_example(tok, msgs, segs)
    prompt = _prompt_ids(tok, msgs)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    assert ids[: len(prompt)] == prompt and mask[: len(prompt)] == [0] * len(prompt)
    pos = len(prompt)
    for is_env, text in segs:
        seg = tok.encode(text, add_special_tokens=False)
        assert ids[pos: pos + len(seg)] == seg
        assert mask[pos: pos + len(seg)] == [0 if is_env else 1] * len(seg)
        pos += len(seg)
    assert pos == len(ids)
    taught = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert taught == "".join(t for e, t in segs if not e)
    assert "<tool_output>" not in taught
    # The supervised text ends the turn: the model learns to stop.
    assert ids[-1] == tok.convert_tokens_to_ids("<|im_end|>") and mask[-1] == 1


def test_encode_example_matches_rollout_token_layout_sec3_1(tok, queries):
    """SFT examples are tokenised exactly as the rollout engine builds them (same ids, same mask)."""
    q = queries[0]
    msgs, segs = _example(q, 0)
    ids, mask = encode_example(tok, msgs, segs)
    ro, _ = tf.replay(q, tf.policy_segments(segs), tok=tok)
    assert ids == ro.prompt_ids + ro.response_ids
    assert mask == [0] * len(ro.prompt_ids) + ro.loss_mask


def test_encode_examples_equals_encode_example_appendix(tok, queries):
    exs = [_example(q, i, memory=(["missed: Harta year. Lesson: cite."] if i % 2 else []))
           for i, q in enumerate(queries[:8])]
    tr = tf.teacher(queries[0], 0)
    traj = "".join(t for _, t in tr.segments).replace("<|im_end|>", "")
    exs.append((reflection.reflection_messages(queries[0].query, traj, tf.SYSTEM),
                [(False, sft.teacher_reflection(queries[0], tr) + "<|im_end|>")]))
    batched = encode_examples(tok, exs)
    assert len(batched) == len(exs)
    for (m, s), b in zip(exs, batched):
        assert b == encode_example(tok, m, s)


# ---------------------------------------------------------------------------------------------------
# Warm-start cache


def test_warm_start_trains_once_then_loads_from_cache_appendix(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    world = tf.tiny_world()
    cfg = sft.SFTConfig(n_trajectories=6, n_reflections=2, steps=2, batch_size=4, warmup=1, seed=0)
    tcfg = tf.mild_teacher()
    args = (world, tf.tiny_tool(), tf.SYSTEM, cfg, tcfg, "XS", 300, str(tmp_path))
    loads, load = [], toy_model.load_policy
    monkeypatch.setattr(toy_model, "load_policy", lambda p, *a, **k: (loads.append(p), load(p, *a, **k))[1])
    m1, tok1, info1, path1 = sft.warm_start(*args, progress=False)
    assert info1["cached"] is False and info1["steps"] == 2
    # the run that trained continues from the saved copy, as a run that finds it cached does
    assert loads == [path1]
    assert info1["filter"]["kept"] == 6 and info1["examples"] == 6 + 2
    with open(f"{path1}/sft_info.json") as fh:
        assert json.load(fh)["key"] == info1["key"]

    def boom(*a, **k):
        raise AssertionError("the cached warm start must not train again")

    monkeypatch.setattr(sft, "train_sft", boom)
    monkeypatch.setattr(sft, "build_sft_data", boom)
    m2, tok2, info2, path2 = sft.warm_start(*args, progress=False)
    assert info2["cached"] is True and path2 == path1 and info2["key"] == info1["key"]
    assert loads == [path1, path1] and type(tok2) is type(tok1)
    assert tok2.get_vocab() == tok1.get_vocab()
    sd1, sd2 = m1.state_dict(), m2.state_dict()
    assert sd1.keys() == sd2.keys()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    # A different configuration has a different key (it would train).
    other = sft.cache_key({"world": 0, "sft": 1})
    assert other != sft.cache_key({"world": 0, "sft": 2})
    with pytest.raises(AssertionError, match="must not train"):
        sft.warm_start(world, tf.tiny_tool(), tf.SYSTEM,
                       sft.SFTConfig(n_trajectories=6, n_reflections=2, steps=3, batch_size=4),
                       tcfg, "XS", 300, str(tmp_path), progress=False)


def test_warm_start_is_shared_by_rl_seeds_and_ignores_global_rng_appendix(tmp_path, monkeypatch):
    # The SFT policy depends on sft.seed only: a run with another --seed (which seeds the global
    # generators first) must find the same cached warm start instead of training an identical one.
    from backends.run import build, presets
    import train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    world = tf.tiny_world()
    cfgs = []
    for seed in (0, 1):
        c = presets.toy_preset()
        c.seed, c.cache_dir, c.progress = seed, str(tmp_path), False
        c.toy_model.size, c.toy_model.vocab_size = "XS", 300
        c.world = tf.TINY
        c.sft = sft.SFTConfig(n_trajectories=6, n_reflections=2, steps=2, batch_size=4, warmup=1)
        cfgs.append(c)
    train.seed_everything(0)
    m0, _, info0 = build.setup_policy(cfgs[0], world, tf.tiny_tool())
    # trained from scratch in another cache dir under other global seeds: the same weights
    train.seed_everything(123)
    m_other, _, _, _ = sft.warm_start(world, tf.tiny_tool(), tf.SYSTEM, cfgs[1].sft, cfgs[1].teacher,
                                      "XS", 300, str(tmp_path / "other"), progress=False)
    sd0, sd1 = m0.state_dict(), m_other.state_dict()
    assert all(torch.equal(sd0[k], sd1[k]) for k in sd0)
    train.seed_everything(1)
    _, _, info1 = build.setup_policy(cfgs[1], world, tf.tiny_tool())
    assert info0["cached"] is False and info1["cached"] is True
    assert info1["source"] == info0["source"]

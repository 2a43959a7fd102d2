"""The paper's SFT recipe (appendix) in sft.py and its scale plumbing: the four filters on hand-made
trajectories, the conversions, DR Tulu's tool names, the tool-output loss mask, the shared filter of
the toy SFT, length bucketing and the schedule, the teacher's budget cap / resume / dry run, and the
SFT memory plan."""
import json
import math

import pytest

import sft
from backends.sft import pack as sft_pack
from scaffold import CALL_OPEN, format_tool_error, format_tool_output, SearchResult
import toyfix as tf  # noqa: E402

PLAN = ("<structured_plan><analysis>a</analysis><rubrics>need: x</rubrics><research_plan>s"
        "</research_plan></structured_plan>\n")
OUT = format_tool_output([SearchResult("d1", "T", "the fact is 7")], 1)
ERR = format_tool_error("search failed")
FINAL = ("<state_evaluation>x is 7 [1]</state_evaluation>\n<review><rubrics_review>x: [1]</rubrics_review>"
         "<writing_plan>one</writing_plan></review>\n<answer>x is 7 [1].</answer>")


def good():
    return [(False, PLAN + CALL_OPEN + "x</call_tool>"), (True, OUT), (False, FINAL)]


# ---- the four filters (appendix), each on a hand-made trajectory --------------------------------

def test_filters_keep_a_good_hand_made_trajectory_appendix():
    assert sft.sft_filter(good()) is None


def test_filter_1_no_closing_answer_appendix():
    segs = good()
    segs[-1] = (False, FINAL.replace("</answer>", ""))
    assert sft.sft_filter(segs) == "no_closing_answer"


def test_filter_2_non_final_turn_without_valid_call_appendix():
    segs = good()
    segs[0] = (False, PLAN + '<call_tool name="web_browse">x</call_tool>')
    assert sft.sft_filter(segs) == "non_final_turn_without_valid_call"
    segs[0] = (False, PLAN + "I will now search.")  # no call at all before a tool output
    assert sft.sft_filter(segs) == "non_final_turn_without_valid_call"


@pytest.mark.parametrize("tag", ["<structured_plan>", "</review>", "<state_evaluation>"])
def test_filter_3_missing_required_block_appendix(tag):
    segs = [(e, t.replace(tag, "")) for e, t in good()]
    assert sft.sft_filter(segs) == "missing_required_tag"


def test_filter_4_two_consecutive_tool_errors_appendix():
    call = (False, "<state_evaluation>retry</state_evaluation>\n" + CALL_OPEN + "x</call_tool>")
    one = [good()[0], (True, ERR), call, (True, OUT), (False, FINAL)]
    assert sft.sft_filter(one) is None
    two = [good()[0], (True, ERR), call, (True, ERR), call, (True, OUT), (False, FINAL)]
    assert sft.sft_filter(two) == "consecutive_tool_errors"


def test_filter_and_convert_counts_every_filter_in_stats_appendix():
    bad1 = [(e, t.replace("</answer>", "")) for e, t in good()]
    bad3 = [(e, t.replace("<review>", "")) for e, t in good()]
    recs = [{"query": "q", "segments": s} for s in (good(), bad1, bad3)] + [{"segments": good()}]
    ex, st = sft.filter_and_convert(recs)
    assert (st["trajectories"], st["kept"], st["malformed"]) == (4, 1, 1)
    assert st["no_closing_answer"] == st["missing_required_tag"] == 1
    assert st["non_final_turn_without_valid_call"] == st["consecutive_tool_errors"] == 0
    assert [m["role"] for m in ex[0]["messages"]] == ["system", "user", "assistant"]  # single-turn ChatML


# ---- conversions and DR Tulu's tool names -----------------------------------------------------

def test_conversion_scratchpad_becomes_think_appendix():
    assert sft.scratchpad_to_think("<scratchpad>r</scratchpad> <SCRATCHPAD>s</ scratchpad>") == \
        "<think>r</think> <think>s</think>"


@pytest.mark.parametrize("name", ["snippet_search", "browse_webpage", "google_search", "Google-Search",
                                  "web_search"])
def test_conversion_normalises_dr_tulu_tool_names_onto_the_search_tool_appendix(name):
    text = PLAN + f'<call_tool name="{name}">x</call_tool>'
    assert sft.normalise_tool_names(text) == PLAN + CALL_OPEN + "x</call_tool>"
    segs = [(False, text), (True, OUT), (False, FINAL)]
    assert sft.sft_filter(segs) in (None, "non_final_turn_without_valid_call")
    assert sft.sft_filter(sft.convert_segments(segs)) is None  # kept once normalised


def test_conversion_leaves_unknown_tools_and_tool_outputs_alone():
    segs = [(False, '<call_tool name="web_browse">x</call_tool>'), (True, "<tool_output><scratchpad>"
                                                                        "</tool_output>")]
    assert sft.convert_segments(segs) == segs


def test_dr_tulu_tool_calls_reach_the_search_tool_in_the_teacher():
    from backends.sft.teacher import Teacher, TeacherConfig

    seen = []

    class Tool:
        def __call__(self, q):
            seen.append(q)
            return [SearchResult("d", "t", "s")]

    turns = iter(['<call_tool name="snippet_search">alpha', '<call_tool name="browse_webpage">http://x',
                  "<answer>a [1].</answer>"])
    t = Teacher(TeacherConfig(backend="openai", model="m"), Tool(), tool_names=sft.TOOL_ALIASES)
    t.continue_ = lambda system, turns_: next(turns)
    tr = t.trajectory("q")
    assert seen == ["alpha", "http://x"] and tr["tool_calls"] == 2
    assert all("unknown tool" not in s for e, s in tr["segments"] if e)


# ---- the toy SFT uses the same filter --------------------------------------------------------

def test_toy_sft_calls_the_shared_filter_and_keeps_its_counts():
    from toy import sft as toy_sft
    from toyfix import SYSTEM, tiny_tool, tiny_world

    assert toy_sft.sft_filter is sft.sft_filter
    cfg = toy_sft.SFTConfig(n_trajectories=300, n_reflections=0)
    tc = tf.mild_teacher(p_defect=0.2, p_tool_fail=0.3)
    _, stats = toy_sft.build_sft_data(tiny_world(), tiny_tool(), SYSTEM, cfg, tc)
    # Reference counts of the toy filter before it moved to sft.py (same seed, same teacher).
    assert stats == REFERENCE_TOY_COUNTS


# The toy filter's counts for this teacher and seed. Measured with the filter's implementation before
# it moved to sft.py (the move changed no decision), then again when the teacher became the causal
# toy task's (its trajectories changed, so did the counts; the filter did not).
REFERENCE_TOY_COUNTS = {"generated": 762, "kept": 300, "no_closing_answer": 161, "consecutive_tool_errors": 76,
                        "non_final_turn_without_valid_call": 138, "missing_required_tag": 87}


# ---- the loss mask (appendix: span masking of <tool_output>) -----------------------------------

def test_tool_output_tokens_carry_no_loss_appendix():
    import torch
    from toy import model as toy_model
    from toyfix import tiny_tokenizer

    tok = tiny_tokenizer()
    ex = sft.to_chatml("what is x?", good(), "sys")
    ids, mask = sft.encode_trajectory(tok, ex)
    prompt = tok.apply_chat_template(ex["messages"][:2], add_generation_prompt=True, tokenize=True)
    n_prompt = len(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert not any(mask[:n_prompt])
    body, m = ids[n_prompt:], mask[n_prompt:]
    masked = tok.decode([t for t, k in zip(body, m) if not k], skip_special_tokens=False)
    trained = tok.decode([t for t, k in zip(body, m) if k], skip_special_tokens=False)
    assert masked == OUT  # exactly the tool output, nothing else
    assert trained == PLAN + CALL_OPEN + "x</call_tool>" + FINAL + "<|im_end|>"
    # The loss of the SFT step: changing the model's prediction at a tool-output position does not
    # change it (its gradient there is zero), at a teacher position it does.
    model = toy_model.build_tiny_qwen3(tok, "XS", seed=0)
    from policy import token_logprobs

    x = torch.tensor([ids])
    mk = torch.tensor([mask], dtype=torch.bool)
    logp = token_logprobs(model, x, torch.ones_like(x))
    logp.retain_grad()
    loss = -(logp * mk).sum() / mk.sum()
    loss.backward()
    g = logp.grad[0]
    assert torch.all(g[~mk[0]] == 0) and torch.all(g[mk[0]] != 0)
    assert sft.encode_trajectory(tok, ex, max_len=len(ids) - 1) is None  # too long: dropped


# ---- length bucketing at the max length, the schedule ------------------------------------------

def test_bucketing_respects_the_token_budget_and_covers_every_example():
    lengths = [100, 16384, 3000, 5000, 8000, 120, 7000, 900]
    b = sft_pack.bucket(range(8), lengths, 16384, 4)
    assert sorted(i for x in b for i in x) == list(range(8))
    assert all(len(x) * max(lengths[i] for i in x) <= 16384 and len(x) <= 4 for x in b)
    assert sft_pack.bucket(range(8), lengths, 16384, 1) == [[i] for i in sorted(range(8), key=lambda i: lengths[i])]
    with pytest.raises(ValueError):
        sft_pack.bucket([0], [16385], 16384, 1)


def test_step_plan_epochs_and_deal_balance():
    steps = sft_pack.step_plan(10, 5, 4, seed=0)
    assert len(steps) == 5 * 3 and sorted(i for s in steps[:3] for i in s) == list(range(10))
    shares = sft_pack.deal([0, 1, 2, 3], [10, 9, 2, 1], 2)
    assert sorted(i for s in shares for i in s) == [0, 1, 2, 3]
    assert shares == [[0, 3], [1, 2]]


def test_lr_schedule_cosine_with_ten_percent_warmup_appendix():
    total, peak = 100, 4e-5
    lrs = [sft_pack.lr_at(s, total, peak) for s in range(total)]
    assert lrs[9] == pytest.approx(peak) and lrs[0] == pytest.approx(peak / 10)
    assert max(lrs) == pytest.approx(peak) and lrs[-1] < peak * 1e-3
    assert lrs[55] == pytest.approx(peak * 0.5 * (1 + math.cos(math.pi * 45 / 90)))


# ---- the teacher: budget cap, resume, dry run ----------------------------------------------------

def _teacher(server, search, tmp, concurrency=1, **kw):
    from backends.api.search_http import SerperSearchTool
    from backends.sft.teacher import Teacher, TeacherConfig
    from backends.api.settings import SearchHTTPConfig

    cfg = TeacherConfig(backend=server.kind, model=server.model, base_url=server.url, concurrency=concurrency,
                        max_retries=0, **kw)
    tool = SerperSearchTool(SearchHTTPConfig(base_url=search.url), k=2)
    return Teacher(cfg, tool, cache_dir=str(tmp / "cache"), tool_names=sft.TOOL_ALIASES), tool


@pytest.mark.parametrize("kind", ["openai", "gemini"])
def test_teacher_budget_cap_stops_cleanly_and_resume_pays_nothing_twice(tmp_path, monkeypatch, kind):
    from loopback import TEST_KEY, FakeServer
    from sft_loopback import TeacherServer

    from backends.sft.teacher import generate

    monkeypatch.setenv("OPENAI_API_KEY", TEST_KEY)
    monkeypatch.setenv("GEMINI_API_KEY", TEST_KEY)
    monkeypatch.setenv("SERPER_API_KEY", TEST_KEY)
    qs = [{"id": f"q{i}", "query": f"Question {i}?"} for i in range(4)]
    out = str(tmp_path / "t.jsonl")
    with TeacherServer(kind, model="m-test") as srv, FakeServer("serper") as ss:
        # 1 call costs 100 * 10 / 1e6 + 20 * 10 / 1e6 = 0.0012 USD: a cap of 0.0023 allows 2 calls
        # (one at a time; with c requests in flight the cap can be passed by at most c - 1 calls).
        t, tool = _teacher(srv, ss, tmp_path, price_in=10.0, price_out=10.0, max_usd=0.0023)
        st = generate(qs, out, t)
        t.close(), tool.close()
        assert st["stopped"] == "budget" and st["calls"] == 2 and not srv.errors
        assert st["usd"] == pytest.approx(0.0024)
        n_req = len(srv.requests)
        t, tool = _teacher(srv, ss, tmp_path, concurrency=3, price_in=10.0, price_out=10.0)
        st2 = generate(qs, out, t)
        t.close(), tool.close()
        assert st2["written"] + st["written"] == 4 and st2["stopped"] is None
        assert st2["cached_calls"] == 2  # the interrupted trajectories' turns came from the cache
        assert len(srv.requests) - n_req == st2["calls"] == 4 * 3 - 2
        n_req = len(srv.requests)
        t, tool = _teacher(srv, ss, tmp_path)
        st3 = generate(qs, out, t)
        t.close(), tool.close()
        assert st3["resumed"] == 4 and len(srv.requests) == n_req
    lines = [json.loads(x) for x in open(out)]
    assert sorted(r["id"] for r in lines) == [q["id"] for q in qs]
    assert st3["filters"]["kept"] == 4


def test_teacher_dry_run_prints_calls_tokens_and_dollars(tmp_path, capsys):
    from backends.sft.teacher import GEN_ASSUMPTIONS, cost_plan, main
    from backends.api.pricing import Prices

    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n"
                         for i in range(50)))
    assert main(["--queries", str(q), "--out", str(tmp_path / "o.jsonl"), "--dry-run",
                 "--price-in", "1", "--price-out", "2"]) == 0
    text = capsys.readouterr().out
    p = cost_plan(50, Prices(1.0, 2.0, "given"))
    c = GEN_ASSUMPTIONS["tool_calls"]
    assert p["calls"] == 50 * (c + 1)
    assert f"{p['calls']:,} teacher calls" in text and f"${p['usd']:,.2f}" in text
    assert not (tmp_path / "o.jsonl").exists()
    # Hand-worked: 7 calls, input 7 x 520 + 950 x 21 = 23,590 tokens, output 6 x 350 + 2500 + 7 x 800
    assert p["tokens_in"] == 50 * 23590 and p["tokens_out"] == 50 * 10200
    assert p["usd"] == pytest.approx(50 * (23590 * 1 + 10200 * 2) / 1e6)


# ---- the SFT plan (memory per GPU at 16,384 tokens, GPU-hours) ----------------------------------

def test_sft_optimizer_on_the_gpu_is_torch_adamw_and_needs_no_cuda_build():
    """The SFT stage's DeepSpeed config (backends/sft/zero3.sft_deepspeed_config): on the GPU,
    DeepSpeed's AdamW entry with "torch_adam" (DeepSpeed 0.19.8 then steps torch.optim.AdamW instead
    of JIT-building FusedAdam with nvcc); offloaded, DeepSpeedCPUAdam (no "torch_adam"); on the CPU,
    no entry (a torch AdamW client optimizer). tests/test_zero3_collectives.py runs the GPU entry."""
    from backends.sft.zero3 import SFTRunConfig, sft_deepspeed_config

    gpu, _ = sft_deepspeed_config(SFTRunConfig(), 8, "cuda")
    assert gpu["optimizer"]["type"] == "AdamW"
    assert gpu["optimizer"]["params"] == {"lr": 4e-5, "betas": [0.9, 0.95], "eps": 1e-8,  # PAPER: lr
                                          "weight_decay": 0.0, "torch_adam": True}
    assert "offload_optimizer" not in gpu["zero_optimization"]
    off, _ = sft_deepspeed_config(SFTRunConfig(offload_optimizer=True), 8, "cuda")
    assert off["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert off["optimizer"]["type"] == "AdamW" and "torch_adam" not in off["optimizer"]["params"]
    cpu, _ = sft_deepspeed_config(SFTRunConfig(), 2, "cpu")
    assert "optimizer" not in cpu and cpu["zero_allow_untested_optimizer"] is True
    forced, _ = sft_deepspeed_config(SFTRunConfig(optimizer="deepspeed"), 2, "cpu")
    assert forced["optimizer"]["params"]["torch_adam"] is True


def test_sft_memory_plan_and_gpu_hours_hand_worked():
    from backends.distributed.plan import QWEN3_8B, model_shape, sft_gpu_hours, sft_memory_plan
    from backends.sft.zero3 import SFTRunConfig

    shape = model_shape(None)
    cfg = SFTRunConfig()
    mp = sft_memory_plan(shape, cfg, 8, 80 * 2 ** 30)
    P = shape.params
    assert mp.others["optimizer (fp32 master, m, v, grads)"] == 16 * P / 8
    assert mp.others["policy weights (ZeRO-3 shard)"] == 2 * P / 8
    assert "pi_ref weights (ZeRO-3 shard)" not in mp.others
    assert mp.others["activations (checkpointed, max pack)"] == 16384 * QWEN3_8B["hidden_size"] * 2 * 36
    h, _ = sft_gpu_hours(shape, cfg, 11000, 6000)
    assert h == pytest.approx(11000 * 6000 * 5 * 8 * P / (989e12 * 0.35) / 3600)


def test_teacher_tool_errors_reach_filter_4_in_the_stats(tmp_path, monkeypatch):
    """Two failing searches in a row (Serper answers 500) become two consecutive tool-error outputs,
    which the stats count under filter (4); the other trajectory is kept."""
    from loopback import TEST_KEY, FakeServer
    from sft_loopback import TeacherServer

    from backends.api.search_http import SerperSearchTool
    from backends.sft.teacher import Teacher, TeacherConfig, generate
    from backends.api.settings import SearchHTTPConfig

    monkeypatch.setenv("OPENAI_API_KEY", TEST_KEY)
    monkeypatch.setenv("SERPER_API_KEY", TEST_KEY)
    qs = [{"id": "ok", "query": "Fine question?"}, {"id": "bad", "query": "FAILSEARCH question?"}]
    with TeacherServer("openai", model="m-test") as srv, FakeServer("serper") as ss:
        ss.rule = lambda req: {"status": 500} if "FAILSEARCH" in req["body"]["q"] else None
        tool = SerperSearchTool(SearchHTTPConfig(base_url=ss.url, max_retries=0), k=2)
        t = Teacher(TeacherConfig(backend="openai", model="m-test", base_url=srv.url, max_retries=0),
                    tool, cache_dir=str(tmp_path / "cache"))
        st = generate(qs, str(tmp_path / "t.jsonl"), t)
        t.close(), tool.close()
    assert st["written"] == 2 and st["tool_errors"] == 2
    assert st["filters"]["consecutive_tool_errors"] == 1 and st["filters"]["kept"] == 1


def test_chatml_rows_in_dr_tulu_form_are_converted_filtered_and_masked():
    """SFT data already in single-turn ChatML (e.g. DR Tulu-style trajectories with its tool names
    and <scratchpad>) goes through the same conversions, filters and mask as teacher records."""
    from toyfix import tiny_tokenizer

    from backends.sft.zero3 import SFTRunConfig, prepare, read_records

    text = "".join(t for _, t in good()).replace(CALL_OPEN, '<call_tool name="snippet_search">')
    text = "<scratchpad>think first</scratchpad>" + text
    rows = [{"messages": [{"role": "system", "content": "theirs"}, {"role": "user", "content": "q?"},
                          {"role": "assistant", "content": text}]},
            {"messages": [{"role": "user", "content": "q2?"},
                          {"role": "assistant", "content": text.replace("</answer>", "")}]}]
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "rows.jsonl")
        with open(p, "w") as fh:
            fh.write("".join(json.dumps(r) + "\n" for r in rows))
        recs = read_records([p])
    tok = tiny_tokenizer()
    enc, st = prepare(tok, recs, SFTRunConfig(system="compact"))
    assert (st["kept"], st["no_closing_answer"], st["examples"], st["too_long"]) == (1, 1, 1, 0)
    ids, mask = enc[0]
    trained = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert trained.startswith("<think>think first</think>") and CALL_OPEN in trained
    assert "snippet_search" not in trained and "the fact is 7" not in trained  # tool output masked


def test_teacher_writes_a_repeated_query_once_and_repairs_a_torn_last_line(tmp_path):
    from backends.sft.teacher import Teacher, TeacherConfig, generate, read_queries

    q = tmp_path / "q.jsonl"
    q.write_text('{"query": "a?"}\n{"query": "b?"}\n{"query": "a?"}\n')
    out = tmp_path / "t.jsonl"
    out.write_text('{"id": "x", "query": "old", "segments": []}\n{"id": "tor')  # interrupted write
    t = Teacher(TeacherConfig(backend="openai", model="m"), tool=None)
    t.continue_ = lambda system, turns: "<answer>done.</answer>"
    st = generate(read_queries(str(q)), str(out), t)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["query"] == "old" and sorted(r["query"] for r in lines[1:]) == ["a?", "b?"]
    assert (st["written"], st["duplicates"], st["resumed"]) == (2, 1, 0)


@pytest.mark.parametrize("kind", ["gemini", "openai"])
def test_teacher_output_cap_and_thinking_budget_are_separate_settings(tmp_path, monkeypatch, kind):
    """Gemini's maxOutputTokens counts thinking and text together: the request asks for the text cap
    plus the thinking budget, with the budget in thinkingConfig (-1: neither, the old shared cap).
    A turn the API cut at its cap is counted (it would end in filter 1)."""
    from loopback import TEST_KEY, FakeServer
    from sft_loopback import TeacherServer

    from backends.sft.teacher import generate

    for v in ("OPENAI_API_KEY", "GEMINI_API_KEY", "SERPER_API_KEY"):
        monkeypatch.setenv(v, TEST_KEY)
    qs = [{"id": f"q{i}", "query": f"Question {i}?"} for i in range(2)]
    with TeacherServer(kind, model="m-test") as srv, FakeServer("serper") as ss:
        plain = srv.rule

        def cut_final_turn(req):
            action = plain(req)
            if "<answer>" not in action["text"]:
                return action
            body = srv._wrap(action["text"].replace("</answer>", ""))
            if kind == "gemini":
                body["candidates"][0]["finishReason"] = "MAX_TOKENS"
            else:
                body["choices"][0]["finish_reason"] = "length"
            return {"body": body}

        srv.rule = cut_final_turn
        t, tool = _teacher(srv, ss, tmp_path, max_output_tokens=3000, thinking_budget=5000)
        st = generate(qs, str(tmp_path / "a.jsonl"), t)
        t.close(), tool.close()
        body = srv.requests[0]["body"]
        if kind == "gemini":
            assert body["generationConfig"]["maxOutputTokens"] == 3000 + 5000
            assert body["generationConfig"]["thinkingConfig"] == {"thinkingBudget": 5000}
        else:
            assert body["max_tokens"] == 3000 and "thinkingConfig" not in json.dumps(body)
        assert st["max_tokens_stops"] == 2 and st["filters"]["no_closing_answer"] == 2
        t, tool = _teacher(srv, ss, tmp_path / "b", max_output_tokens=3000, thinking_budget=-1)
        generate(qs[:1], str(tmp_path / "b.jsonl"), t)
        t.close(), tool.close()
        last = srv.requests[-1]["body"]
        if kind == "gemini":
            assert last["generationConfig"]["maxOutputTokens"] == 3000
            assert "thinkingConfig" not in last["generationConfig"]
    from backends.sft.teacher import Teacher, TeacherConfig

    with pytest.raises(ValueError, match="thinking_budget"):
        Teacher(TeacherConfig(thinking_budget=-2), tool=None)

"""The SFT stage end to end on CPU (appendix, "Training configuration"), each command a subprocess:

  1. `python -m backends.sft.teacher`: a loopback Gemini teacher (tests/sft_loopback.py) writes trajectories in
     the scaffold through the loopback Serper search; a rerun resumes and sends nothing;
  2. `torchrun --nproc_per_node 2 -m backends.sft.zero3`: 2 SFT steps of a tiny Qwen3 on 2 ZeRO-3 gloo ranks;
  3. `torchrun --nproc_per_node 2 train.py --full --model <the SFT checkpoint>`: 1 full-mode RL step
     (Gemini judge and Serper search on loopback servers), started from that checkpoint.
The starting model is a tiny Qwen3 with its toy tokenizer (a short toy warm start). ~3-4 min on 2 cores.
"""
import json
import os
import sys

import pytest

import test_full_mode as fm
from loopback import TEST_KEY, FakeServer
from sft_loopback import TeacherServer
from toyfix import tiny_world

pytestmark = fm.pytestmark
ROOT = fm.ROOT

QUERIES = ["What year was the Harta bridge built?", "Who founded the Velo institute?",
           "DRTULU: where is the Orin archive?", "SCRATCH: what does the Kessa mill make?",
           "NOANSWER: when did the Pell line open?", "BADTOOL: who runs the Dara port?",
           "NOREVIEW: what is the Ulm canal?"]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sftpipe")
    warm = ["--toy", "--steps", "0", "--run-dir", str(tmp / "warm"), "--no-progress",
            "--set", "world.n_train_entities=40", "--set", "world.n_heldout_entities=8",
            "--set", "sft.steps=20", "--set", "sft.n_trajectories=60", "--set", "sft.n_reflections=4",
            "--set", "sft.batch_size=8", "--set", 'model_size="XS"', "--set", "vocab_size=400",
            "--set", "eval.n_questions=0", "--set", f'cache_dir="{tmp / "warm-cache"}"',
            "--set", "threads=1"]
    fm._run([sys.executable, os.path.join(ROOT, "train.py"), *warm])
    base = tmp / "warm" / "final"
    qfile = tmp / "queries.jsonl"
    qfile.write_text("".join(json.dumps({"query": q}) + "\n" for q in QUERIES))
    out = tmp / "teacher.jsonl"
    gen = [sys.executable, "-m", "backends.sft.teacher", "--queries", str(qfile),
           "--out", str(out), "--backend", "gemini", "--model", "gemini-test", "--price-in", "1",
           "--price-out", "2", "--max-usd", "5", "--concurrency", "3"]
    res = {}
    with TeacherServer("gemini", model="gemini-test") as t, FakeServer("serper") as s:
        args = gen + ["--base-url", t.url, "--search-base-url", s.url]
        fm._run(args)
        res["first"] = (list(t.requests), list(t.errors), list(s.requests))
        n = len(t.requests), len(s.requests)
        res["stats1"] = json.loads((tmp / "teacher.jsonl.stats.json").read_text())
        fm._run(args)  # resume: everything is written, nothing is sent again
        res["resumed"] = (len(t.requests) - n[0], len(s.requests) - n[1])
    res["stats"] = json.loads((tmp / "teacher.jsonl.stats.json").read_text())
    res["records"] = [json.loads(x) for x in out.read_text().splitlines()]
    sft_out = tmp / "sft"
    fm._run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             "-m", "backends.sft.zero3", "--data", str(out), "--model", str(base),
             "--out", str(sft_out), "--max-steps", "2", "--batch", "2", "--max-len", "2048",
             "--system", "compact", "--lr", "1e-3", "--warmup-frac", "0.5"])
    rows = tmp / "rows.jsonl"
    with open(rows, "w") as fh:
        for r in tiny_world().train_rows:
            fh.write(json.dumps({k: v for k, v in r.items() if k != "toy"}) + "\n")
    saved_steps = fm.STEPS
    fm.STEPS = 1
    try:
        res["rl"] = fm._full_run(tmp, "rl", sft_out, rows, 2)
    finally:
        fm.STEPS = saved_steps
    res.update(base=base, sft=sft_out, tmp=tmp)
    return res


def test_sft_teacher_generates_in_the_scaffold_with_the_real_clients(pipeline):
    reqs, errors, searches = pipeline["first"]
    assert reqs and not errors, errors[:3]  # path, key header, multi-turn body, stop sequence
    assert all(r["headers"].get("x-goog-api-key") == TEST_KEY for r in reqs)
    assert searches  # the real search client (Serper wire format)
    from scaffold import SYSTEM_PROMPT

    assert all(r["body"]["systemInstruction"]["parts"][0]["text"] == SYSTEM_PROMPT for r in reqs)
    recs = pipeline["records"]
    assert sorted(r["query"] for r in recs) == sorted(QUERIES)
    good = next(r for r in recs if r["query"] == QUERIES[0])
    assert [e for e, _ in good["segments"]] == [False, True, False, True, False]
    assert good["segments"][0][1].endswith("</call_tool>")  # the stop sequence is restored


def test_sft_teacher_resumes_without_paying_twice_and_counts_cost(pipeline):
    assert pipeline["resumed"] == (0, 0)
    first = pipeline["stats1"]
    assert first["written"] == len(QUERIES) and first["calls"] == len(pipeline["first"][0])
    # Eq.: usd = tokens_in / 1e6 * 1 + tokens_out / 1e6 * 2 (loopback usage: 100 in, 20 out per call)
    assert first["usd"] == pytest.approx(first["calls"] * (100 * 1 + 20 * 2) / 1e6)
    st = pipeline["stats"]
    assert st["resumed"] == len(QUERIES) and st["written"] == 0
    # The first run's counters went into the first stats file; the rerun's are zero.
    assert st["calls"] == 0 and st["usd"] == 0.0
    f = st["filters"]
    assert (f["trajectories"], f["kept"]) == (7, 4)
    assert f["no_closing_answer"] == f["non_final_turn_without_valid_call"] == f["missing_required_tag"] == 1


def test_sft_checkpoint_is_hf_format_with_run_card_and_trained_two_steps(pipeline):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from backends.run.runcard import read_run_card
    from scaffold import SYSTEM_PROMPT_COMPACT

    d = pipeline["sft"]
    card, where = read_run_card(str(d))
    assert card["system_prompt"] == SYSTEM_PROMPT_COMPACT
    info = card["sft"]
    assert info["world_size"] == 2 and len(info["steps"]) == 2
    assert info["stats"]["kept"] == 4 and info["stats"]["examples"] == 4
    assert all(s["loss"] > 0 and s["tokens"] > 0 for s in info["steps"])
    from backends.sft.pack import lr_at

    # the optimizer held the schedule's rates: 4 examples x 5 epochs / batch 2 = 10 steps, warm-up of
    # ceil(0.5 x 10) = 5 steps
    assert [s["lr"] for s in info["steps"]] == [lr_at(i, 10, 1e-3, 0.5) for i in range(2)]
    assert [s["lr"] for s in info["steps"]] == pytest.approx([2e-4, 4e-4])
    m = AutoModelForCausalLM.from_pretrained(str(d))
    base = AutoModelForCausalLM.from_pretrained(str(pipeline["base"]))
    tok = AutoTokenizer.from_pretrained(str(d))
    diff = sum(float((a - b).abs().sum()) for a, b in zip(m.state_dict().values(), base.state_dict().values()))
    assert diff > 0  # the two steps changed the weights
    # The chat template carries the system prompt by default (backends/run/runcard.py).
    txt = tok.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False)
    assert SYSTEM_PROMPT_COMPACT in txt


def test_full_mode_rl_step_runs_from_the_sft_checkpoint(pipeline):
    run_dir, servers, _ = pipeline["rl"]
    with open(run_dir / "metrics.jsonl") as fh:
        rows = [json.loads(x) for x in fh]
    assert [r["step"] for r in rows] == [0]
    assert servers["judge"][0] and not servers["judge"][1]
    assert rows[0]["judge/http/calls"] > 0

"""Full-mode data (appendix: DR Tulu RL rows; SFT with <tool_output> spans masked): local JSONL /
JSON / Parquet readers, row validation with row index and field in the errors, the Hugging Face
path through a stand-in `datasets` module (the hub is unreachable here), and SFT segmentation."""
import json
import os
import subprocess
import sys
import types

import pytest

from backends.run import data
from toy import sft
from toy import world
from toyfix import SYSTEM, teacher, tiny_tokenizer, tiny_world, train_queries

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tulu_row(q: str, n_rubrics: int = 2, **extra) -> dict:
    gt = {"query": q, "rubrics": [{"title": f"r{j}", "description": f"mentions point {j}",
                                   "weight": 1.0 + j} for j in range(n_rubrics)]}
    return {"messages": [{"role": "user", "content": q}], "ground_truth": json.dumps(gt),
            "dataset": "searcharena", **extra}


def write_jsonl(path, rows):
    with open(path, "w") as fh:
        for r in rows:
            fh.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


# ----------------------------------------------------------------------------------------------------
# RL rows


def test_load_rl_rows_jsonl_dr_tulu_schema(tmp_path):
    p = write_jsonl(tmp_path / "rl.jsonl", [tulu_row("What is X?"), "", tulu_row("Compare A and B.", 3)])
    qs = data.load_rl_rows(p)
    assert [q.query for q in qs] == ["What is X?", "Compare A and B."]
    assert [len(q.rubrics) for q in qs] == [2, 3] and qs[1].rubrics[2]["weight"] == 3.0
    assert [q.row_index for q in qs] == [0, 1] and qs[0].toy is None
    assert len(data.load_rl_rows(p, limit=1)) == 1


def test_load_rl_rows_toy_world_round_trip_equals_world_loader(tmp_path):
    rows = tiny_world().train_rows[:20]
    qs = data.load_rl_rows(write_jsonl(tmp_path / "toy.jsonl", rows))
    want = data.load_rows(rows)
    assert [(q.query, q.rubrics, q.toy) for q in qs] == [(q.query, q.rubrics, q.toy) for q in want]


def test_load_rl_rows_json_list_file(tmp_path):
    p = tmp_path / "rl.json"
    p.write_text(json.dumps({"data": [tulu_row("q one"), tulu_row("q two")]}))
    assert [q.query for q in data.load_rl_rows(str(p))] == ["q one", "q two"]


@pytest.mark.parametrize("bad,match", [
    ({"messages": [{"role": "assistant", "content": "x"}], "ground_truth": "{}"}, r"row 1: `messages`"),
    ({"messages": [{"role": "user", "content": "q"}], "ground_truth": "{not json"}, r"row 1: `ground_truth`"),
    ({"messages": [{"role": "user", "content": "q"}],
      "ground_truth": json.dumps({"query": "q", "rubrics": []})}, r"row 1: `ground_truth.rubrics`"),
    ({"messages": [{"role": "user", "content": "q"}],
      "ground_truth": json.dumps({"query": "q", "rubrics": [{"title": "t"}]})}, r"row 1: rubric 0"),
    ([1, 2], r"row 1: expected a JSON object"),
])
def test_load_rl_rows_names_row_index_and_field(tmp_path, bad, match):
    p = write_jsonl(tmp_path / "bad.jsonl", [tulu_row("fine"), bad])
    with pytest.raises(ValueError, match=match):
        data.load_rl_rows(p)


def test_read_errors_name_line_file_and_format(tmp_path):
    p = write_jsonl(tmp_path / "broken.jsonl", [tulu_row("ok"), "{broken"])
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        data.load_rl_rows(p)
    with pytest.raises(ValueError, match="empty"):
        data.load_rl_rows(write_jsonl(tmp_path / "empty.jsonl", []))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        data.load_rl_rows(str(tmp_path / "missing.jsonl"))
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown data format"):
        data.read_records(str(tmp_path / "rows.csv"))


def test_parquet_rows_load_like_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed: Parquet path not tested")
    import pyarrow.parquet as pq

    rows = [tulu_row("What is X?"), tulu_row("Compare A and B.", 3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rl.parquet")
    qs = data.load_rl_rows(str(tmp_path / "rl.parquet"))
    assert [(q.query, q.rubrics) for q in qs] == [(q.query, q.rubrics) for q in data.load_rows(rows)]


def test_parquet_without_pyarrow_or_pandas_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.setitem(sys.modules, "pandas", None)
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="pip install pyarrow"):
        data.read_records(str(tmp_path / "x.parquet"))


# ----------------------------------------------------------------------------------------------------
# Hugging Face datasets (a stand-in module: the hub is not reachable from tests)


def test_hub_id_without_datasets_package_is_a_clear_error_naming_the_setting(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"rl-research/dr-tulu-rl-data.*pip install datasets"):
        data.read_records("rl-research/dr-tulu-rl-data")
    # the RL rows' loader names the run's setting and the local-file way (train.main: exit code 2)
    with pytest.raises(OSError, match=r"data.source 'rl-research/dr-tulu-rl-data'.*pip install "
                       r"datasets.*point data.source at a local copy of the rows"):
        data.load_rl_rows("rl-research/dr-tulu-rl-data")


def test_hub_unreachable_is_a_clear_os_error_naming_the_setting(monkeypatch):
    def load_dataset(name, split):
        raise ConnectionError("Couldn't reach 'rl-research/dr-tulu-rl-data' on the Hub")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match=r"^data.source 'rl-research/dr-tulu-rl-data': .*unreachable.*"
                       r"HF_HUB_OFFLINE.*--set data.source=\"rows.jsonl\""):
        data.load_rl_rows("rl-research/dr-tulu-rl-data")


def test_local_rows_file_loads_offline_without_datasets(tmp_path, monkeypatch):
    """An offline node (HF_HUB_OFFLINE, no `datasets`) reads data.source = a local rows file."""
    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    p = write_jsonl(tmp_path / "rows.jsonl", [tulu_row("offline q1"), tulu_row("offline q2")])
    assert [q.query for q in data.load_rl_rows(p)] == ["offline q1", "offline q2"]
    # a missing local file stays a FileNotFoundError naming the path (never sent to the hub)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        data.load_rl_rows(str(tmp_path / "missing.jsonl"))


def test_train_stops_with_exit_code_2_naming_data_source_when_the_hub_is_out_of_reach(tmp_path, monkeypatch,
                                                                                      capsys):
    """train.py --full on a node without `datasets` / network: a clear error naming data.source, exit
    code 2 (unusable input), no traceback."""
    import train

    monkeypatch.setitem(sys.modules, "datasets", None)
    rc = train.main(["--toy", "--steps", "1", "--run-dir", str(tmp_path / "run"), "--no-progress",
                     "--set", 'judge.backend="gemini"', "--set", f'data.source="{data.PAPER_RL_DATA}"',
                     "--set", f'cache_dir="{tmp_path / "cache"}"'])
    err = capsys.readouterr().err
    assert rc == 2 and "data.source 'rl-research/dr-tulu-rl-data'" in err and "rows.jsonl" in err, err


def test_hub_rows_are_validated_like_local_rows(monkeypatch):
    calls = []

    def load_dataset(name, split):
        calls.append((name, split))
        return [tulu_row("hub q1"), tulu_row("hub q2")]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    qs = data.load_rl_rows("rl-research/dr-tulu-rl-data", split="train")
    assert calls == [("rl-research/dr-tulu-rl-data", "train")]
    assert [q.query for q in qs] == ["hub q1", "hub q2"]


def test_importing_data_loads_no_heavy_package():
    code = ("import sys, backends.run.data\n"
            "bad = [m for m in ('datasets', 'pyarrow', 'pandas') if m in sys.modules]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# ----------------------------------------------------------------------------------------------------
# SFT messages and <tool_output> segments


TRAJ = ("<structured_plan><analysis>a</analysis></structured_plan>\n"
        '<call_tool name="google_search">kuvebro habitat</call_tool>\n'
        "<tool_output>[1] Kuvebro | Kuvebro lives in the north marshes.</tool_output>\n"
        "<state_evaluation>found it</state_evaluation>\n"
        '<call_tool name="google_search">x</call_tool>\n<tool_output>error: timeout</tool_output>\n'
        "<review>r</review><answer>It lives in the north marshes [1].</answer>")


def test_sft_segments_split_at_tool_output_and_concatenate_exactly():
    segs = data.sft_segments(TRAJ)
    assert "".join(t for _, t in segs) == TRAJ
    assert [e for e, _ in segs] == [False, True, False, True, False]
    assert all(t for _, t in segs)
    for is_env, t in segs:
        if is_env:
            assert t.startswith("\n<tool_output>") and t.endswith("</tool_output>\n")
        else:
            assert "<tool_output>" not in t and "</tool_output>" not in t
    assert data.sft_segments("plain answer") == [(False, "plain answer")]
    assert data.sft_segments("a<tool_output>cut off") == [(False, "a"), (True, "<tool_output>cut off")]


def test_sft_segments_invert_the_rollout_engine_layout_on_teacher_trajectories():
    for i, q in enumerate(train_queries()[:10]):
        tr = teacher(q, seed=i)
        merged = []
        for is_env, t in tr.segments:  # adjacent policy segments are one stretch of text
            if merged and merged[-1][0] == is_env and not is_env:
                merged[-1] = (False, merged[-1][1] + t)
            else:
                merged.append((is_env, t))
        assert data.sft_segments("".join(t for _, t in tr.segments)) == merged


def test_sft_example_masks_tool_outputs_in_encode_example():
    tok = tiny_tokenizer()
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where does Kuvebro live?"},
            {"role": "assistant", "content": TRAJ}]
    prompt, segs = data.sft_example(msgs)
    assert prompt == msgs[:2]
    ids, mask = sft.encode_example(tok, prompt, segs)
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    masked = tok.decode([t for t, m in zip(ids, mask) if not m])
    assert "north marshes." in masked and "error: timeout" in masked and "<tool_output>" in masked
    assert "<tool_output>" not in trained and "Kuvebro lives" not in trained
    assert "<answer>" in trained and "found it" in trained


@pytest.mark.parametrize("msgs,match", [
    ([], "non-empty list"),
    ([{"role": "user", "content": "q"}], "last message must be a non-empty assistant"),
    ([{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}], r"messages\[1\].role"),
    ([{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}], r"messages\[0\].content"),
    ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}], "no user turn"),
])
def test_validate_messages_names_row_message_and_field(msgs, match):
    with pytest.raises(ValueError, match=match):
        data.validate_messages(msgs, index=4)


def test_load_sft_examples_jsonl(tmp_path):
    ok = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": TRAJ}]}
    p = write_jsonl(tmp_path / "sft.jsonl", [ok, ok])
    ex = data.load_sft_examples(p)
    assert len(ex) == 2 and ex[0][-1]["content"] == TRAJ
    bad = write_jsonl(tmp_path / "bad.jsonl", [ok, {"text": "no messages"}])
    with pytest.raises(ValueError, match="row 1: missing `messages`"):
        data.load_sft_examples(bad)

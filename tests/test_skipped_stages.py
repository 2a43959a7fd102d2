"""scripts/skipped_stages.py: resuming a copy of a run replays its steps exactly (the recorded
well-formed share equals the run's own metric), the skipping token's record is consistent with the
stage advantages, and the run directory is left as it was."""
import json

import pytest

import train
from runfix import fast_args, load_script, sha256

ss = load_script("skipped_stages")


@pytest.mark.slow
def test_skipped_stages_replays_the_runs_steps(tmp_path, toy_cache, capsys):
    d = tmp_path / "run"
    assert train.main(fast_args(d, toy_cache, 3)) == 0
    before, update_batch = sha256(d / "metrics.jsonl"), train.update_batch
    assert ss.main([str(d), "--from-step", "1", "--json", str(tmp_path / "rec.json")]) == 0
    assert sha256(d / "metrics.jsonl") == before  # the run itself is untouched
    assert train.update_batch is update_batch  # the recording wrappers are gone
    steps = json.load(open(tmp_path / "rec.json"))
    metrics = [json.loads(x) for x in open(d / "metrics.jsonl")]
    assert len(steps) == 2
    for rows, m in zip(steps, metrics[1:]):
        assert sum(r["wf"] for r in rows) / len(rows) == pytest.approx(m["rollout/well_formed"])
        for r in rows:
            if r["skip"]:
                assert not r["has"][r["skip"]["stage"]] and r["has"][r["skip"]["opens"]]
                assert r["skip"]["A_token"] == r["A"][r["skip"]["opens"]]
                assert r["skip"]["A_skipped"] == r["A"][r["skip"]["stage"]]
    out = capsys.readouterr().out
    assert "step 1:" in out and "step 2:" in out
    with pytest.raises(SystemExit, match="no such checkpoint"):
        ss.main([str(d), "--from-step", "7"])

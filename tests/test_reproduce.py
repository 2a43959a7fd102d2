"""scripts/reproduce.py: seeds of the toy run, resumable, results table with bootstrap intervals, figure."""
import json
import os

import numpy as np
import pytest

from runfix import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
reproduce = load_script("reproduce")

TINY = ["steps=2", "world.n_train_entities=40", "world.n_heldout_entities=8", "sft.steps=10",
        "sft.n_trajectories=200", "sft.n_reflections=20", "sft.batch_size=8", 'toy_model.size="XS"',
        "toy_model.vocab_size=400", "rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_response_tokens=96",
        "reflection.m=4", "reflection.max_new_tokens=16", "eval.n_questions=3", "eval.samples=1"]


def test_bootstrap_gain_mean_and_interval():
    rng = np.random.default_rng(0)
    gains = [rng.normal(0.2, 0.1, 64) for _ in range(3)]
    mean, lo, hi = reproduce.bootstrap_gain(gains, B=2000)
    assert mean == pytest.approx(np.mean(np.concatenate(gains)))
    assert lo < mean < hi and lo > 0.1 and hi < 0.3
    # a constant gain has a zero-width interval; no data is an error
    assert reproduce.bootstrap_gain([[0.5, 0.5], [0.5]], B=200) == (0.5, 0.5, 0.5)
    with pytest.raises(ValueError):
        reproduce.bootstrap_gain([])


def test_bootstrap_gain_resamples_seeds_not_only_questions():
    # two seeds that disagree: a seed-level bootstrap must give a wide interval, wider than the
    # question-only interval inside either seed
    gains = [np.full(50, 0.0) + np.linspace(-0.01, 0.01, 50), np.full(50, 0.4)]
    _, lo, hi = reproduce.bootstrap_gain(gains, B=2000)
    assert lo < 0.05 and hi > 0.35


def test_smooth_and_quarter_gain():
    np.testing.assert_allclose(reproduce.smooth([0, 1, None, 3], 2), [0, 0.5, 1, 3])
    assert reproduce.quarter_gain(np.arange(8.0)) == pytest.approx(6.5 - 0.5)
    assert np.isnan(reproduce.quarter_gain(np.array([])))


@pytest.mark.slow
def test_reproduce_runs_seed_writes_results_and_is_resumable(tmp_path):
    out, res, fig = tmp_path / "runs", tmp_path / "results.md", tmp_path / "fig.png"
    res.write_text("# Results\n\n## Diagnosis\n\nkept text\n")
    args = ["--seeds", "0", "--out", str(out), "--results", str(res), "--figure", str(fig),
            "--set", f'cache_dir="{tmp_path / "cache"}"'] + [x for kv in TINY for x in ("--set", kv)]
    assert reproduce.main(args) == 0
    ev = json.load(open(out / "seed0" / "eval.json"))
    assert len(ev["eval_rl"]["per_question"]["answer"]) == 3
    text = res.read_text()
    assert "kept text" in text and reproduce.BEGIN in text and reproduce.END in text
    row = next(l for l in text.splitlines() if l.startswith("| 0 |"))
    gain = ev["eval_rl"]["answer"] - ev["eval_sft"]["answer"]
    assert f"{gain:+.3f}" in row
    wf = [json.loads(x)["rollout/well_formed"] for x in open(out / "seed0" / "metrics.jsonl")]
    assert (f"its mean over all steps and seeds {sum(wf) / len(wf):.3f}; steps below 0.8: "
            f"{sum(w < 0.8 for w in wf)} of {len(wf)}.") in text
    assert fig.stat().st_size > 1000
    # where the figures come from: the run's machine (CPU, kernel set, versions) and threads, and
    # the spread to expect elsewhere (docs/metrics.md, "Reproducibility")
    import torch
    import transformers

    where = ev["machine"]
    assert where["torch"] == torch.__version__ and where["transformers"] == transformers.__version__
    assert where["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and where["cpu"]
    line = next(l for l in text.splitlines() if l.startswith("Machine: "))
    assert line.startswith(f"Machine: {reproduce.provenance.describe(where)}; torch threads: 2 for "
                           "training, 1 for sampling; git commit: ")
    assert f"torch {torch.__version__}, transformers {transformers.__version__}" in line
    assert reproduce.SPREAD in line
    # a finished seed is not rerun; the section is replaced, not appended
    mtime = os.path.getmtime(out / "seed0" / "eval.json")
    assert reproduce.main(args) == 0
    assert os.path.getmtime(out / "seed0" / "eval.json") == mtime
    assert res.read_text().count(reproduce.BEGIN) == 1
    # README's quick-start block from the same run: replaced between its markers, nothing else
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{reproduce.README_BEGIN}\nold numbers\n{reproduce.README_END}\noutro\n")
    data = {0: reproduce.load_seed(str(out / "seed0"))}
    summ = reproduce.summarise([0], data, 6)
    threads = reproduce.thread_counts(json.load(open(out / "seed0" / "config.json")))
    assert threads == "2 for training, 1 for sampling"  # the defaults (TINY leaves them)
    block = reproduce.readme_markdown([0], summ, data, str(out), threads)
    reproduce.write_results(str(readme), block, reproduce.README_BEGIN, reproduce.README_END,
                            append=False)
    new = readme.read_text()
    assert new.startswith("intro\n") and new.endswith("outro\n") and "old numbers" not in new
    assert f"{gain:+.3f}" in next(l for l in new.splitlines() if l.startswith("| 0 |"))
    assert "run dir: " in new and "total time" in new  # seed 0's console summary
    assert "\nverdict: " in new and "\nnext: " in new  # ... with its verdict line
    assert f"(this machine: {reproduce.provenance.describe(where)}; torch threads: 2 for training, 1 " \
        "for sampling, the defaults;" in new
    assert new.split(reproduce.README_END)[0].rstrip().endswith(reproduce.SPREAD)
    plain = tmp_path / "plain.md"
    plain.write_text("no markers\n")
    reproduce.write_results(str(plain), block, reproduce.README_BEGIN, reproduce.README_END,
                            append=False)
    assert plain.read_text() == "no markers\n"


def test_curve_prefers_the_static_score_and_falls_back_to_reward():
    rows = [{"score/answer": 0.1, "reward/answer": 0.9}, {"score/answer": 0.3, "reward/answer": 0.2}]
    assert reproduce.curve(rows, "answer") == [0.1, 0.3]
    assert reproduce.curve([{"reward/answer": 0.9}], "answer") == [0.9]


def test_the_readme_block_names_its_machine_and_the_spread_to_expect():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = readme.split(reproduce.README_BEGIN, 1)[1].split(reproduce.README_END, 1)[0]
    assert "(this machine: " in block and "torch threads: " in block
    assert block.rstrip().endswith(reproduce.SPREAD)
    results = open(os.path.join(ROOT, "docs", "results.md"), encoding="utf-8").read()
    line = next(l for l in results.splitlines() if l.startswith("Machine: "))
    assert line.endswith(reproduce.SPREAD)
    metrics = open(os.path.join(ROOT, "docs", "metrics.md"), encoding="utf-8").read()
    assert "\n## Reproducibility\n" in metrics  # where SPREAD points

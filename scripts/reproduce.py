"""Reproduce the toy quick start over several seeds and write docs/results.md and docs/reward_curves.png.

RubricEM (arXiv 2605.10899): the toy pipeline of train.py (SFT warm start, Algorithm 1 with SS-GRPO,
the evolving judge, the reflection meta-policy and the rubric bank, held-out evaluation), run once per
seed. Not a part of the paper: this script measures what the quick start promises.

What it does
1. For each seed, `python train.py --toy --seed N --run-dir OUT/seedN --no-progress` in its own
   process (extra `--set KEY=VALUE` arguments pass through). Resumable: a seed whose run directory
   already holds eval.json is not rerun; one with checkpoints but no eval.json continues with
   `--resume`.
2. Reads each run's eval.json (held-out scores, per-question scores, timings) and metrics.jsonl.
3. Writes the results section of docs/results.md (between the two `reproduce` markers; anything
   else in the file, e.g. the diagnosis, is kept): a per-seed table, the mean over seeds with a 95 %
   bootstrap interval, the exact commands, the git commit, the thread counts, the machine (CPU model,
   torch's kernel set, torch and transformers versions: each run's eval.json "machine") and the date,
   and that other machines give other numbers within the intervals (docs/metrics.md,
   "Reproducibility"). README.md's block (between the `reproduce-readme` markers) says the same.
4. Draws docs/reward_curves.png: each stage's static-rubric training score per RL step, smoothed, one thin line per
   seed and a thick mean; on the Answer panel, dashed and dotted horizontal lines at the held-out
   answer score of the SFT start and of the final policy (means over seeds).

Statistics
- gain of a seed = RL answer score - SFT answer score on the same held-out questions (paired).
- 95 % interval of the mean gain: two-level bootstrap (B = 10,000): resample the seeds with
  replacement, then, within each drawn seed, its held-out questions with replacement; the statistic
  is the mean over the drawn (seed, question) pairs of the paired per-question gain.
- learning curve: the Answer stage's training score under the static rubric set (score/answer,
  comparable across steps, unlike reward/answer whose rubrics evolve), mean over seeds, smoothed by
  a trailing moving average of `--smooth` steps (default 6, one curriculum window, so fresh and
  replayed batches weigh alike); its last-quarter mean minus its first-quarter mean.

Launch
    python scripts/reproduce.py                        # seeds 0 1 2 of the default toy run
    python scripts/reproduce.py --seeds 0 --quick      # one seed, 6 RL steps, 32 held-out questions
    python scripts/reproduce.py --out /tmp/r --results /tmp/r/results.md --figure /tmp/r/fig.png \\
        --set sft.steps=10 ...                         # tiny settings (the test does this)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from backends.run import provenance  # noqa: E402
from backends.run.report import smooth  # noqa: E402  (the per-run figure's trailing mean)

STAGES = ("plan", "research", "review", "answer")
BEGIN, END = "<!-- reproduce:begin -->", "<!-- reproduce:end -->"
# README.md's quick-start results come from the same runs, between these markers.
README_BEGIN, README_END = "<!-- reproduce-readme:begin -->", "<!-- reproduce-readme:end -->"
QUICK = ["--steps", "6", "--set", "eval.n_questions=32"]
# What a reader on another machine should expect (docs/metrics.md, "Reproducibility"), written beside
# every figure.
SPREAD = ("Another CPU, kernel set, thread count or torch / transformers version gives other numbers: "
          "expect them within the intervals shown (docs/metrics.md, \"Reproducibility\").")


# ----------------------------------------------------------------------------------------------------
# Running the seeds


def run_seed(seed: int, out: str, extra: list[str], python: str) -> dict:
    """Run (or skip, or resume) one seed. Returns {"seed", "run_dir", "command", "skipped",
    "wall_s"}; wall_s is this invocation's wall time (None when skipped). Raises RuntimeError
    naming the seed and the log file when train.py exits non-zero."""
    run_dir = os.path.join(out, f"seed{seed}")
    rel = os.path.relpath(run_dir, ROOT)
    shown = rel if not rel.startswith("..") else run_dir  # paths under the repository stay relative
    cmd = [python, "train.py", "--toy", "--seed", str(seed), "--run-dir", shown, "--no-progress",
           *extra]
    info = {"seed": seed, "run_dir": run_dir, "command": " ".join(cmd[1:]), "skipped": False,
            "wall_s": None}
    if os.path.exists(os.path.join(run_dir, "eval.json")):
        info["skipped"] = True
        print(f"seed {seed}: finished earlier ({run_dir}/eval.json), not rerun", flush=True)
        return info
    if os.path.isdir(os.path.join(run_dir, "checkpoints")):
        cmd.append("--resume")
    os.makedirs(run_dir, exist_ok=True)
    log_path = os.path.join(run_dir, "reproduce.log")
    print(f"seed {seed}: {' '.join(cmd[1:])}  (log {log_path})", flush=True)
    t0 = time.perf_counter()
    with open(log_path, "a") as fh:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT).returncode
    info["wall_s"] = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"seed {seed}: train.py exited with {rc}; see {log_path}")
    with open(os.path.join(run_dir, "reproduce_wall.json"), "w") as fh:
        json.dump({"wall_s": info["wall_s"], "command": info["command"]}, fh)
    return info


def load_seed(run_dir: str) -> dict:
    """eval.json, metrics rows and the recorded wall time of one finished run directory.
    Raises ValueError when eval.json lacks per-question scores (a run of older code)."""
    with open(os.path.join(run_dir, "eval.json")) as fh:
        ev = json.load(fh)
    for k in ("eval_sft", "eval_rl"):
        if "per_question" not in ev.get(k, {}):
            raise ValueError(f"{run_dir}/eval.json has no {k}.per_question: rerun this seed")
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(l) for l in fh if l.strip()]
    wall = None
    wp = os.path.join(run_dir, "reproduce_wall.json")
    if os.path.exists(wp):
        with open(wp) as fh:
            wall = json.load(fh)["wall_s"]
    return {"eval": ev, "rows": rows, "wall_s": wall}


# ----------------------------------------------------------------------------------------------------
# Statistics (pure functions)


def bootstrap_gain(gains: list, B: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """Mean paired gain and its 95 % two-level bootstrap interval.

    gains: one 1-D array per seed of per-question gains (RL - SFT, same questions). Each replicate
    draws len(gains) seeds with replacement and, within each drawn seed, as many questions as it has
    with replacement; the replicate's statistic is the mean over all drawn (seed, question) pairs.
    Returns (mean, lo, hi); lo = hi = mean for a single seed with a single question. Raises
    ValueError for no seeds or an empty seed."""
    if not gains or any(len(g) == 0 for g in gains):
        raise ValueError("bootstrap_gain needs at least one seed and one question per seed")
    arrs = [np.asarray(g, dtype=np.float64) for g in gains]
    rng = np.random.default_rng(seed)
    mean = float(np.mean(np.concatenate(arrs)))
    stats = np.empty(B)
    for b in range(B):
        picks = rng.integers(0, len(arrs), size=len(arrs))
        tot, cnt = 0.0, 0
        for s in picks:
            a = arrs[s]
            tot += a[rng.integers(0, len(a), size=len(a))].sum()
            cnt += len(a)
        stats[b] = tot / cnt
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return mean, float(lo), float(hi)


def curve(rows: list, stage: str) -> list:
    """A stage's training curve from metrics rows: the static-rubric score `score/{stage}` of the
    step's rollouts (comparable across steps), or the evolving-rubric mean R `reward/{stage}` for
    runs that did not log it."""
    key = f"score/{stage}" if any(r.get(f"score/{stage}") is not None for r in rows) else f"reward/{stage}"
    return [r.get(key) for r in rows]


def quarter_gain(curve: np.ndarray) -> float:
    """Mean of the last quarter of a curve minus the mean of its first quarter (at least one step
    each). (T,) -> float; NaN for an empty curve."""
    T = len(curve)
    if T == 0:
        return float("nan")
    q = max(1, T // 4)
    return float(np.nanmean(curve[-q:]) - np.nanmean(curve[:q]))


# ----------------------------------------------------------------------------------------------------
# Report and figure


def seed_row(seed: int, d: dict) -> dict:
    ev, rows = d["eval"], d["rows"]
    e0, e1, t = ev["eval_sft"], ev["eval_rl"], ev.get("timings", {})
    cached = bool(ev.get("sft", {}).get("cached"))
    total = d["wall_s"] if d["wall_s"] is not None else t.get("total_s")
    # a cached-start run skips SFT training and data building: its time is the total minus those
    sft_s = ev.get("sft", {}).get("train_seconds", 0.0) + ev.get("sft", {}).get("data_seconds", 0.0)
    wf = [r["rollout/well_formed"] for r in rows if r.get("rollout/well_formed") is not None]
    return {"seed": seed, "sft_answer": e0["answer"], "rl_answer": e1["answer"],
            "gain": e1["answer"] - e0["answer"], "sft_score": e0["score"], "rl_score": e1["score"],
            "sft_recall": e0["fact_recall"], "rl_recall": e1["fact_recall"],
            "wf_min": min(wf) if wf else float("nan"), "wf": wf, "steps": len(rows),
            "sft_answer_g": ev.get("eval_sft_greedy", {}).get("answer", float("nan")),
            "rl_answer_g": ev.get("eval_rl_greedy", {}).get("answer", float("nan")),
            "sft_recall_g": ev.get("eval_sft_greedy", {}).get("fact_recall", float("nan")),
            "rl_recall_g": ev.get("eval_rl_greedy", {}).get("fact_recall", float("nan")),
            "cold_s": None if cached else total,
            "cached_s": total if cached else (total - sft_s if total is not None else None),
            "rss_mb": t.get("peak_rss_mb")}


def _fmt_s(x) -> str:
    return "-" if x is None else f"{x / 60:.1f} min"


def _fmt_mb(x) -> str:
    return "-" if x is None else f"{x / 1024:.2f} GiB"  # x: MiB (getrusage's kB / 1024)


def machines(seeds, data) -> str:
    """Where the seeds' runs finished, in words: `provenance.describe` of each distinct "machine" of
    their eval.json, "; "-joined (a run of older code, which recorded none, is described by this
    process's machine)."""
    seen = []
    for s in seeds:
        d = provenance.describe(data[s]["eval"].get("machine") or provenance.machine())
        if d not in seen:
            seen.append(d)
    return "; ".join(seen)


def git_commit() -> str:
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return r.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    except OSError:
        return "unknown"


def summarise(seeds: list[int], data: dict, smooth_w: int) -> dict:
    """Everything the report prints, computed once: per-seed rows, bootstrap gains, curve gain."""
    rows = [seed_row(s, data[s]) for s in seeds]
    ans = [np.asarray(data[s]["eval"]["eval_rl"]["per_question"]["answer"])
           - np.asarray(data[s]["eval"]["eval_sft"]["per_question"]["answer"]) for s in seeds]
    sco = [np.asarray(data[s]["eval"]["eval_rl"]["per_question"]["score"])
           - np.asarray(data[s]["eval"]["eval_sft"]["per_question"]["score"]) for s in seeds]
    rec = [np.asarray(data[s]["eval"]["eval_rl"]["per_question"]["fact_recall"])
           - np.asarray(data[s]["eval"]["eval_sft"]["per_question"]["fact_recall"]) for s in seeds]
    greedy = all("eval_sft_greedy" in data[s]["eval"] for s in seeds)
    ans_g = [np.asarray(data[s]["eval"]["eval_rl_greedy"]["per_question"]["answer"])
             - np.asarray(data[s]["eval"]["eval_sft_greedy"]["per_question"]["answer"])
             for s in seeds] if greedy else None
    T = min(len(data[s]["rows"]) for s in seeds)
    ans_curve = np.nanmean([smooth(curve(data[s]["rows"][:T], "answer"), smooth_w) for s in seeds],
                           axis=0) if T else np.array([])
    return {"rows": rows, "answer_gain": bootstrap_gain(ans), "score_gain": bootstrap_gain(sco),
            "recall_gain": bootstrap_gain(rec), "curve_gain": quarter_gain(ans_curve), "T": T,
            "greedy_gain": bootstrap_gain(ans_g) if greedy else None,
            "n_questions": [len(a) for a in ans]}


def results_markdown(seeds, summ, commands, extra, smooth_w, threads, where) -> str:
    """docs/results.md's results section. threads: `thread_counts`; where: `machines`."""
    R = summ["rows"]
    m = lambda k: float(np.mean([r[k] for r in R]))  # noqa: E731
    g, gs, gr = summ["answer_gain"], summ["score_gain"], summ["recall_gain"]
    wf_min = min(r["wf_min"] for r in R)
    all_wf = [w for r in R for w in r["wf"]]
    colds = [r["cold_s"] for r in R if r["cold_s"] is not None]
    cacheds = [r["cached_s"] for r in R if r["cached_s"] is not None]
    rss = [r["rss_mb"] for r in R if r.get("rss_mb") is not None]
    L = [BEGIN, "## Results", "",
         f"Written by `scripts/reproduce.py` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.",
         f"Machine: {where}; torch threads: {threads}; git commit: {git_commit()}. {SPREAD}", "",
         "| seed | SFT answer | RL answer | gain | SFT mean-stage | RL mean-stage | fact recall SFT -> RL "
         "| well_formed min | wall cold | wall cached | peak RSS |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in R:
        L.append(f"| {r['seed']} | {r['sft_answer']:.3f} | {r['rl_answer']:.3f} | {r['gain']:+.3f} | "
                 f"{r['sft_score']:.3f} | {r['rl_score']:.3f} | {r['sft_recall']:.3f} -> "
                 f"{r['rl_recall']:.3f} | {r['wf_min']:.2f} | {_fmt_s(r['cold_s'])} | "
                 f"{_fmt_s(r['cached_s'])} | {_fmt_mb(r['rss_mb'])} |")
    L.append(f"| mean | {m('sft_answer'):.3f} | {m('rl_answer'):.3f} | {g[0]:+.3f} "
             f"[{g[1]:+.3f}, {g[2]:+.3f}] | {m('sft_score'):.3f} | {m('rl_score'):.3f} | "
             f"{m('sft_recall'):.3f} -> {m('rl_recall'):.3f} | {wf_min:.2f} | "
             f"{_fmt_s(float(np.mean(colds)) if colds else None)} | "
             f"{_fmt_s(float(np.mean(cacheds)) if cacheds else None)} | "
             f"{_fmt_mb(max(rss) if rss else None)} |")
    gg = summ.get("greedy_gain")
    if gg is not None:
        L += ["", "Greedy decoding (temperature 0, one rollout per held-out question; eval.json's "
              "`eval_sft_greedy` / `eval_rl_greedy`):", "",
              "| seed | SFT answer | RL answer | gain | fact recall SFT -> RL |", "|---|---|---|---|---|"]
        for r in R:
            L.append(f"| {r['seed']} | {r['sft_answer_g']:.3f} | {r['rl_answer_g']:.3f} | "
                     f"{r['rl_answer_g'] - r['sft_answer_g']:+.3f} | {r['sft_recall_g']:.3f} -> "
                     f"{r['rl_recall_g']:.3f} |")
        L.append(f"| mean | {m('sft_answer_g'):.3f} | {m('rl_answer_g'):.3f} | {gg[0]:+.3f} "
                 f"[{gg[1]:+.3f}, {gg[2]:+.3f}] | {m('sft_recall_g'):.3f} -> {m('rl_recall_g'):.3f} |")
    L += ["",
          f"- Held-out answer-score gain (RL - SFT): {g[0]:+.3f}, 95 % CI [{g[1]:+.3f}, {g[2]:+.3f}]; "
          f"mean-stage-score gain {gs[0]:+.3f} [{gs[1]:+.3f}, {gs[2]:+.3f}]; fact-recall gain "
          f"{gr[0]:+.3f} [{gr[1]:+.3f}, {gr[2]:+.3f}] (two-level bootstrap over seeds x "
          f"questions, {len(seeds)} seed(s) x {summ['n_questions'][0]} held-out questions, 10,000 "
          "replicates).",
          f"- Training answer-stage score (static rubric set, `score/answer`), mean over seeds, "
          f"{smooth_w}-step trailing average: last "
          f"quarter minus first quarter of {summ['T']} steps = {summ['curve_gain']:+.3f}.",
          f"- Lowest rollout/well_formed at any step of any seed: {wf_min:.2f}; its mean over "
          f"all steps and seeds {np.mean(all_wf):.3f}; steps below 0.8: "
          f"{sum(w < 0.8 for w in all_wf)} of {len(all_wf)}.",
          "- Wall time cold: SFT warm start trained in the run; cached: the same run minus the SFT "
          "data and training time it reported (measured when the warm start was loaded from cache). "
          "Peak RSS: the training process's maximum resident memory (getrusage; the mean row "
          "shows the largest).",
          "",
          "Targets: answer gain >= +0.20 at T = 1 and greedily, both CIs above 0; mean-stage gain "
          ">= +0.10; the warm start's greedy fact recall >= 0.6 and the fact-recall gain at T = 1 "
          ">= +0.10; training curve last-quarter minus first-quarter >= +0.1; well_formed >= 0.8 at "
          "every step; <= 8 min per run with the warm start loaded; peak RSS <= 3 GB. Met: "
          + ", ".join([
              f"gain T=1 {'yes' if g[0] >= 0.20 and g[1] > 0 else 'no'}",
              "gain greedy " + ("not measured" if gg is None else
                                "yes" if gg[0] >= 0.20 and gg[1] > 0 else "no"),
              f"mean-stage {'yes' if gs[0] >= 0.10 else 'no'}",
              "warm-start greedy recall " + ("not measured" if gg is None else
                                             "yes" if m("sft_recall_g") >= 0.6 else "no"),
              f"recall gain {'yes' if gr[0] >= 0.10 else 'no'}",
              f"curve {'yes' if summ['curve_gain'] >= 0.1 else 'no'}",
              f"well_formed {'yes' if wf_min >= 0.8 else 'no'}",
              "wall " + ("yes" if cacheds and max(cacheds) <= 480 else "no" if cacheds else "not measured"),
              "RSS " + ("yes" if rss and max(rss) <= 3 * 1024 else "no" if rss else "not measured"),
          ]) + ".",
          "",
          "Commands (from the repository root):", "", "```",
          f"python scripts/reproduce.py --seeds {' '.join(map(str, seeds))}"
          + (" " + " ".join(extra) if extra else "")]
    L += [f"# seed {s}: python {c}" for s, c in commands]
    L += ["```", "", "![training score per stage and held-out answer score](reward_curves.png)", END]
    return "\n".join(L) + "\n"


def console_summary(run_dir: str) -> list[str]:
    """The end-of-run summary train.py printed (from "run dir:" to "total time", and the verdict and
    next-step lines after it), read from the seed's reproduce.log; [] when the log has none."""
    path = os.path.join(run_dir, "reproduce.log")
    lines = open(path).read().splitlines() if os.path.exists(path) else []
    starts = [i for i, line in enumerate(lines) if line.startswith("run dir: ")]
    if not starts:
        return []
    out = []
    for line in lines[starts[-1]:]:
        if out and out[-1].startswith(("total time", "verdict: ", "next: ")) and \
                not line.startswith(("verdict: ", "next: ")):
            break
        out.append(line)
    return out


def thread_counts(config: dict) -> str:
    """A run's torch threads in words, from its config.json: "2 for training, 1 for sampling" (runs
    from before `sample_threads` existed sampled on `threads`)."""
    t = config.get("threads")
    return f"{t} for training, {config.get('sample_threads', 0) or t} for sampling"


def readme_markdown(seeds, summ, data, out: str, threads: str) -> str:
    """README.md's quick-start results: wall times, seed 0's console summary, the per-seed table and
    its intervals (the same runs as docs/results.md), the machine they ran on and the spread to
    expect on another. threads: the runs' torch threads, in words (`thread_counts`)."""
    R = summ["rows"]
    m = lambda k: float(np.mean([r[k] for r in R]))  # noqa: E731
    g, gs = summ["answer_gain"], summ["score_gain"]
    colds = [r["cold_s"] for r in R if r["cold_s"] is not None]
    cacheds = [r["cached_s"] for r in R if r["cached_s"] is not None]
    rss = [r["rss_mb"] for r in R if r.get("rss_mb") is not None]
    sft = data[seeds[0]]["eval"].get("sft", {})
    sft_s = sft.get("train_seconds", 0.0) + sft.get("data_seconds", 0.0)
    start = ("the run starts from the shipped SFT warm start (`toy/warm_start/`, built by "
             "`scripts/build_warm_start.py`; `--set sft.shipped=false` trains it in the run instead); "
             "a run takes " if sft.get("shipped") else
             f"the SFT warm start takes {_fmt_s(sft_s)} (teacher data and SFT, measured once, then "
             "cached in `.cache/rubricem`); a run with the warm start cached takes ")
    wall = (f"**Expected wall time** (this machine: {machines(seeds, data)}; torch threads: {threads}, the "
            "defaults; other jobs may have shared the cores): " + start
            + (f"{min(cacheds) / 60:.1f}-{_fmt_s(max(cacheds))}" if cacheds else "(not measured)")
            + (f", cold {_fmt_s(max(colds))}" if colds else "")
            + (f"; peak memory {_fmt_mb(max(rss))}" if rss else "") + ". "
            f"The run ends with a summary like this (seed {seeds[0]}; `[lo, hi]` is a 95 % bootstrap "
            "interval over the held-out questions):")
    summary = console_summary(os.path.join(out, f"seed{seeds[0]}"))
    if "artefacts:" in summary:  # the file list (one line per artefact) shortened to its first line
        i = summary.index("artefacts:")
        j = next((k for k in range(i + 1, len(summary)) if not summary[k].startswith("  ")), len(summary))
        summary = summary[:i] + [f"artefacts: ({j - i - 1} files in the run dir, listed here)"] + summary[j:]
    L = [README_BEGIN, wall, "", "```", *summary, "```",
         "", "Held-out toy scores (64 held-out questions x 2 samples at temperature 1.0, static judge "
         "rubrics; `python scripts/reproduce.py`, which runs the seeds and writes this table, the "
         "bootstrap intervals and the figure to docs/results.md and here):", "",
         "| seed | SFT score | RL score | SFT answer | RL answer | answer gain | fact recall SFT -> RL "
         "| lowest well_formed |", "|---|---|---|---|---|---|---|---|"]
    for r in R:
        L.append(f"| {r['seed']} | {r['sft_score']:.3f} | {r['rl_score']:.3f} | {r['sft_answer']:.3f} | "
                 f"{r['rl_answer']:.3f} | {r['gain']:+.3f} | {r['sft_recall']:.3f} -> {r['rl_recall']:.3f} "
                 f"| {r['wf_min']:.2f} |")
    L.append(f"| mean | {m('sft_score'):.3f} | {m('rl_score'):.3f} | {m('sft_answer'):.3f} | "
             f"{m('rl_answer'):.3f} | {g[0]:+.3f} [{g[1]:+.3f}, {g[2]:+.3f}] | {m('sft_recall'):.3f} -> "
             f"{m('rl_recall'):.3f} | {min(r['wf_min'] for r in R):.2f} |")
    gg = summ.get("greedy_gain")
    greedy = ("" if gg is None else
              f" Decoded greedily (one rollout per question) the answer score goes from "
              f"{m('sft_answer_g'):.3f} to {m('rl_answer_g'):.3f}, {gg[0]:+.3f} [{gg[1]:+.3f}, "
              f"{gg[2]:+.3f}], and fact recall from {m('sft_recall_g'):.3f} to {m('rl_recall_g'):.3f}.")
    L += ["", f"`[lo, hi]`: 95 % bootstrap interval over seeds x questions; the mean-stage score gains "
          f"{gs[0]:+.3f} [{gs[1]:+.3f}, {gs[2]:+.3f}]; the training answer curve (`score/answer`, "
          f"{summ['T']} steps) moves {summ['curve_gain']:+.3f} from its first to its last quarter."
          + greedy + " " + SPREAD, README_END]
    return "\n".join(L) + "\n"


def write_results(path: str, section: str, begin: str = BEGIN, end: str = END,
                  append: bool = True) -> None:
    """Replace the text between the markers `begin` / `end` of `path` (a section that starts with
    `begin` and ends with `end`); without the markers, append the section (append=False: leave the
    file alone)."""
    old = open(path).read() if os.path.exists(path) else "# Results\n\n"
    if begin in old and end in old:
        new = old[: old.index(begin)] + section.rstrip("\n") + old[old.index(end) + len(end):]
    elif append:
        new = old.rstrip("\n") + "\n\n" + section
    else:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(new)
    os.replace(tmp, path)


def plot(seeds, data, summ, path: str, smooth_w: int) -> None:
    """Four panels (one per stage): smoothed training score per RL step per seed and their mean;
    the Answer panel adds the held-out answer score of the SFT start and of the final policy."""
    import matplotlib  # lazy: matplotlib only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib only for the figure

    fig, axes = plt.subplots(1, 4, figsize=(13, 3.4), dpi=110, sharey=True)
    T = summ["T"]
    for k, (ax, s) in enumerate(zip(axes, STAGES)):
        curves = []
        for seed in seeds:
            c = smooth(curve(data[seed]["rows"][:T], s), smooth_w)
            curves.append(c)
            ax.plot(range(T), c, color=f"C{k}", alpha=0.35, lw=1)
        ax.plot(range(T), np.nanmean(curves, axis=0), color=f"C{k}", lw=2.5,
                label=f"train {s} (mean of {len(seeds)} seeds)")
        if s == "answer":
            e0 = np.mean([summ_r["sft_answer"] for summ_r in summ["rows"]])
            e1 = np.mean([summ_r["rl_answer"] for summ_r in summ["rows"]])
            ax.axhline(e0, color="k", ls="--", lw=1.2, label=f"held-out, SFT start {e0:.3f}")
            ax.axhline(e1, color="k", ls=":", lw=1.8, label=f"held-out, final policy {e1:.3f}")
        ax.set_title(s)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=7)
    axes[0].set_ylabel(f"stage score ({smooth_w}-step average)")
    axes[0].set_ylim(0, 1)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--quick", action="store_true", help="6 RL steps and 32 held-out questions")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "reproduce"))
    ap.add_argument("--results", default=os.path.join(ROOT, "docs", "results.md"))
    ap.add_argument("--figure", default=os.path.join(ROOT, "docs", "reward_curves.png"))
    ap.add_argument("--readme", default=os.path.join(ROOT, "README.md"),
                    help="README whose quick-start results (between the reproduce-readme markers) "
                         "are rewritten; a file without the markers is left alone")
    ap.add_argument("--smooth", type=int, default=6,
                    help="trailing moving-average window (steps); 6 = one curriculum window (2K)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="passed through to train.py")
    ap.add_argument("--python", default=sys.executable)
    a = ap.parse_args(argv)
    extra = (QUICK if a.quick else []) + [x for kv in a.set for x in ("--set", kv)]
    commands, data = [], {}
    for s in a.seeds:
        info = run_seed(s, a.out, extra, a.python)
        commands.append((s, info["command"]))
        data[s] = load_seed(info["run_dir"])
    with open(os.path.join(a.out, f"seed{a.seeds[0]}", "config.json")) as fh:
        threads = thread_counts(json.load(fh))
    summ = summarise(a.seeds, data, a.smooth)
    shown = (["--quick"] if a.quick else []) + [x for kv in a.set for x in ("--set", kv)]
    write_results(a.results, results_markdown(a.seeds, summ, commands, shown, a.smooth, threads,
                                              machines(a.seeds, data)))
    if not a.quick and not a.set:  # the README shows the default run only
        write_results(a.readme, readme_markdown(a.seeds, summ, data, a.out, threads), README_BEGIN,
                      README_END, append=False)
    plot(a.seeds, data, summ, a.figure, a.smooth)
    g = summ["answer_gain"]
    print(f"held-out answer gain {g[0]:+.3f} [{g[1]:+.3f}, {g[2]:+.3f}]; curve last-first quarter "
          f"{summ['curve_gain']:+.3f}; results in {a.results}, figure {a.figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

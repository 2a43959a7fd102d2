"""Memory reuse on held-out questions: does placing rubric-bank reflections in the prompt help a trained
policy, across episodes (other questions' lessons) and within an episode (its own lesson)?

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements the memory-reuse analysis of the ablations (Fig. 6d: RubricEM +0.4 / +0.7 at cross-episode
pass 1 / within-episode pass 2, Baseline RL -0.5 / -0.6) with the two retrieval modes of §3.5 and the
reflection branch of §3.4:

    pass 1  the policy answers the held-out questions with "cross-episode similar" retrieval: the
            top-k bank items of similar *other* questions (the bank the run wrote for its training
            questions), and again without memory, with the same sampling seed;
    reflect the policy reflects on its own pass-1 trajectory of each question (reflection.py: one
            trajectory per question, m candidates at temperature 0.7, the judge scores them with
            privileged information, the best valid one is upserted), into a *copy* of the bank;
    pass 2  the policy answers the same questions again with "within-episode exact" retrieval (the
            reflection just written for that very question), and again without memory, with a
            second sampling seed shared by both.
Each pass reports with-memory minus without-memory on the held-out answer score and the mean stage
score (heldout.evaluate_heldout's static rubrics), means over questions with 95 % paired bootstrap intervals
over questions (report.bootstrap_ci), and the share of questions that received an item.

    oracle  the control that bounds what memory can do (not in the paper; toy world only): the SFT
            start and the trained policy answer the held-out questions with an oracle lesson in the
            prompt (toy.sft.oracle_lesson: every asked fact named as missed and each old record's
            value named as wrong, from ground truth, in the teacher's reflection format) and
            without, with the pass-1 sampling seed. If even this gains nothing, the policy has not
            learned to act on what a lesson says, and no reflection can help it.
    attempt the second control (ours, toy world only; with oracle): the ceiling of pass 2. The policy
            answers without memory (pass-1 seed); each question's first sample gets the lesson a
            perfect reflection on it would write (ToyJudge.attempt_lesson: only the facts that
            attempt missed or got wrong, by name, from ground truth); the policy answers again with
            that lesson and without (pass-2 seed). An own reflection can at best match it, so if
            this gains little, pass 2 cannot tell a better reflection writer from a worse one.

Glossary: delta_p = mean_q (s_q^mem - s_q^none) for pass p, s_q the mean over the question's samples.

Deviations from the paper
    1. The paper does not describe its memory-reuse protocol beyond the two passes; the paired seeds,
       the fresh judge for the reflection step (held-out questions have no rubric buffers) and the
       bank copy are ours.
    2. An arm without a bank of its own (ss_grpo, baseline_rl, baseline_rl_info) has nothing to
       retrieve in pass 1; `bank_path` can point at another run's bank (scripts/ablate.py uses the same
       seed's rubricem run), which then measures whether this policy can use memory written by the
       trained meta-policy. Pass 2 always uses the policy's own reflections.

Launch
    python scripts/memory_eval.py runs/toy                          # writes runs/toy/memory.json
    python scripts/ablate.py memory --run-dir runs/toy      # the same
    python scripts/memory_eval.py runs/toy-baseline_rl --bank runs/toy/bank.jsonl --n-questions 16
    python scripts/memory_eval.py runs/toy --oracle                 # and the two controls (oracle, attempt)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import sys
import time
from typing import Sequence

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backends.run import build, checkpoint as ckpt_mod, heldout, presets, report
from bank import MODE_EXACT, MODE_SIMILAR, RubricBank, format_for_prompt
from reflection import run_reflection_branch
from scaffold import RolloutEngine, system_prompt
from toy.model import load_policy

log = logging.getLogger("rubricem")

PASSES = (("pass1", MODE_SIMILAR), ("pass2", MODE_EXACT))


def build_sampler(cfg, model, tok):
    """The sampler every pass and the reflection step use: the run's own over the policy
    (build.torch_sampler: the KV-cache decode loop for the toy's sampler "kv", HF generate for
    "hf"; vLLM runs are sampled with HF generate here), under the run's precision and sampling
    threads, as the run's held-out evaluation samples."""
    if cfg.sampler not in ("kv", "hf"):
        cfg = dataclasses.replace(cfg, sampler="hf")
    return build.torch_sampler(cfg, model, tok)


def retrieve_items(bank: RubricBank, queries: Sequence, mode: str, k: int) -> list[list[str]]:
    """Per query, the bank reflections its prompt gets in `mode` ("similar": top-k items of other
    questions; "exact": the question's own item), as format_for_prompt strings."""
    return [format_for_prompt(bank.retrieve(q.query, mode, k=k)) for q in queries]


def paired_delta(with_mem: dict, without: dict) -> dict:
    """with-memory minus without-memory for two heldout.evaluate_heldout results on the same questions:
    for "answer" and "score", the mean difference and its 95 % paired bootstrap interval over
    questions ([lo, hi]), and the per-question differences."""
    out = {}
    for key in ("answer", "score"):
        d = np.asarray(with_mem["per_question"][key]) - np.asarray(without["per_question"][key])
        lo, hi = report.bootstrap_ci(d)
        out[key] = float(d.mean()) if d.size else float("nan")
        out[f"{key}_ci"] = [lo, hi]
        out[f"{key}_per_question"] = d.tolist()
    return out


def memory_reuse(run_dir: str, bank_path: str | None = None, n_questions: int | None = None,
                 samples: int | None = None, threads: int | None = None, oracle: bool = False,
                 sft_cache: str | None = None) -> dict:
    """The two-pass memory-reuse evaluation of a finished run (module docstring).

    run_dir: a train.py run directory with config.json and final/ (the trained policy); bank_path:
    the bank to retrieve from in pass 1 (default run_dir/bank.jsonl; a missing file is an empty bank,
    reported as hits 0). n_questions / samples: held-out questions and samples per question (default:
    the run's eval.n_questions / eval.samples). Returns a JSON-serialisable dict: per pass its
    retrieval mode, hits (share of questions with >= 1 item, in [0, 1]), the two evaluations
    ("with", "without") and "delta" (paired_delta); "reflection" (the reflection step's metrics,
    reflect/*) and the settings; with oracle=True also "oracle": {"sft", "final"}, the oracle-lesson
    control of the run's SFT start and of its final policy (each "with", "without", "delta"), and
    "attempt": {"sft", "final"}, the attempt-lesson control (attempt_control); with oracle="only"
    the two controls alone (no passes, no bank). sft_cache: a JSON file that holds the SFT start's
    controls (oracle, attempt, content) under a key of everything they depend on (the SFT start, its
    questions, samples, seeds and sampling settings): reused when the key matches, else computed and
    written there (the runs of one seed share their SFT start; a grid computes them once per start
    and seed). Raises FileNotFoundError for a run
    dir without config.json or final/,
    ValueError for a run whose judge is not the toy judge (the held-out score needs the toy world's
    static rubrics) or with no held-out questions.
    """
    t_start = time.perf_counter()
    cfg_path, final = os.path.join(run_dir, "config.json"), os.path.join(run_dir, "final")
    for p in (cfg_path, final):
        if not os.path.exists(p):
            raise FileNotFoundError(f"{p} not found: memory_reuse needs a finished train.py run")
    cfg = presets.load_config(json.load(open(cfg_path)))
    if cfg.judge.backend != "toy":
        raise ValueError("memory_reuse scores with the toy judge's static rubrics: it needs a toy run")
    if cfg.rollout.scaffold != "structured":
        raise ValueError(f"memory_reuse needs the structured scaffold (reflections, <memory> prompts); "
                         f"{run_dir} used rollout.scaffold = {cfg.rollout.scaffold!r}")
    n_q = cfg.eval.n_questions if n_questions is None else n_questions
    n_s = cfg.eval.samples if samples is None else samples
    if threads is not None:  # every pass samples: the override sets the sampling threads too
        cfg.threads = cfg.sample_threads = threads
    torch.set_num_threads(cfg.threads)
    world, tool, _, held_q = build.build_environment(cfg)
    qs = held_q[:n_q]
    if not qs or n_s < 1:
        raise ValueError(f"no held-out questions to evaluate (n_questions = {n_q}, samples = {n_s})")
    model, tok = load_policy(final)
    model.eval()
    system = system_prompt(cfg.rollout.scaffold, cfg.rollout.system_prompt)
    sampler = build_sampler(cfg, model, tok)
    engine = RolloutEngine(sampler, tok, {tool.name: tool}, cfg.rollout.max_response_tokens,
                           cfg.rollout.max_tool_calls, system, cfg.rollout.temperature)
    judge = build.build_judge(cfg, world)  # fresh: held-out questions have no rubric buffers
    seed = heldout.heldout_seed(cfg)
    seeds = {"pass1": seed, "pass2": seed + 1}  # pass 1 = the final evaluation's

    def add_oracle(out: dict, first=None, without1=None, without2=None) -> dict:
        # the final policy's controls reuse the passes' samples without memory (the same seeds)
        out["oracle"] = {"final": oracle_control(engine, judge, world, qs, n_s, cfg, seeds["pass1"],
                                                 without1)}
        out["attempt"] = {"final": attempt_control(engine, judge, qs, n_s, cfg, seeds, first, without2)}
        out["content"] = {"final": content_control(engine, judge, qs, n_s, cfg, seeds["pass1"], without1)}
        sft = json.load(open(os.path.join(run_dir, "eval.json")))["sft"]
        src = sft["source"]
        key = _normal({"source": src, "sft_key": sft.get("key"), "questions": [q.query for q in qs],
                          "samples": n_s, "seeds": seeds, "rollout": dataclasses.asdict(cfg.rollout),
                          "eval_temperature": cfg.eval.temperature, "sampler": cfg.sampler,
                          "precision": cfg.precision, "world": dataclasses.asdict(cfg.world)})
        cached = _read_cache(sft_cache, key)
        if cached is None:
            sft_model, sft_tok = load_policy(src)
            sft_model.eval()
            sft_engine = RolloutEngine(build_sampler(cfg, sft_model, sft_tok),
                                       sft_tok, {tool.name: tool}, cfg.rollout.max_response_tokens,
                                       cfg.rollout.max_tool_calls, system, cfg.rollout.temperature)
            cached = {"oracle": oracle_control(sft_engine, judge, world, qs, n_s, cfg, seeds["pass1"]),
                      "attempt": attempt_control(sft_engine, judge, qs, n_s, cfg, seeds),
                      "content": content_control(sft_engine, judge, qs, n_s, cfg, seeds["pass1"])}
            cached["oracle"]["source"] = src
            if sft_cache:
                ckpt_mod.atomic_write_json(sft_cache, {"key": key, "controls": cached})
        for control in ("oracle", "attempt", "content"):
            out[control]["sft"] = cached[control]
        out["seconds"] = time.perf_counter() - t_start
        return out

    if oracle == "only":
        return add_oracle({"run_dir": run_dir, "n_questions": len(qs), "samples": n_s,
                           "seeds": seeds, "arm": cfg.arm})
    retriever = None
    if cfg.bank.retriever == "dense":
        # lazy: scale backend, the dense retriever only when the run used it
        from backends.scale.retrieval import DenseRetriever

        retriever = DenseRetriever(cfg.bank.embed_model)
    bank_path = bank_path or os.path.join(run_dir, "bank.jsonl")
    bank = RubricBank.load(bank_path, missing_ok=True, strict=False, retriever=retriever,
                           max_chars=cfg.bank.max_chars)
    def run_pass(name: str, items: list[list[str]] | None) -> tuple[dict, list]:
        ro = heldout.sample_heldout(engine, qs, n_s, cfg.eval.temperature, seeds[name], items)
        return heldout.heldout_scores(judge, qs, ro, n_s), ro

    out: dict = {"run_dir": run_dir, "bank": bank_path, "bank_size": len(bank), "n_questions": len(qs),
                 "samples": n_s, "top_k": cfg.bank.top_k, "seeds": seeds, "arm": cfg.arm}
    # pass 1: cross-episode similar retrieval from the run's bank
    items1 = retrieve_items(bank, qs, MODE_SIMILAR, cfg.bank.top_k)
    with1, ro1 = run_pass("pass1", items1)
    without1, ro_none1 = run_pass("pass1", None)
    # reflection on the pass-1 trajectories into a copy of the bank (§3.4: best valid one upserted)
    copy = RubricBank(max_chars=cfg.bank.max_chars, retriever=retriever)
    copy.load_state_dict(bank.state_dict())
    judged = {}
    for gi, q in enumerate(qs):
        res = judge.judge_group(q, ro1[gi * n_s:(gi + 1) * n_s], cfg.steps)
        for j in range(n_s):
            judged[gi * n_s + j] = (res, j)
    torch.manual_seed(cfg.seed + 12347)
    rcfg = dataclasses.replace(cfg.reflection, train=False)  # bank only, no GRPO batch
    _, rmet = run_reflection_branch(cfg.steps, ro1, judged, judge, copy, sampler, tok, system, rcfg,
                                    random.Random(cfg.seed + 12347), cfg.ss_grpo.std, cfg.ss_grpo.eps,
                                    group_size=n_s)
    # pass 2: within-episode exact retrieval of the reflection just written for each question
    items2 = retrieve_items(copy, qs, MODE_EXACT, cfg.bank.top_k)
    with2, _ = run_pass("pass2", items2)
    without2, _ = run_pass("pass2", None)
    # the randomised control of pass 2: each question gets another question's exact item (the same
    # form, written the same way), so own minus foreign isolates what the lesson says of this one
    foreign2, _ = run_pass("pass2", derange(items2))
    for name, mode, items, w, wo in (("pass1", MODE_SIMILAR, items1, with1, without1),
                                     ("pass2", MODE_EXACT, items2, with2, without2)):
        out[name] = {"mode": mode, "hits": float(np.mean([len(x) > 0 for x in items])),
                     "items": float(np.mean([len(x) for x in items])), "with": w, "without": wo,
                     "delta": paired_delta(w, wo)}
    out["pass2"]["foreign"] = foreign2
    out["pass2"]["own_minus_foreign"] = paired_delta(with2, foreign2)
    out["reflection"] = {k: report._py(v) for k, v in rmet.items()}
    if oracle:
        return add_oracle(out, ro_none1, without1, without2)
    out["seconds"] = time.perf_counter() - t_start
    return out


def derange(items: Sequence) -> list:
    """items[i + 1] for position i (the last gets the first): every question another question's
    retrieved items, in a fixed order (the foreign-lesson controls); a single item stays."""
    return list(items[1:]) + list(items[:1])


# The general clause of every lesson the controls write (the attempt and oracle lessons' own), the
# same in both lessons of a content-index pair, so that only the named facts differ.
CONTENT_CLAUSE = ("plan every asked aspect", "every found fact in the writing plan")


def split_facts(qs: Sequence, rng: random.Random) -> list[tuple[list[str], list[str]] | None]:
    """Per question, its asked facts ("Entity aspect") split at random into two non-empty halves
    (A, B) (a random order, cut at a random point), or None for a question with fewer than 2."""
    out = []
    for q in qs:
        keys = [f"{f['entity']} {f['aspect']}" for f in q.facts]
        if len(keys) < 2:
            out.append(None)
            continue
        rng.shuffle(keys)
        cut = rng.randint(1, len(keys) - 1)
        out.append((sorted(keys[:cut]), sorted(keys[cut:])))
    return out


def content_control(engine, judge, qs: Sequence, n_s: int, cfg, seed: int,
                    without: dict | None = None) -> dict:
    """The content index (ours, toy world only): does the policy act on what a lesson *says*?

    Each question's asked facts are split at random into two halves A and B (`split_facts`); lesson A
    names the facts of A as missed, lesson B those of B, in the teacher's reflection format with
    the same general clause (CONTENT_CLAUSE). The policy answers with lesson A and, with the same
    sampling seed, with lesson B. For a fact, its rate is the share of samples whose answer states
    it with the right value (ToyJudge.fact_hits); the content index of a question is the mean over
    its facts of (rate under the lesson that names the fact) - (rate under the lesson that does
    not): 0 for a reader that reacts to a lesson's form only, up to 1 for one that writes exactly
    the named facts. Also a foreign-lesson control: each question gets another question's lesson A
    (`derange`: the same form, nothing about this question), against no lesson, and lesson A or B
    (its own, naming some of its facts) against no lesson.

    Returns {"index", "index_ci" (95 % bootstrap over questions), "per_question", "named", "other"
    (mean fact rates, in [0, 1]), "questions" (how many have >= 2 facts), "foreign" and "own"
    (paired_delta against no lesson), "lessons" (the first question's pair)}. without: the scores
    without memory at `seed` for the same questions (memory_reuse's pass 1), or None to sample them.
    Raises ValueError when the judge has no ground truth or no question has two asked facts."""
    from toy.teacher import lesson_text  # toy world only: the teacher's lesson format

    if not hasattr(judge, "fact_hits"):
        raise ValueError("the content index needs the toy judge's ground truth")
    pairs = split_facts(qs, random.Random(seed + 7177))
    keep = [i for i, p in enumerate(pairs) if p is not None]
    if not keep:
        raise ValueError("the content index needs questions with at least two asked facts")
    if len(keep) < len(qs):
        without = None  # computed on another set of questions
    q2 = [qs[i] for i in keep]
    lesson = {h: [[lesson_text(pairs[i][h], [], CONTENT_CLAUSE)] for i in keep] for h in (0, 1)}
    ro = {h: heldout.sample_heldout(engine, q2, n_s, cfg.eval.temperature, seed, lesson[h])
          for h in (0, 1)}
    hits = {h: [judge.fact_hits(q2[g], ro[h][g * n_s + s]) for g in range(len(q2)) for s in range(n_s)]
            for h in (0, 1)}
    per_q, named, other = [], [], []
    for g, i in enumerate(keep):
        rate = {h: {k: float(np.mean([hits[h][g * n_s + s][k] for s in range(n_s)]))
                    for k in hits[h][g * n_s]} for h in (0, 1)}
        d = []
        for h in (0, 1):  # a fact of half h is named by lesson h and not by lesson 1 - h
            for k in pairs[i][h]:
                named.append(rate[h][k])
                other.append(rate[1 - h][k])
                d.append(rate[h][k] - rate[1 - h][k])
        per_q.append(float(np.mean(d)))
    lo, hi = report.bootstrap_ci(np.asarray(per_q))
    res = {"index": float(np.mean(per_q)), "index_ci": [lo, hi], "per_question": per_q,
           "named": float(np.mean(named)), "other": float(np.mean(other)), "questions": len(q2),
           "lessons": [lesson[0][0][0], lesson[1][0][0]]}
    if without is None:
        without = heldout.evaluate_heldout(engine, judge, q2, n_s, cfg.eval.temperature, seed)
    foreign = heldout.heldout_scores(judge, q2, heldout.sample_heldout(
        engine, q2, n_s, cfg.eval.temperature, seed, derange(lesson[0])), n_s)
    res["foreign"] = {"with": foreign, "delta": paired_delta(foreign, without)}
    own = heldout.heldout_scores(judge, q2, ro[0], n_s)
    res["own"] = {"with": own, "delta": paired_delta(own, without)}
    return res


def _normal(d: dict) -> dict:
    """`d` as it reads back from JSON (tuples as lists, keys sorted, other objects as text): what
    a cache key is compared as."""
    return json.loads(json.dumps(d, sort_keys=True, default=str))


def _read_cache(path: str | None, key: dict) -> dict | None:
    """The SFT start's controls cached at `path` under `key` (memory_reuse's sft_cache), or None when
    there is no file, it cannot be read, or it was written for another key."""
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as fh:
            got = json.load(fh)
    except (OSError, ValueError):
        return None
    return got.get("controls") if isinstance(got, dict) and got.get("key") == key else None


def oracle_control(engine, judge, world, qs: Sequence, n_s: int, cfg, seed: int,
                   without: dict | None = None) -> dict:
    """The oracle-lesson control (module docstring): `engine`'s policy answers the questions `qs`
    (n_s samples each, cfg.eval.temperature, sampling seed `seed`) with toy.sft.oracle_lesson in the
    prompt and without. Returns {"with", "without", "delta"} as a pass of memory_reuse does, plus
    "lesson" (the first question's oracle lesson, for the reader). without: the scores without
    memory at `seed` when the caller has them (memory_reuse's pass 1); None samples them. Raises
    ValueError without a toy world (the lesson is built from its ground truth)."""
    from toy.sft import oracle_lesson  # toy world only: the lesson reads its ground truth

    if world is None:
        raise ValueError("the oracle-lesson control needs the toy world's ground truth")
    items = [[oracle_lesson(q, world)] for q in qs]
    res = {}
    for name, it in (("with", items), ("without", None)):
        if name == "without" and without is not None:
            res[name] = without
            continue
        ro = heldout.sample_heldout(engine, qs, n_s, cfg.eval.temperature, seed, it)
        res[name] = heldout.heldout_scores(judge, qs, ro, n_s)
    res["delta"] = paired_delta(res["with"], res["without"])
    res["lesson"] = items[0][0] if items else ""
    return res


def attempt_control(engine, judge, qs: Sequence, n_s: int, cfg, seeds: dict, first: list | None = None,
                    without: dict | None = None) -> dict:
    """The attempt-lesson control (module docstring): `engine`'s policy answers the questions `qs`
    without memory (n_s samples each, cfg.eval.temperature, seed seeds["pass1"]); each question's
    first sample gets the lesson a perfect reflection on it would write (ToyJudge.attempt_lesson:
    its failed facts by name, from ground truth); the policy then answers again with that lesson
    in the prompt and without (seed seeds["pass2"], as pass 2). Returns {"with", "without",
    "delta"} as a pass of memory_reuse does, plus "named" (share of questions whose lesson names a
    failed fact, in [0, 1]) and "lesson" (the first question's). first / without: the first
    attempt's rollouts and the pass-2-seed scores without memory when the caller sampled them
    already (memory_reuse's passes, the same seeds); None samples them. Raises ValueError when the
    judge has no ground truth (not the toy judge)."""
    if not hasattr(judge, "attempt_lesson"):
        raise ValueError("the attempt-lesson control needs the toy judge's ground truth")
    if first is None:
        first = heldout.sample_heldout(engine, qs, n_s, cfg.eval.temperature, seeds["pass1"])
    items = [[judge.attempt_lesson(q, first[i * n_s])] for i, q in enumerate(qs)]
    res = {}
    for name, it in (("with", items), ("without", None)):
        if name == "without" and without is not None:
            res[name] = without
            continue
        ro = heldout.sample_heldout(engine, qs, n_s, cfg.eval.temperature, seeds["pass2"], it)
        res[name] = heldout.heldout_scores(judge, qs, ro, n_s)
    res["delta"] = paired_delta(res["with"], res["without"])
    res["named"] = float(np.mean([it[0].startswith(("missed:", "wrong:")) for it in items]))
    res["lesson"] = items[0][0] if items else ""
    return res


def summary_lines(res: dict) -> list[str]:
    """Human-readable lines for a memory_reuse result."""
    lines = [f"memory reuse of {res['run_dir']} (arm {res['arm']}; bank {res.get('bank', '-')}, "
             f"{res.get('bank_size', 0)} entries; {res['n_questions']} held-out questions x "
             f"{res['samples']})"]
    for name, label in (("pass1", "pass 1, cross-episode similar"),
                        ("pass2", "pass 2, within-episode exact")):
        if name not in res:
            continue
        p = res[name]
        d = p["delta"]
        lines.append(f"  {label:<30} answer {p['with']['answer']:.3f} with vs {p['without']['answer']:.3f} "
                     f"without: {d['answer']:+.3f} [{d['answer_ci'][0]:+.3f}, {d['answer_ci'][1]:+.3f}]; "
                     f"score {d['score']:+.3f}; hits {p['hits']:.2f}")
    if "own_minus_foreign" in res.get("pass2", {}):
        d = res["pass2"]["own_minus_foreign"]
        lines.append(f"  {'pass 2, own minus foreign':<30} answer {d['answer']:+.3f} "
                     f"[{d['answer_ci'][0]:+.3f}, {d['answer_ci'][1]:+.3f}] (another question's "
                     f"lesson of the same form in its place)")
    if "reflection" in res:
        r = res["reflection"]
        lines.append(f"  reflection: {r.get('reflect/admitted', 0)} of {r.get('reflect/trajectories', 0)} "
                     f"questions got a lesson ({r.get('reflect/invalid', 0)} invalid candidates)")
    for control, label in (("oracle", "oracle lesson"), ("attempt", "attempt lesson")):
        for who in ("sft", "final"):
            o = res.get(control, {}).get(who)
            if o:
                d = o["delta"]
                head = f"{label}, {'SFT start' if who == 'sft' else 'final policy'}"
                lines.append(f"  {head:<30}"
                             f"answer {o['with']['answer']:.3f} with vs {o['without']['answer']:.3f} "
                             f"without: {d['answer']:+.3f} [{d['answer_ci'][0]:+.3f}, {d['answer_ci'][1]:+.3f}]"
                             + (f"; {o['named']:.2f} of the lessons name a failed fact" if "named" in o else ""))
    for who in ("sft", "final"):
        c = res.get("content", {}).get(who)
        if c:
            lines.extend(content_lines(c, "SFT start" if who == "sft" else "final policy"))
    return lines


def content_lines(c: dict, who: str) -> list[str]:
    """Two lines for a content_control result of `who`."""
    f = c["foreign"]["delta"]
    return [f"  {'content index, ' + who:<30} {c['index']:+.3f} [{c['index_ci'][0]:+.3f}, "
            f"{c['index_ci'][1]:+.3f}] (a fact stated {c['named']:.3f} when its lesson names it, "
            f"{c['other']:.3f} when the other half's does; {c['questions']} questions)",
            f"  {'foreign lesson, ' + who:<30} answer {f['answer']:+.3f} [{f['answer_ci'][0]:+.3f}, "
            f"{f['answer_ci'][1]:+.3f}] against none (own half-lesson "
            f"{c['own']['delta']['answer']:+.3f})"]


def policy_content(policy_dir: str, n_questions: int, samples: int, threads: int | None = None,
                   overrides: Sequence[str] = ()) -> dict:
    """The content index of a policy directory outside a run (a warm start before any RL: the gate
    of a reader that reads): the toy preset with `overrides` ("key=value", as train.py's --set)
    builds the world, held-out questions and judge; the policy samples as a run's evaluation does
    (its seed, temperature, budgets). Returns content_control's result plus "policy", "n_questions",
    "samples". Raises FileNotFoundError for a missing directory."""
    from backends.run import overrides as ov

    if not os.path.isdir(policy_dir):
        raise FileNotFoundError(f"{policy_dir} is not a policy directory")
    cfg = presets.toy_preset()
    for kv in overrides:
        ov.set_override(cfg, kv)
    if threads is not None:
        cfg.threads = cfg.sample_threads = threads
    torch.set_num_threads(cfg.threads)
    world, tool, _, held_q = build.build_environment(cfg)
    qs = held_q[:n_questions]
    model, tok = load_policy(policy_dir)
    model.eval()
    system = system_prompt(cfg.rollout.scaffold, cfg.rollout.system_prompt)
    engine = RolloutEngine(build_sampler(cfg, model, tok), tok,
                           {tool.name: tool}, cfg.rollout.max_response_tokens,
                           cfg.rollout.max_tool_calls, system, cfg.rollout.temperature)
    judge = build.build_judge(cfg, world)
    res = content_control(engine, judge, qs, samples, cfg, heldout.heldout_seed(cfg))
    return {"policy": policy_dir, "n_questions": len(qs), "samples": samples, **res}


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: evaluate memory reuse of one run, write JSON (default run_dir/memory.json).
    Exit codes: 0 done, 2 unusable run directory or settings."""
    ap = argparse.ArgumentParser(description="memory reuse on held-out questions (pass 1 similar, "
                                             "pass 2 exact; with minus without memory)")
    ap.add_argument("run_dir", nargs="?", help="a finished train.py run (config.json, final/, bank.jsonl)")
    ap.add_argument("--policy", help="instead of a run: the content index of this policy directory "
                    "(e.g. a warm start) under the toy preset and --set overrides")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="with --policy: a configuration override, as train.py's")
    ap.add_argument("--bank", help="bank for pass 1 (default RUN_DIR/bank.jsonl)")
    ap.add_argument("--n-questions", type=int,
                    help="held-out questions (default: the run's eval.n_questions)")
    ap.add_argument("--samples", type=int, help="samples per question (default: the run's eval.samples)")
    ap.add_argument("--threads", type=int,
                    help="torch threads (default: the run's threads and sample_threads)")
    ap.add_argument("--out", help="output JSON (default RUN_DIR/memory.json)")
    ap.add_argument("--oracle", action="store_true",
                    help="also the oracle-lesson and attempt-lesson controls of the SFT start and "
                         "the final policy")
    ap.add_argument("--oracle-only", action="store_true", help="only the two controls")
    ap.add_argument("--sft-cache", help="a JSON file for the SFT start's controls, reused by the "
                    "runs that share that start (memory_reuse's sft_cache)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    if a.policy:
        try:
            res = policy_content(a.policy, a.n_questions or 64, a.samples or 2, a.threads, a.set)
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if a.out:
            ckpt_mod.atomic_write_json(a.out, res)
        print("\n".join(content_lines(res, a.policy)))
        return 0
    if not a.run_dir:
        ap.error("give a run directory, or --policy DIR")
    try:
        res = memory_reuse(a.run_dir, a.bank, a.n_questions, a.samples, a.threads,
                           "only" if a.oracle_only else a.oracle, a.sft_cache)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ckpt_mod.atomic_write_json(a.out or os.path.join(a.run_dir, "memory.json"), res)
    print("\n".join(summary_lines(res)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

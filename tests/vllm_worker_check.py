"""End-to-end check of `vllm_sampler.VLLMSampler` and `vllm_sync_ext` on a real vLLM engine.

RubricEM (arXiv 2605.10899), full-mode plumbing for §3.1-3.3: rollouts sampled by vLLM through the
real `scaffold.RolloutEngine` with a BM25 tool, engine log-probs against the trainer's (HF) log-probs,
and the weight sync after an update. Not a pytest module: it runs inside the vLLM virtual environment
(tests/test_vllm_sampler.py starts it) and prints one JSON object on its last stdout line.

    PYTHONPATH=. /work/vllm-venv/bin/python tests/vllm_worker_check.py [--workdir DIR]

Checks (each a key of the JSON summary; "ok" is their conjunction)
  (a) rollouts: the engine's ids are the sampler's ids (token-in/token-out), every policy turn ends
      at `</call_tool>`, <|im_end|> or its budget, tool outputs are appended as token ids and the
      rollout continues from them; a real BM25 call returns evidence; vLLM's own stopping never
      needed the HF-rule guard; duplicated prompts sample differently; a fixed seed repeats.
  (b) fp32 prompt log-probs of the engine vs `policy.token_logprobs` (max |diff| <= 1e-4).
  (c) weight sync: update A -> B (chunked), engine matches HF-B and no longer A; sync back B -> A,
      engine matches A again and a seeded generation repeats exactly; timing of each sync.
      A sync that misses a tensor, and one that times out, raise WeightSyncError, and
      `reload_from_checkpoint` repairs the engine.
  (d) cost of the fallback: save to tmpfs + in-place `weights_path` reload, and a full rebuild.

The toy model is `toy_model.build_tiny_qwen3(size="XS")` with a locally trained tokenizer in which the
scaffold tags are single tokens. A random model never writes a tool call, so we edit its (tied)
embedding: column 0 is set to a constant for every token, which gives the final hidden state a
large, always positive coordinate 0 and adds the same logit to every token (no effect on the
softmax), except for `</call_tool>`, the call opening tag and <|im_end|>, whose column-0 entries get
a little more, so they are sampled at a few per cent per step. HF and vLLM compute the same
function of these weights, so every comparison below is exact up to fp32 rounding.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

TOL = 1e-4  # max |log-prob difference| engine (fp32) vs HF (fp32)


def _env_defaults() -> None:
    # vLLM reads these when its engine starts (see docs/vllm.md); the caller may override them.
    ncpu = os.cpu_count() or 1
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{min(ncpu, 2) - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ----------------------------------------------------------------------------------------------------
# Toy model


def build_toy(workdir: str):
    """(world, tokenizer, model A, model B, dir of A): A is the biased toy policy saved to disk,
    B = A after one "update" (Gaussian noise on every tensor)."""
    import torch


    from toy import model as toy_model
    import scaffold
    from toy import world

    w = world.make_world(world.WorldConfig(seed=0, n_train_entities=40, n_heldout_entities=10))
    texts = [d.title + " " + d.text for d in w.docs]
    tok = toy_model.train_tokenizer(texts, names=list(w.entities), vocab_size=400,
                                 syllables=world.SYLLABLES)
    a = toy_model.build_tiny_qwen3(tok, "XS", seed=0).eval()
    close = tok.convert_tokens_to_ids("</call_tool>")
    opening = tok.convert_tokens_to_ids(scaffold.CALL_OPEN)
    with torch.no_grad():
        emb = a.model.embed_tokens.weight  # (V, H), tied to lm_head
        emb[:, 0] = 1.0
        emb[close, 0] += 0.45
        emb[opening, 0] += 0.6
        emb[tok.eos_token_id, 0] += 0.15
    b = toy_model.build_tiny_qwen3(tok, "XS", seed=0).eval()
    b.load_state_dict(a.state_dict())
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    dir_a = os.path.join(workdir, "model_a")
    a.save_pretrained(dir_a)
    tok.save_pretrained(dir_a)
    return w, tok, a, b, dir_a


def hf_logprobs(model, seqs):
    """policy.token_logprobs for each sequence (batch of one, fp32): list of lists of floats."""
    import torch

    import policy

    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s], dtype=torch.long)
            out.append(policy.token_logprobs(model, ids, torch.ones_like(ids))[0].tolist())
    return out


def max_diff(x, y) -> float:
    return max(abs(a - b) for xs, ys in zip(x, y) for a, b in zip(xs, ys))


class Recorder:
    """A `scaffold.Sampler` proxy that records every (prompt, budget, output) it passes on."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def generate(self, prompts, max_new_tokens, temperature):
        outs = self.inner.generate(prompts, max_new_tokens, temperature)
        for p, m, o in zip(prompts, max_new_tokens, outs):
            self.calls.append((list(p), int(m), list(o)))
        return outs


# ----------------------------------------------------------------------------------------------------
# The checks


def check_rollouts(sampler, tok, w, hf_a) -> dict:
    """(a): real multi-turn rollouts through scaffold.RolloutEngine with the BM25 tool."""
    import scaffold
    from toy import world
    from backends.run.data import load_rows

    rec = Recorder(sampler)
    engine = scaffold.RolloutEngine(rec, tok, {"google_search": world.BM25SearchTool(w.docs)},
                                    max_response_tokens=160,
                                    system_prompt=scaffold.SYSTEM_PROMPT_COMPACT)
    queries = load_rows(w.train_rows)[:4]
    t0 = time.perf_counter()
    ros = engine.run(queries, n=2, temperature=1.0)
    t_roll = time.perf_counter() - t0
    close = tok.convert_tokens_to_ids("</call_tool>")
    stops = set(sampler.stop_token_ids)
    seqs = [r.prompt_ids + r.response_ids for r in ros]

    # Token-in/token-out: each (prompt, output) the engine saw is a prefix of one rollout's ids,
    # the output tokens carry loss mask 1, and all mask-1 tokens are accounted for.
    def placed(p, o):
        for r, s in zip(ros, seqs):
            if s[: len(p) + len(o)] == p + o:
                lo = len(p) - len(r.prompt_ids)
                return all(m == 1 for m in r.loss_mask[lo: lo + len(o)])
        return False

    tio = all(placed(p, o) for p, _, o in rec.calls)
    tio = tio and sum(len(o) for _, _, o in rec.calls) == sum(sum(r.loss_mask) for r in ros)
    # Stops: a turn ends with a stop token, or runs out of its budget; no stop inside a turn.
    stop_ok = all((o and o[-1] in stops) or len(o) == m for _, m, o in rec.calls)
    stop_ok = stop_ok and all(t not in stops for _, _, o in rec.calls for t in o[:-1])
    n_call_turns = sum(1 for _, _, o in rec.calls if o and o[-1] == close)
    # A continuation: a sampler call whose prompt ends with environment (mask 0) tokens.
    def after_tool(p):
        return any(len(p) > len(r.prompt_ids) and s[: len(p)] == p
                   and r.loss_mask[len(p) - len(r.prompt_ids) - 1] == 0 for r, s in zip(ros, seqs))

    continued = sum(1 for p, _, o in rec.calls if o and after_tool(p))
    lp_v = sampler.score(seqs)
    lp_h = hf_logprobs(hf_a, seqs)
    return {
        "rollouts": len(ros), "sampler_calls": len(rec.calls), "rollout_s": round(t_roll, 3),
        "response_tokens": sum(len(r.response_ids) for r in ros),
        "sampled_tokens": sum(len(o) for _, _, o in rec.calls),
        "turns_ending_in_call": n_call_turns, "tool_calls": sum(r.n_tool_calls for r in ros),
        "tool_calls_with_evidence": sum(1 for r in ros for c in r.tool_calls if c.results),
        "continuations_after_tool_output": continued,
        "finished": sum(r.finished for r in ros), "truncated": sum(r.truncated for r in ros),
        "token_in_out_ok": bool(tio), "stops_ok": bool(stop_ok),
        "guard_trims": sampler.stats["guard_trims"],
        "rollout_logprob_max_abs_diff": max_diff(lp_v, lp_h),
        "example_text": ros[0].text[:300],
    }, seqs


def check_sampling_semantics(sampler, prompt) -> dict:
    """Duplicated prompts (how `n` is passed) sample differently; a fixed seed repeats."""
    sampler.reseed(7)
    first = sampler.generate([prompt] * 4, [24] * 4, 1.0)
    sampler.reseed(7)
    again = sampler.generate([prompt] * 4, [24] * 4, 1.0)
    return {"duplicates_differ": len({tuple(x) for x in first}) > 1, "seed_repeats": first == again}


def check_throughput(sampler, hf, prompt) -> dict:
    """Raw engine throughput: 8 sequences x 64 new tokens, then 1 x 32, stops ignored (vLLM
    directly; a 64-token prompt); HF generate on the same 8 x 64 for comparison."""
    import torch
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=64, temperature=1.0, ignore_eos=True, seed=3, detokenize=False)
    t0 = time.perf_counter()
    res = sampler.llm.generate([{"prompt_token_ids": prompt}] * 8, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(r.outputs[0].token_ids) for r in res)
    sp = SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True, seed=3, detokenize=False)
    t0 = time.perf_counter()
    sampler.llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    dt1 = time.perf_counter() - t0
    ids = torch.tensor([prompt] * 8)
    t0 = time.perf_counter()
    with torch.no_grad():
        hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                    max_new_tokens=64, min_new_tokens=64, pad_token_id=0)
    dt_hf = time.perf_counter() - t0
    return {"gen_tok_per_s_b8": round(n / dt, 1), "gen_tok_per_s_b1": round(32 / dt1, 1),
            "hf_gen_tok_per_s_b8": round(8 * 64 / dt_hf, 1)}


def check_sync(sampler, a, b, seqs, prompts) -> dict:
    """(c): A -> B -> A, engine vs HF after each sync; failures and repairs."""
    from backends.scale.vllm_sampler import WeightSyncError

    lp_ha, lp_hb = hf_logprobs(a, seqs), hf_logprobs(b, seqs)
    lp_a0 = sampler.score(seqs)
    sampler.reseed(11)
    gen_a0 = sampler.generate(prompts, [32] * len(prompts), 1.0)
    res: dict = {"hf_a_vs_hf_b_max_abs_diff": max_diff(lp_ha, lp_hb),
                 "engine_vs_hf_a_before": max_diff(lp_a0, lp_ha)}

    # One update: B arrives one tensor at a time (state_dict order, tied lm_head.weight included:
    # the sampler drops it), 64 KiB chunks so a layer spans several rpcs.
    info_b = sampler.sync_weights(((k, v) for k, v in b.state_dict().items()), chunk_bytes=64 << 10)
    lp_b = sampler.score(seqs)
    sampler.reseed(11)
    gen_b = sampler.generate(prompts, [32] * len(prompts), 1.0)
    res.update({"sync_to_b": info_b, "engine_vs_hf_b_after_sync": max_diff(lp_b, lp_hb),
                "engine_vs_hf_a_after_sync": max_diff(lp_b, lp_ha),
                "generation_changed": gen_b != gen_a0})

    info_a = sampler.sync_weights(a.state_dict().items())  # back, one chunk
    lp_a1 = sampler.score(seqs)
    sampler.reseed(11)
    gen_a1 = sampler.generate(prompts, [32] * len(prompts), 1.0)
    res.update({"sync_to_a": info_a, "engine_vs_hf_a_after_sync_back": max_diff(lp_a1, lp_ha),
                "engine_a_bitwise_repeat": lp_a1 == lp_a0,
                "generation_repeats_after_sync_back": gen_a1 == gen_a0})

    times = []
    for i in range(6):  # timing, alternating B / A
        m = b if i % 2 == 0 else a
        times.append(sampler.sync_weights(m.state_dict().items())["t_s"])
    res["sync_s_median"] = statistics.median(times)
    res["sync_s_all"] = [round(t, 4) for t in times]
    res["engine_vs_hf_a_after_8_syncs"] = max_diff(sampler.score(seqs), lp_ha)

    # A sync that forgets a tensor: error, engine refuses to sample, in-place reload repairs it.
    gone = "model.layers.0.self_attn.k_proj.weight"
    partial = [(k, v) for k, v in b.state_dict().items() if k != gone]
    try:
        sampler.sync_weights(partial)
        res["missing_tensor_raises"] = False
    except WeightSyncError as e:
        res["missing_tensor_raises"] = "k_proj" in str(e)
    try:
        sampler.generate(prompts[:1], [4], 1.0)
        res["refuses_after_failed_sync"] = False
    except WeightSyncError:
        res["refuses_after_failed_sync"] = True
    rep = sampler.reload_from_checkpoint(a)
    res["repair_weights_path"] = rep
    res["engine_vs_hf_a_after_repair"] = max_diff(sampler.score(seqs), lp_ha)

    # A sync that overruns its deadline (a slow trainer-side iterator).
    def slow():
        for k, v in b.state_dict().items():
            time.sleep(0.05)
            yield k, v
    t0 = time.perf_counter()
    try:
        sampler.sync_weights(slow(), timeout_s=0.3)
        res["timeout_raises"] = False
    except WeightSyncError as e:
        res["timeout_raises"] = "timeout_s=0.3" in str(e)
        res["timeout_message"] = str(e)[:300]
    res["timeout_raised_after_s"] = round(time.perf_counter() - t0, 3)
    return res


def check_fallback(sampler, a, b, seqs) -> dict:
    """(d): reload_from_checkpoint via weights_path (in place) and via a rebuilt engine."""
    lp_ha, lp_hb = hf_logprobs(a, seqs), hf_logprobs(b, seqs)
    r1 = sampler.reload_from_checkpoint(b)
    d1 = max_diff(sampler.score(seqs), lp_hb)
    r2 = sampler.reload_from_checkpoint(a, rebuild=True)
    d2 = max_diff(sampler.score(seqs), lp_ha)
    r3 = sampler.sync_weights(b.state_dict().items())  # the rebuilt engine still syncs in place
    d3 = max_diff(sampler.score(seqs), lp_hb)
    return {"weights_path": r1, "weights_path_vs_hf_b": d1, "rebuild": r2, "rebuild_vs_hf_a": d2,
            "sync_after_rebuild_vs_hf_b": d3, "sync_after_rebuild_s": r3["t_s"]}


def verdict(summary: dict) -> dict:
    """The pass/fail flags of the summary (all must hold)."""
    r, c, d = summary["a_rollouts"], summary["c_sync"], summary["d_fallback"]
    return {
        "token_in_out": r["token_in_out_ok"], "stops": r["stops_ok"],
        "guard_unused": r["guard_trims"] == 0,
        "tool_call_with_evidence": r["tool_calls_with_evidence"] > 0,
        "continued_after_tool_output": r["continuations_after_tool_output"] > 0,
        "rollout_logprobs": r["rollout_logprob_max_abs_diff"] <= TOL,
        "prompt_logprobs": summary["b_logprobs"]["max_abs_diff"] <= TOL,
        "duplicates_differ": summary["a_sampling"]["duplicates_differ"],
        "seed_repeats": summary["a_sampling"]["seed_repeats"],
        "update_is_visible": c["hf_a_vs_hf_b_max_abs_diff"] > 100 * TOL,
        "sync_matches_new": c["engine_vs_hf_b_after_sync"] <= TOL,
        "sync_leaves_old": c["engine_vs_hf_a_after_sync"] > 100 * TOL,
        "sync_back_matches_old": c["engine_vs_hf_a_after_sync_back"] <= TOL,
        "sync_back_bitwise": c["engine_a_bitwise_repeat"] and c["generation_repeats_after_sync_back"],
        "generation_changed": c["generation_changed"],
        "tied_lm_head_repacked": c["sync_to_b"]["repacked_lm_head"],
        "many_syncs_stable": c["engine_vs_hf_a_after_8_syncs"] <= TOL,
        "missing_tensor_raises": c["missing_tensor_raises"] and c["refuses_after_failed_sync"],
        "repair": c["engine_vs_hf_a_after_repair"] <= TOL, "timeout_raises": c["timeout_raises"],
        "fallback_weights_path": d["weights_path_vs_hf_b"] <= TOL,
        "fallback_rebuild": d["rebuild_vs_hf_a"] <= TOL,
        "sync_after_rebuild": d["sync_after_rebuild_vs_hf_b"] <= TOL,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=None, help="where the toy model is saved (default: tmp)")
    args = ap.parse_args(argv)
    _env_defaults()
    t_start = time.perf_counter()
    import torch
    import transformers
    import vllm

    from backends.scale.vllm_sampler import VLLMSampler

    summary: dict = {"versions": {"vllm": vllm.__version__, "torch": torch.__version__,
                                  "transformers": transformers.__version__}}
    phases = summary["phase_s"] = {"import": time.perf_counter() - t_start}

    def phase(name, fn, *a):
        t0 = time.perf_counter()
        out = fn(*a)
        phases[name] = round(time.perf_counter() - t0, 2)
        return out

    workdir = args.workdir or tempfile.mkdtemp(prefix="rubricem-vllm-check-")
    if args.workdir is None:  # our own scratch folder goes when we exit
        import atexit
        import shutil

        atexit.register(shutil.rmtree, workdir, True)
    w, tok, a, b, dir_a = phase("toy_build", build_toy, workdir)
    sampler = VLLMSampler(dir_a, tok, dtype="float32", max_model_len=1024, seed=1234)
    summary.update({"model_params": sum(p.numel() for p in a.parameters()), "vocab": len(tok),
                    "engine_init_s": round(sampler.stats["init_s"], 2),
                    "stop_token_ids": sampler.stop_token_ids, "string_stops": sampler.string_stops})
    summary["a_rollouts"], seqs = phase("a_rollouts", check_rollouts, sampler, tok, w, a)
    g = torch.Generator().manual_seed(5)
    rand = [torch.randint(0, len(tok), (n,), generator=g).tolist() for n in (17, 300, 700)]
    lp = phase("b_logprobs", lambda: (sampler.score(rand + seqs), hf_logprobs(a, rand + seqs)))
    summary["b_logprobs"] = {"max_abs_diff": max_diff(*lp), "n_sequences": len(rand + seqs),
                             "max_len": max(map(len, rand + seqs))}
    summary["a_sampling"] = check_sampling_semantics(sampler, seqs[0][: len(seqs[0]) // 2])
    summary["throughput"] = phase("throughput", check_throughput, sampler, a, seqs[0][:64])
    prompts = [x[:40] for x in seqs[:4]]
    summary["c_sync"] = phase("c_sync", check_sync, sampler, a, b, seqs, prompts)
    summary["d_fallback"] = phase("d_fallback", check_fallback, sampler, a, b, seqs)
    summary["checks"] = verdict(summary)
    summary["ok"] = all(summary["checks"].values())
    summary["total_s"] = round(time.perf_counter() - t_start, 2)
    phases["import"] = round(phases["import"], 2)
    sampler.close()
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

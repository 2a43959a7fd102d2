"""One GRPO step of this project next to TRL's GRPOTrainer step: same model, tokenizer, prompts, batch
and sampling settings, timed alternately in one process.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
The step is §3.3's update with K = 1 stage (plain GRPO, the "flat" baseline of the ablations): sample
G completions per prompt at T = 1, score them, group-normalise, one SS-GRPO optimizer step
(PPO-clip + beta * k3 KL against the frozen start). The reference is the TRL baseline harness
(`trl_grpo_baseline.py`, found with --bench-dir, $RUBRICEM_BENCH_DIR, or the first `shared/bench`
above this repository): its builder functions make the model (tiny Qwen3, 5.2 M parameters, vocab
8,192), tokenizer, prompts and reward from a seed, and the printed hashes show that both sides got
the same artefacts (seed 0: vocab_sha=2cdc8ad6bb2c1cfc weights_sha=b55d6dc6744a79c5).

Project side, per step (4 prompts x 8 completions, up to 128 new tokens, T = 1, top_k 0, top_p 1):
    generate  the sampler (--sampler: "kv" = kv_sampler.KVSampler, "hf" = hf_sampler.HFSampler;
              several, comma-separated, are timed one after the other on the same prompts)
    update    reward, group advantages (ss_grpo.flat_advantages), torch_engine.TorchEngine.update with one
              optimizer step (minibatches 1, micro-batch 32, beta 0.001, lr 1e-6, eta 0.2, loss
              aggregated like TRL's loss_type "grpo": seq_mean_token_mean, grad clip 1.0);
              --two-pass adds the separate old-log-prob forward the update used to run
TRL side (only when `trl` is importable): the harness's own GRPOTrainer run; after each of its steps
the project sides run one step on that step's prompts (TRL's step timer has stopped by then).
Without trl the project sides run alone on the harness's prompts (trl fields print as nan).

Every step reports wall seconds, the generate / update split, completion tokens, process CPU seconds
and cpu_util = CPU seconds / wall seconds; steps with cpu_util < 0.8 x threads were contended
(another process had a core) and are left out of the wall-time medians. CPU seconds per step (median
over all timed steps) change much less under contention, so their ratio is printed too. The first
step of each side is warm-up.

--profile adds one more project step (left out of the medians) whose update runs under
torch.profiler, and prints how much of it is matrix products (matmul, attention, forward and
backward): TRL's update computes the same products at the same shapes (reference forward, policy
forward and backward), so at a given precision the median generate time plus that figure is about
the lowest step time this update could reach, and its ratio to TRL's step the lowest ratio.

--precision bf16 runs the project side's forwards under bfloat16 autocast (settings `precision`);
--trl-precision bf16 gives TRL's GRPOConfig bf16=True (the harness itself runs float32).

Run (2 CPU cores, about 1 minute per step pair):
    python benchmarks/step_vs_trl.py                          # project side only (no trl)
    /work/venv-trl/bin/python benchmarks/step_vs_trl.py --sampler kv,hf --steps 8
    /work/venv-trl/bin/python benchmarks/step_vs_trl.py --precision bf16 --trl-precision bf16
Last line:
    STEP_VS_TRL project_step_s=<median> trl_step_s=<median> ratio=<project/trl>
"""
from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import os
import random
import statistics
import sys
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import hparams  # noqa: E402
import policy  # noqa: E402
import ss_grpo  # noqa: E402
from backends.run import torch_engine  # noqa: E402
from toy import hf_sampler, kv_sampler  # noqa: E402

EXPECTED_SEED0 = ("2cdc8ad6bb2c1cfc", "b55d6dc6744a79c5")  # (vocab_sha, weights_sha), harness README


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench-dir", default=os.environ.get("RUBRICEM_BENCH_DIR", ""),
                   help="directory of trl_grpo_baseline.py (default $RUBRICEM_BENCH_DIR, else the "
                        "first shared/bench above the repository, e.g. ../shared/bench)")
    p.add_argument("--sampler", default="kv", help="project sampler(s), comma-separated: kv, hf")
    p.add_argument("--two-pass", action="store_true",
                   help="also run the separate old-log-prob forward (the update's former cost)")
    p.add_argument("--steps", type=int, default=6, help="steps per side, the first is warm-up")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-completion-length", type=int, default=128)
    p.add_argument("--no-trl", action="store_true", help="time the project side only")
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, one more project step whose update runs under "
                        "torch.profiler (left out of the medians): its time in matrix products")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                   help="the project side's forwards (settings `precision`: bf16 = bfloat16 "
                        "autocast)")
    p.add_argument("--trl-precision", default="fp32", choices=("fp32", "bf16"),
                   help="TRL's GRPOConfig: fp32 = the harness as written (bf16=False); bf16 = "
                        "GRPOConfig(bf16=True), transformers' bfloat16 autocast on CPU")
    return p.parse_args(argv)


def find_bench_dir(flag: str) -> str:
    """The harness directory: the flag / env value, else the nearest ancestor's shared/bench."""
    if flag:
        cands = [flag]
    else:
        cands, d = [], ROOT
        while True:
            cands.append(os.path.join(os.path.dirname(d), "shared", "bench"))  # ../shared/bench
            if os.path.dirname(d) == d:
                break
            d = os.path.dirname(d)
    for c in cands:
        if os.path.isfile(os.path.join(c, "trl_grpo_baseline.py")):
            return os.path.abspath(c)
    raise SystemExit(f"trl_grpo_baseline.py not found in {cands[:3]}...; pass --bench-dir")


def _stand_ins() -> list[str]:
    """Placeholder `trl` / `datasets` modules when they are not installed, so the harness's builder
    functions import; anything TRL-specific raises if used. Returns the names replaced."""
    out = []
    if importlib.util.find_spec("trl") is None:
        trl = types.ModuleType("trl")
        trl.__version__ = "absent"

        class Missing:
            def __init__(self, *a, **k):
                raise RuntimeError("trl is not installed")

        trl.GRPOConfig = trl.GRPOTrainer = Missing
        sys.modules["trl"] = trl
        out.append("trl")
    if importlib.util.find_spec("datasets") is None:
        ds = types.ModuleType("datasets")
        ds.__version__ = "absent"
        ds.Dataset = types.SimpleNamespace(from_list=lambda rows: list(rows))
        ds.disable_progress_bars = lambda: None
        ds.logging = types.SimpleNamespace(set_verbosity_error=lambda: None)
        sys.modules["datasets"] = ds
        out.append("datasets")
    return out


def load_harness(bench_dir: str, a):
    """Import trl_grpo_baseline.py with our run shape in sys.argv (it parses argv at import)."""
    path = os.path.join(bench_dir, "trl_grpo_baseline.py")
    saved = sys.argv
    sys.argv = [path, "--quiet", "--threads", str(a.threads), "--seed", str(a.seed), "--steps",
                str(a.steps), "--warmup", "1", "--max-completion-length", str(a.max_completion_length)]
    try:
        spec = importlib.util.spec_from_file_location("trl_grpo_baseline", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["trl_grpo_baseline"] = mod
        spec.loader.exec_module(mod)
    finally:
        sys.argv = saved
    return mod


class ProjectSide:
    """This project's GRPO step on the harness's model and tokenizer, with one sampler."""

    def __init__(self, name: str, model, ref_model, opt, tok, h, a):
        self.name, self.model, self.ref, self.opt, self.tok, self.h, self.a = \
            name, model, ref_model, opt, tok, h, a
        cls = {"kv": kv_sampler.KVSampler, "hf": hf_sampler.HFSampler}[name]
        self.sampler = cls(model, tok, stop_strings=(), precision=a.precision)  # eos only, as TRL
        self.cfg = hparams.SSGRPOConfig(minibatches=1, micro_batch=32, beta=h.ARGS.beta,
                                        lr=h.ARGS.learning_rate, eta=0.2,
                                        agg="seq_mean_token_mean", grad_clip=1.0)
        self.engine = torch_engine.TorchEngine(model, self.cfg, ref_model, opt, precision=a.precision)
        self.rng = random.Random(a.seed)
        self.rows: list[dict] = []

    def step(self, prompts: list, targets: list, profile: bool = False) -> dict:
        """One step on unique prompts (chat messages) with their target words; `profile`: the
        update runs under torch.profiler, the row gets "matmul_s" / "profiled_update_s" and is not
        appended to the timed rows."""
        G, h = self.h.ARGS.num_generations, self.h
        c0, t0 = time.process_time(), time.perf_counter()
        pids = [list(self.tok.apply_chat_template(p, tokenize=True, add_generation_prompt=True,
                                                  return_dict=False)) for p in prompts]
        flat = [p for p in pids for _ in range(G)]
        new = self.sampler.generate(flat, [self.a.max_completion_length] * len(flat),
                                    h.ARGS.temperature)
        t_gen, c_gen = time.perf_counter() - t0, time.process_time() - c0
        texts = self.tok.batch_decode(new, skip_special_tokens=True)
        r = h.target_word_reward([p for p in prompts for _ in range(G)], texts, new,
                                 [t for t in targets for _ in range(G)])
        # Eq.: A_i = (r_i - mean r) / (Std r + eps) per group of G (K = 1 stage)
        A = ss_grpo.flat_advantages(torch.tensor(r, dtype=torch.float64), 1, group_size=G)[:, 0]
        ub = policy.UpdateBatch()
        for p, c, adv in zip(flat, new, A.tolist()):
            ub.ids.append(p + c)
            ub.mask.append([0] * len(p) + [1] * len(c))
            ub.adv.append([0.0] * len(p) + [adv] * len(c))
            ub.kind.append("task")
        if self.a.two_pass:
            policy.batch_logprobs(self.model, ub, self.tok.pad_token_id, self.cfg.micro_batch)
        if profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                t_u = time.perf_counter()
                st = self.engine.update(ub, self.tok.pad_token_id, self.rng)
                t_u = time.perf_counter() - t_u
        else:
            st = self.engine.update(ub, self.tok.pad_token_id, self.rng)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        row = {"step_s": dt, "gen_s": t_gen, "update_s": dt - t_gen, "cpu_s": cpu,
               "gen_cpu_s": c_gen, "update_cpu_s": cpu - c_gen,
               "tokens": sum(len(c) for c in new), "cpu_util": cpu / dt,
               "load1": os.getloadavg()[0], "loss": st.get("loss/total", float("nan"))}
        if profile:
            row.update(matmul_time(prof), profiled_update_s=t_u)
            return row
        self.rows.append(row)
        print(f"[{self.name:>4} step {len(self.rows) - 1:>2}] step_s={dt:.3f} gen_s={t_gen:.3f} "
              f"update_s={row['update_s']:.3f} tokens={row['tokens']} cpu_s={cpu:.3f} "
              f"(gen {c_gen:.3f}) cpu_util={row['cpu_util']:.2f} load1={row['load1']:.2f}", flush=True)
        return row


# Matrix products and attention (whose time is its two matrix products), forward and backward: the
# FLOP-bound part of an update. Both sides of the comparison compute them at the same shapes.
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
              "aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def matmul_time(prof) -> dict:
    """{"matmul_s": self CPU seconds of the MATMUL_OPS, "ops_s": self CPU seconds of all ops} of a
    finished torch.profiler run (wall time of each op on the thread that launched it; intra-op
    worker threads are inside it). The profiler's own overhead lands mostly on the many small ops,
    so matmul_s / ops_s understates the matrix products' share."""
    ev = prof.key_averages()
    mm = sum(e.self_cpu_time_total for e in ev if e.key in MATMUL_OPS) / 1e6
    return {"matmul_s": mm, "ops_s": sum(e.self_cpu_time_total for e in ev) / 1e6}


def medians(rows: list[dict], threads: int,
            keys=("step_s", "gen_s", "update_s", "cpu_s", "gen_cpu_s", "update_cpu_s")) -> dict:
    """Medians over the timed steps (after warm-up) that were not contended."""
    timed = rows[1:] if len(rows) > 1 else rows
    quiet = [r for r in timed if r["cpu_util"] >= 0.8 * threads]
    use = quiet or timed
    out = {k: statistics.median(r.get(k, float("nan")) for r in (timed if "cpu" in k else use))
           for k in keys}
    # Process CPU seconds are far less sensitive to other processes than wall seconds: the figure
    # to compare when every step was contended.
    out["cpu_s_all"] = statistics.median(r.get("cpu_s", float("nan")) for r in timed)
    out.update(n_timed=len(timed), n_quiet=len(quiet), contended=not quiet,
               tokens=statistics.median(r["tokens"] for r in use))
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    stand_ins = _stand_ins()  # only for modules that are not installed
    bench = find_bench_dir(a.bench_dir)
    h = load_harness(bench, a)  # sets torch threads
    import transformers  # lazy: after the harness's trl / datasets stand-ins are in place

    transformers.logging.set_verbosity_error()
    have_trl = "trl" not in stand_ins and not a.no_trl
    threads = min(a.threads, os.cpu_count() or a.threads)
    tok, lexicon = h.build_tokenizer(a.seed, h.ARGS.vocab_size)
    model = h.build_model(tok, h.ARGS).eval()
    vsha, wsha = h.vocab_hash(tok), h.state_hash(model)
    ok = "" if a.seed != 0 else (" (as the harness README)" if (vsha, wsha) == EXPECTED_SEED0
                                 else " (DIFFERENT from the harness README)")
    print(f"harness: {bench}/trl_grpo_baseline.py; stand-ins for {stand_ins or 'nothing'}")
    print(f"project side: vocab_sha={vsha} weights_sha={wsha}{ok} params="
          f"{sum(p.numel() for p in model.parameters())} threads={torch.get_num_threads()} "
          f"nproc={os.cpu_count()} torch={torch.__version__} transformers={transformers.__version__} "
          f"trl={sys.modules['trl'].__version__}", flush=True)
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=h.ARGS.learning_rate, betas=(0.9, 0.95),
                            weight_decay=0.0)
    names = [s.strip() for s in a.sampler.split(",") if s.strip()]
    sides = [ProjectSide(n, model, ref, opt, tok, h, a) for n in names]

    def run_sides(prompts, targets):
        for s in sides:
            torch.manual_seed(a.seed * 7919 + len(s.rows))
            s.step(prompts, targets)

    trl_rows: list[dict] = []
    if have_trl:
        seen: dict = {}
        inner = h.target_word_reward

        @functools.wraps(inner)
        def recording_reward(prompts, completions, completion_ids, targets, **kw):
            seen["prompts"], seen["targets"] = prompts, targets
            return inner(prompts, completions, completion_ids, targets, **kw)

        base = h.StepTimer

        class AlternatingTimer(base):
            """The harness's step timer; after each TRL step, one step of every project side on
            the prompts TRL just used."""

            def on_step_end(self, args, state, control, **kw):
                super().on_step_end(args, state, control, **kw)
                trl_rows.append(self.rows[-1])
                uniq, tg = [], []
                for p, t in zip(seen["prompts"], seen["targets"]):
                    if p not in uniq:
                        uniq.append(p)
                        tg.append(t)
                run_sides(uniq, tg)

        h.target_word_reward, h.StepTimer = recording_reward, AlternatingTimer
        if a.trl_precision == "bf16":
            class BF16Config(h.GRPOConfig):
                """The harness's GRPOConfig with bf16=True (its printed trainer line shows it)."""

                def __post_init__(self):
                    self.bf16 = True
                    super().__post_init__()

            h.GRPOConfig = BF16Config
        h.main(h.ARGS)  # prints the harness's own lines, hashes included
        for r in trl_rows:
            r["update_s"] = r["rest_s"] + r["reward_s"]
            r["cpu_s"] = r["cpu_util"] * r["step_s"]
    else:
        data = h.build_dataset(a.seed, lexicon, h.ARGS.num_prompts)
        order = list(range(len(data)))
        random.Random(a.seed).shuffle(order)
        P = h.ARGS.prompts_per_step
        for i in range(a.steps):
            rows = [data[order[(i * P + j) % len(order)]] for j in range(P)]
            run_sides([r["prompt"] for r in rows], [r["targets"] for r in rows])

    print("summary (medians over timed, uncontended steps; warm-up excluded):")
    res = {}
    for s in sides:
        res[s.name] = m = medians(s.rows, threads)
        print(f"  project[{s.name}{'+two-pass' if a.two_pass else ''}, {a.precision}] "
              f"step_s={m['step_s']:.3f} gen_s={m['gen_s']:.3f} update_s={m['update_s']:.3f} "
              f"tokens={m['tokens']:.0f} "
              f"cpu_s={m['cpu_s_all']:.3f} (gen {m['gen_cpu_s']:.3f} update {m['update_cpu_s']:.3f}) "
              f"quiet_steps={m['n_quiet']}/{m['n_timed']}{' CONTENDED' if m['contended'] else ''}")
    trl = medians(trl_rows, threads) if trl_rows else None
    if trl:
        print(f"  trl[{a.trl_precision}] step_s={trl['step_s']:.3f} gen_s={trl['gen_s']:.3f} "
              f"update_s={trl['update_s']:.3f} tokens={trl['tokens']:.0f} "
              f"cpu_s={trl['cpu_s_all']:.3f} "
              f"quiet_steps={trl['n_quiet']}/{trl['n_timed']}"
              f"{' CONTENDED' if trl['contended'] else ''}")
        for n, m in res.items():
            print(f"  ratio project[{n}]/trl: step {m['step_s'] / trl['step_s']:.3f} "
                  f"gen {m['gen_s'] / trl['gen_s']:.3f} update {m['update_s'] / trl['update_s']:.3f}; "
                  f"cpu seconds per step {m['cpu_s_all'] / trl['cpu_s_all']:.3f}")
    if any(m["contended"] for m in res.values()) or (trl and trl["contended"]):
        print("WARNING: every timed step of some side was contended (cpu_util < 0.8 x threads); "
              "its figures are not a clean measurement", file=sys.stderr)
    if a.profile:
        # One more step on the first prompts: its update under the profiler (not timed above).
        data = h.build_dataset(a.seed, lexicon, h.ARGS.num_prompts)
        data = [data[i] for i in range(h.ARGS.prompts_per_step)]  # rows (a list or a datasets.Dataset)
        s0 = sides[0]
        torch.manual_seed(a.seed * 7919 + 10_000)
        r = s0.step([d["prompt"] for d in data], [d["targets"] for d in data], profile=True)
        m = res[names[0]]
        # matrix products alone: what an update of the same FLOPs needs at least; with the median
        # generate time, the lowest step time (and ratio) this update could reach at this precision
        floor = m["gen_s"] + r["matmul_s"]
        print(f"  profiled update[{s0.name}, {a.precision}]: {r['profiled_update_s']:.3f} s wall, "
              f"matrix products {r['matmul_s']:.3f} s of {r['ops_s']:.3f} s op time "
              f"({r['matmul_s'] / r['ops_s']:.0%}); median generate + matrix products = {floor:.3f} s"
              + (f" = {floor / trl['step_s']:.3f} x TRL's step" if trl else ""))
        print(f"UPDATE_PROFILE matmul_s={r['matmul_s']:.3f} ops_s={r['ops_s']:.3f} "
              f"profiled_update_s={r['profiled_update_s']:.3f} floor_step_s={floor:.3f}", flush=True)
    p = res[names[0]]["step_s"]
    t = trl["step_s"] if trl else float("nan")
    print(f"STEP_VS_TRL project_step_s={p:.3f} trl_step_s={t:.3f} ratio={p / t:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

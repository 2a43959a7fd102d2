"""The SS-GRPO update (§3.3) under inputs a long run meets sooner or later, on both engines: the one
update, policy.policy_update, over torch_engine.TorchEngine (one process) and over `OneProcessPolicy`, a
plain-PyTorch engine with ZeRO-3's step semantics (backends/distributed/zero3.py's ZeRO3Policy: the optimizer
itself discards a step whose gradient norm is not finite), so no DeepSpeed is needed; world size 1,
so policy.plan_update hands it the whole batch.

Faults: a minibatch with no loss-masked token (skipped and counted, not a crash); a ratio rho that
overflows the fp32 gradient norm (log rho of 45-80: the step is skipped and counted, not applied as
a zero or NaN update); dropout in the model's config (disabled for RL, so the first minibatch is
exactly on-policy). The last test repeats the dropout and overflow cases on a real DeepSpeed ZeRO-3
engine (tests/zero3_update_check.py, one CPU rank).
"""
import copy
import functools
import importlib.util
import math
import json
import os
import random
import subprocess
import sys

import pytest
import torch

import policy

from backends.run import robust, torch_engine

from toy import model as toy_model
from backends.run.torch_engine import TorchEngine
from backends.run.fast_logprobs import token_logprobs
from policy import UpdateBatch, plan_update, policy_update
from hparams import SSGRPOConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V, PAD, SEED = 64, 0, 3


def tiny_qwen3(seed: int = 0, **config):
    """A randomly initialised XS Qwen3 (toy_model.SIZES) over a 64-token vocabulary."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=V, max_position_embeddings=128, tie_word_embeddings=True,
                      pad_token_id=PAD, **toy_model.SIZES["XS"], **config)
    return Qwen3ForCausalLM(cfg).eval()


def make_batch(n: int, masked=(), seed: int = 0) -> UpdateBatch:
    """n sequences: 4 prompt tokens (mask 0), then 8-11 response tokens with advantage +-1. The
    sequences in `masked` have no loss-masked token at all (an empty or fully masked response)."""
    g = torch.Generator().manual_seed(seed)
    b = UpdateBatch()
    for i in range(n):
        L = 12 + i % 4
        m = [0] * L if i in masked else [0] * 4 + [1] * (L - 4)
        a = 1.0 if i % 2 else -1.0
        b.ids.append(torch.randint(1, V, (L,), generator=g).tolist())
        b.mask.append(m)
        b.adv.append([a * x for x in m])
        b.kind.append("task")
    return b


def minibatch(n: int, M: int, j: int, seed: int) -> list[int]:
    """The sequences of optimizer step j, as policy_update / plan_update deal them (order[j::M])."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order[j::M]


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


class OneProcessPolicy:
    """A policy engine (policy.PolicyEngine) with backends/distributed/zero3.py's ZeRO-3 step semantics over a
    plain model: torch AdamW, clip_grad_norm_ in step(), which (like DeepSpeed's ZeRO-3 optimizer)
    discards a step whose gradient norm is not finite and always clears the gradients. Its log-probs
    are ZeRO3Engine's on the toy's plain path (fast_logprobs false: the chunked head over every
    column, no loss mask), so its steps equal TorchEngine's to the last bit."""

    world_size = 1

    def __init__(self, model, cfg: SSGRPOConfig):
        self.model, self.clip = model, cfg.grad_clip
        self.ref = copy.deepcopy(model).eval()
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                     weight_decay=0.0)
        self.steps = 0  # optimizer steps applied

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def logprobs(self, ids, att, mask=None, temperature=1.0):
        return token_logprobs(self.model, ids, att, temperature=temperature)

    def ref_logprobs(self, ids, att, mask=None, temperature=1.0):
        return token_logprobs(self.ref, ids, att, temperature=temperature)

    def backward(self, loss, boundary: bool) -> None:
        loss.backward()

    def step(self) -> float:
        gn = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip))
        if gn == gn and abs(gn) != float("inf"):
            self.opt.step()
            self.steps += 1
        self.opt.zero_grad(set_to_none=True)
        return gn

    def all_reduce(self, values):
        return list(values)


def torch_update(model, batch, cfg, seed=SEED, opt=None):
    """TorchEngine.update with a fresh AdamW (as TorchEngine builds it) unless `opt`."""
    ref = copy.deepcopy(model).eval()
    return TorchEngine(model, cfg, ref_model=ref, opt=opt).update(batch, PAD, random.Random(seed))


def zero3_update(model, batch, cfg, seed=SEED, pol=None):
    """policy_update over OneProcessPolicy: (stats + "per_step", the engine)."""
    pol = pol or OneProcessPolicy(model, cfg)
    shards, plans = plan_update(batch, 1, cfg.minibatches, cfg.micro_batch, random.Random(seed))
    per_step: list = []
    out = policy_update(pol, shards[0], cfg, PAD, plans[0], per_step)
    return {**out, "per_step": per_step}, pol


# ----------------------------------------------------------------------------------------------------
# A minibatch with no loss-masked token


@pytest.mark.parametrize("engine", ["torch", "zero3"])
def test_s33_minibatch_without_tokens_is_skipped_and_counted(engine):
    cfg = SSGRPOConfig(minibatches=2, micro_batch=2, lr=1e-3)
    batch = make_batch(6, masked=minibatch(6, 2, 0, SEED))  # optimizer step 0 has nothing to learn
    model = tiny_qwen3()
    w0 = weights(model)
    if engine == "torch":
        out = torch_update(model, batch, cfg)
    else:
        out, pol = zero3_update(model, batch, cfg)
        assert pol.steps == 1 and len(out["per_step"]) == 1  # no optimizer step on the empty one
    assert out["update/empty_minibatches"] == 1
    for k in ("loss/total", "loss/policy", "kl", "clip_frac", "grad_norm"):
        assert out[k] == out[k] and abs(out[k]) < 1e6, (k, out)
    assert out["grad_norm"] > 0
    assert not same(weights(model), w0)  # the other minibatch trained


def test_s33_empty_minibatch_both_engines_take_the_same_step():
    cfg = SSGRPOConfig(minibatches=2, micro_batch=2, lr=1e-3)
    batch = make_batch(6, masked=minibatch(6, 2, 1, SEED))
    a, b = tiny_qwen3(), tiny_qwen3()
    sa = torch_update(a, batch, cfg)
    sb, _ = zero3_update(b, batch, cfg)
    for k in ("loss/total", "loss/policy", "kl", "clip_frac", "grad_norm", "update/empty_minibatches"):
        assert sa[k] == pytest.approx(sb[k], rel=1e-4, abs=1e-7), k
    wa, wb = weights(a), weights(b)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-6


@pytest.mark.parametrize("engine", ["torch", "zero3"])
def test_s33_batch_without_any_token_leaves_the_policy_alone(engine):
    cfg = SSGRPOConfig(minibatches=2, micro_batch=2, lr=1e-3)
    batch = make_batch(4, masked=range(4))
    model = tiny_qwen3()
    w0 = weights(model)
    out = torch_update(model, batch, cfg) if engine == "torch" else zero3_update(model, batch, cfg)[0]
    assert out["update/empty_minibatches"] == 2
    assert "grad_norm" not in out and "loss/total" not in out  # nothing was computed
    assert same(weights(model), w0)



# ----------------------------------------------------------------------------------------------------
# A gradient norm that overflows fp32


def stale_old_logprobs(monkeypatch, model, shift: float, only=None, which="logprobs") -> None:
    """Make the old log-probs of `model` `shift` nats below its current ones (a sampler far behind
    the policy): rho = exp(shift) on every response token of the sequences that have an old pass
    (only: the batch indices affected, default all); the reference stays untouched. With
    which="ref_logprobs" the reference log-probs are `shift` nats *above* instead:
    k3 = exp(d) - d - 1 with d = shift, on every step."""
    scored = policy.sequence_logprobs
    sign = -1.0 if which == "logprobs" else 1.0

    def sequence_logprobs(fn, batch, *a, on_pass=None, **kw):
        index = a[3] if len(a) > 3 and a[3] is not None else list(range(len(batch.ids)))
        f = fn.func if isinstance(fn, functools.partial) else fn  # the update binds temperature
        hit = f.__func__.__name__ == which and f.__self__.model is model

        def moved(p, x):
            return x + sign * shift if hit and (only is None or index[p] in only) else x

        # the reference passes may run in a thread (TorchEngine.score_ref), handing each pass's
        # values on as they come: those are shifted too
        out = scored(fn, batch, *a, **kw, on_pass=None if on_pass is None else
                     lambda got: on_pass({p: moved(p, x) for p, x in got.items()}))
        return [moved(p, x) for p, x in enumerate(out)]

    monkeypatch.setattr(policy, "sequence_logprobs", sequence_logprobs)


@pytest.mark.parametrize("shift", [60.0, 75.0])
@pytest.mark.parametrize("engine", ["torch", "zero3"])
def test_s33_overflowing_kl_term_skips_the_step_and_counts_it(monkeypatch, engine, shift):
    cfg = SSGRPOConfig(minibatches=2, micro_batch=2, lr=1e-3)
    model = tiny_qwen3()
    # One healthy update first, so AdamW carries momentum that a zero-gradient step would still apply.
    if engine == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        torch_update(model, make_batch(6, seed=1), cfg, opt=opt)
    else:
        pol = zero3_update(model, make_batch(6, seed=1), cfg)[1]
    w0 = weights(model)
    # pi_ref far above pi_theta: k3 = exp(shift) - shift - 1 overflows on every optimizer step
    stale_old_logprobs(monkeypatch, model, shift, which="ref_logprobs")
    if engine == "torch":
        out = torch_update(model, make_batch(6), cfg, opt=opt)
    else:
        out, pol = zero3_update(model, make_batch(6), cfg, pol=pol)
        assert all(s["grad_norm"] == float("inf") for s in out["per_step"])
        assert pol.steps == 2  # only the healthy update's
    assert out["update/nonfinite_grad_steps"] == 2
    assert "grad_norm" not in out  # no finite norm to report: never logged as a bogus number
    assert all(torch.isfinite(v).all() for v in weights(model).values())
    assert same(weights(model), w0)  # no step at all, not even on momentum
    assert out["loss/total"] > 1e15  # the cause stays visible in the log


@pytest.mark.parametrize("engine", ["torch", "zero3"])
def test_s33_first_step_has_no_old_pass_so_stale_old_logprobs_skip_only_later_steps(monkeypatch,
                                                                                    engine):
    """Optimizer step 0 runs before theta moves: its old log-probs are its own forward's (rho = 1
    exactly), so only the later steps' sequences go through the old pass, and only those steps can
    overflow."""
    cfg = SSGRPOConfig(minibatches=2, micro_batch=2, lr=1e-3)
    model = tiny_qwen3()
    w0 = weights(model)
    stale_old_logprobs(monkeypatch, model, 80.0)
    if engine == "torch":
        out = torch_update(model, make_batch(6), cfg)
    else:
        out, pol = zero3_update(model, make_batch(6), cfg)
        assert [math.isfinite(s["grad_norm"]) for s in out["per_step"]] == [True, False]
        assert pol.steps == 1
    assert out["update/nonfinite_grad_steps"] == 1
    assert 0 < out["grad_norm"] < 1e6  # step 0's norm
    assert not same(weights(model), w0)
    assert all(torch.isfinite(v).all() for v in weights(model).values())


def test_s33_overflow_in_one_minibatch_keeps_the_other_step(monkeypatch):
    cfg = SSGRPOConfig(minibatches=2, micro_batch=2, lr=1e-3)
    model = tiny_qwen3()
    w0 = weights(model)
    # rho overflows in optimizer step 1 only: its sequences' old log-probs are 60 nats too low
    stale_old_logprobs(monkeypatch, model, 60.0, only=set(minibatch(6, 2, 1, SEED)))
    out = torch_update(model, make_batch(6), cfg)
    assert out["update/nonfinite_grad_steps"] == 1
    assert 0 < out["grad_norm"] < 1e6  # the finite step's norm alone
    assert not same(weights(model), w0)
    assert all(torch.isfinite(v).all() for v in weights(model).values())


# ----------------------------------------------------------------------------------------------------
# Dropout: old log-probs (eval mode) and new ones (train mode) must come from the same function


def record_log_ratios(monkeypatch) -> list:
    """Wrap ss_grpo.ss_grpo_loss (both engines call it through the module): per call, the largest
    |log rho| over loss-masked tokens and the clip fraction."""
    import ss_grpo

    loss_fn, seen = ss_grpo.ss_grpo_loss, []

    def wrapped(logp, old_logp, ref_logp, adv, mask, **kw):
        m = mask.bool()
        seen.append(((logp.detach() - old_logp)[m].abs().max().item(), None))
        loss, st = loss_fn(logp, old_logp, ref_logp, adv, mask, **kw)
        seen[-1] = (seen[-1][0], float(st["clip_frac"]))
        return loss, st

    monkeypatch.setattr(ss_grpo, "ss_grpo_loss", wrapped)
    return seen


def test_s33_first_minibatch_is_on_policy_with_attention_dropout(monkeypatch):
    cfg = SSGRPOConfig(minibatches=2, micro_batch=8, lr=1e-3, eta=0.02)
    model = tiny_qwen3(attention_dropout=0.1)
    engine = TorchEngine(model, cfg)
    seen = record_log_ratios(monkeypatch)
    out = engine.update(make_batch(6), PAD, random.Random(SEED))
    log_rho, clip = seen[0]  # the first minibatch: nothing has moved yet, rho = 1 exactly
    assert log_rho < 1e-6 and clip == 0.0, seen
    assert seen[1][0] > 0 and out["grad_norm"] > 0  # the second one is off-policy, as it should be
    assert model.config.attention_dropout == 0.0 and engine.ref_model.config.attention_dropout == 0.0


def test_disable_dropout_covers_modules_attributes_and_config():
    model = tiny_qwen3(attention_dropout=0.1)
    model.model.extra = torch.nn.Dropout(0.3)
    n = torch_engine.disable_dropout(model)
    assert n == 1 + 2 + 1  # the Dropout module, 2 attention layers, the config field
    assert model.model.extra.p == 0.0
    assert all(layer.self_attn.attention_dropout == 0.0 for layer in model.model.layers)
    assert torch_engine.disable_dropout(model) == 0  # idempotent


# ----------------------------------------------------------------------------------------------------
# The same on a real DeepSpeed ZeRO-3 engine (one CPU rank, ~5 s)


@pytest.mark.skipif(not (importlib.util.find_spec("deepspeed") and importlib.util.find_spec("accelerate")),
                    reason="deepspeed and accelerate are not installed")
def test_s33_zero3_engine_on_policy_with_dropout_and_skips_overflowing_steps(tmp_path):
    tiny_qwen3(attention_dropout=0.1).save_pretrained(tmp_path / "model")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "zero3_update_check.py"),
                        str(tmp_path / "model"), str(tmp_path / "out.json")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.load(open(tmp_path / "out.json"))
    assert res["attention_dropout"] == [0.0, 0.0]
    log_rho, clip = res["seen"][0]  # first minibatch of the first update: on-policy
    assert log_rho < 1e-6 and clip == 0.0, res["seen"]
    over = res["overflow"]
    # the first optimizer step has no old pass (rho = 1 exactly): only the second one overflows
    assert over["update/nonfinite_grad_steps"] == 1 and 0 < over["grad_norm"] < 1e6
    assert res["skipped_steps"] == 1  # DeepSpeed discarded that step
    assert res["finite"] and not res["unchanged"]  # the first step was applied


# Repeated non-finite updates stop the run (train.py exit code 6) instead of spending compute on a
# policy that learns nothing.

def test_monitor_counts_updates_that_skipped_every_optimizer_step():
    mon = robust.FailureMonitor(max_rate=0.5, max_steps=3, max_nonfinite=5)
    skipped = {"update/nonfinite_grad_steps": 2}  # no grad_norm: no finite optimizer step
    mon.update_nonfinite(skipped, 0)
    mon.update_nonfinite({"reflect/update/nonfinite_grad_steps": 1, **skipped}, 1)  # two updates
    assert mon.nonfinite == 3  # the reflection update and the task update of step 1 both count
    mon2 = robust.FailureMonitor(0.5, 3, max_nonfinite=3)
    for s, m in enumerate([skipped, skipped, {"grad_norm": 1.0, "update/nonfinite_grad_steps": 1},
                           skipped, {}, skipped]):
        mon2.update_nonfinite(m, s)  # a partly applied update ends the run; an empty step keeps it
    assert mon2.nonfinite == 2
    with pytest.raises(robust.UpdateFailureAbort) as e:
        mon2.update_nonfinite(skipped, 6)
    assert "max_nonfinite_updates = 3" in str(e.value) and e.value.exit_code == 6
    off = robust.FailureMonitor(0.5, 3, max_nonfinite=0)
    for s in range(10):
        off.update_nonfinite(skipped, s)  # 0 = never stop


def test_run_stops_with_exit_code_6_and_a_checkpoint_after_repeated_nonfinite_updates(
        tmp_path, toy_cache, monkeypatch, capsys):
    import train
    from backends.run import torch_engine
    from runfix import fast_args, metric_rows

    def overflowing_step(self):  # every gradient norm is infinite: the engine drops the gradients
        self.opt.zero_grad(set_to_none=True)
        self._fresh = True
        return float("inf")

    monkeypatch.setattr(torch_engine.TorchEngine, "step", overflowing_step)
    d = tmp_path / "run"
    code = train.main(fast_args(d, toy_cache, 6, "--set", "max_nonfinite_updates=2",
                                "--set", "checkpoint.every=0"))
    assert code == 6
    assert "max_nonfinite_updates = 2" in capsys.readouterr().err
    rows = metric_rows(d)
    assert rows and all(r.get("grad_norm") is None for r in rows)
    last = rows[-1]["step"] + 1
    assert last < 6 and os.path.isdir(d / "checkpoints" / f"step-{last:06d}")  # it can be continued

"""policy.policy_update with one optimizer step per batch (§3.3): pi_theta_old is the current policy,
so the old log-probs come from the loss's own forward (detached, rho = 1) instead of a second
forward pass. The gradient must be the two-pass form's (old log-probs from a separate no-grad
forward, as with several minibatches) to 1e-6, and the policy must be run once, not twice.
"""
import random

import pytest
import torch

import policy

from toy import model as toy_model
import ss_grpo
from backends.run.torch_engine import TorchEngine
from policy import UpdateBatch
from hparams import SSGRPOConfig

V, PAD = 64, 0


def tiny_qwen3(seed: int = 0):
    """A randomly initialised XS Qwen3 (toy_model.SIZES) over a 64-token vocabulary."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=V, max_position_embeddings=128, tie_word_embeddings=True,
                      pad_token_id=PAD, **toy_model.SIZES["XS"])
    return Qwen3ForCausalLM(cfg).eval()


def make_batch(n: int, seed: int = 0) -> UpdateBatch:
    """n sequences of 3-5 prompt tokens (mask 0) and 5-12 response tokens, one with a masked
    (tool-output) stretch, advantages varying per token."""
    g = torch.Generator().manual_seed(seed)
    b = UpdateBatch()
    for i in range(n):
        P, T = 3 + i % 3, 5 + (7 * i) % 8
        m = [0] * P + [1] * T
        if i % 3 == 1:
            m[P + 2: P + 4] = [0, 0]  # environment tokens inside the response
        a = (torch.rand(P + T, generator=g) * 2 - 1).tolist()
        b.ids.append(torch.randint(1, V, (P + T,), generator=g).tolist())
        b.mask.append(m)
        b.adv.append([x * y for x, y in zip(a, m)])
        b.kind.append("task")
    return b


class RecordingOpt:
    """Optimizer stand-in: keeps the gradients handed to step() and leaves the weights alone."""

    def __init__(self, params):
        self.params, self.grads = list(params), None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        self.grads = [p.grad.detach().clone() for p in self.params]


def two_pass_grads(model, ref_model, batch: UpdateBatch, cfg: SSGRPOConfig):
    """Gradient and loss of the SS-GRPO loss with pi_theta_old from a separate no-grad forward."""
    old = policy.batch_logprobs(model, batch, PAD, cfg.micro_batch)
    ref = policy.batch_logprobs(ref_model, batch, PAD, cfg.micro_batch)
    idx = list(range(len(batch.ids)))
    ids, att, mask, adv = policy.pad_rows(batch, idx, PAD)
    old_lp, ref_lp = torch.zeros(ids.shape), torch.zeros(ids.shape)
    for i in idx:
        old_lp[i, : len(old[i])], ref_lp[i, : len(ref[i])] = old[i], ref[i]
    model.zero_grad(set_to_none=True)
    model.train()
    logp = policy.token_logprobs(model, ids, att)
    loss, st = ss_grpo.ss_grpo_loss(logp, old_lp, ref_lp, adv, mask, eta=cfg.eta, beta=cfg.beta,
                                    agg=cfg.agg, num_sequences=len(idx),
                                    num_tokens=float(mask.sum()))
    loss.backward()
    model.eval()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads, float(st["loss/total"])


@pytest.mark.parametrize("agg", ss_grpo.AGG_MODES)
@pytest.mark.parametrize("micro", [3, 16])
def test_s33_one_step_update_has_the_two_pass_gradient(agg, micro):
    model = tiny_qwen3()
    ref_model = tiny_qwen3(seed=1)  # a different reference, so the KL term has a gradient
    batch = make_batch(7)
    cfg = SSGRPOConfig(minibatches=1, micro_batch=micro, agg=agg, beta=0.04, grad_clip=1e9)
    want, want_loss = two_pass_grads(model, ref_model, batch, cfg)
    opt = RecordingOpt(model.parameters())
    out = TorchEngine(model, cfg, ref_model, opt).update(batch, PAD, random.Random(0))
    assert opt.grads is not None and out["clip_frac"] == 0.0
    assert abs(out["loss/total"] - want_loss) < 1e-6
    worst = max(float((g - w).abs().max()) for g, w in zip(opt.grads, want))
    assert worst < 1e-6, worst
    assert max(float(w.abs().max()) for w in want) > 1e-3  # a real gradient, not two zeros


def count_forwards(model) -> list:
    """Count the decoder forward passes of `model` (token_logprobs runs the decoder directly)."""
    calls = []
    model.get_decoder().register_forward_hook(lambda *a: calls.append(1))
    return calls


def test_s33_one_step_update_runs_the_policy_once():
    model, ref_model = tiny_qwen3(), tiny_qwen3(seed=1)
    calls = count_forwards(model)
    cfg = SSGRPOConfig(minibatches=1, micro_batch=16, beta=0.001)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    TorchEngine(model, cfg, ref_model, opt).update(make_batch(6), PAD, random.Random(0))
    assert len(calls) == 1  # the loss's forward; no separate old-log-prob pass
    # several optimizer steps still score pi_theta_old once before the first step
    calls.clear()
    cfg2 = SSGRPOConfig(minibatches=2, micro_batch=16, beta=0.001)
    TorchEngine(model, cfg2, ref_model, opt).update(make_batch(6), PAD, random.Random(0))
    assert len(calls) == 1 + 2


@pytest.mark.parametrize("minibatches", [1, 2])
def test_update_scores_the_batch_at_its_sampling_temperature(minibatches):
    """Every log-prob pass of an update (pi_ref, the old pass, the loss forward) runs at the
    batch's temperature, shards included; at T != 1 the gradient differs from T = 1's."""
    calls = []

    class Recording(TorchEngine):
        def logprobs(self, ids, att, mask=None, temperature=1.0):
            calls.append(("theta", temperature))
            return super().logprobs(ids, att, mask, temperature)

        def ref_logprobs(self, ids, att, mask=None, temperature=1.0):
            calls.append(("ref", temperature))
            return super().ref_logprobs(ids, att, mask, temperature)

    grads = {}
    for T in (1.0, 0.7):
        model = tiny_qwen3()
        cfg = SSGRPOConfig(minibatches=minibatches, micro_batch=3, beta=0.01, lr=1e-3)
        eng = Recording(model, cfg, opt=RecordingOpt(model.parameters()))
        b = make_batch(8)
        b.temperature = T
        shards, _ = policy.plan_update(b, 2, minibatches, 3, random.Random(0))
        assert all(s.temperature == T for s in shards)
        calls.clear()
        eng.update(b, PAD, random.Random(0))
        kinds = {k for k, _ in calls}
        assert kinds == {"theta", "ref"} and {t for _, t in calls} == {T}, calls
        grads[T] = eng.opt.grads
    assert any(not torch.allclose(a, b) for a, b in zip(grads[1.0], grads[0.7]))


def test_greedy_batch_is_scored_under_the_models_own_distribution():
    """A batch sampled greedily (temperature 0) drew from no tempered distribution: the update
    scores it at T = 1, with the gradients of a T = 1 batch; select() keeps the temperature."""
    grads = []
    for T in (1.0, 0.0):
        model = tiny_qwen3()
        cfg = SSGRPOConfig(minibatches=2, micro_batch=3, beta=0.01, lr=1e-3)
        eng = TorchEngine(model, cfg, opt=RecordingOpt(model.parameters()))
        b = make_batch(6)
        b.temperature = T
        assert b.select([2, 0]).temperature == T and b.select([2, 0]).ids == [b.ids[2], b.ids[0]]
        eng.update(b, PAD, random.Random(0))
        grads.append(eng.opt.grads)
    assert all(torch.equal(a, c) for a, c in zip(*grads))


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("minibatches", [1, 2])
def test_s33_reference_passes_in_a_thread_give_the_same_update(fast, minibatches):
    """TorchEngine.overlap_ref: pi_ref's no-grad passes run in a thread beside the loss passes
    (longest first). The passes are the same, so the statistics and the weights after the
    optimizer steps are the sequential update's, bit for bit (both computed here)."""
    got = []
    for overlap in (False, True):
        model, ref_model = tiny_qwen3(), tiny_qwen3(seed=1)
        cfg = SSGRPOConfig(minibatches=minibatches, micro_batch=3, beta=0.04, lr=1e-2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        eng = TorchEngine(model, cfg, ref_model, opt, fast=fast)
        eng.overlap_ref = overlap
        out = eng.update(make_batch(11), PAD, random.Random(0))
        got.append((out, [p.detach().clone() for p in model.parameters()]))
    (a, wa), (b, wb) = got
    assert a == b and a["kl"] != 0.0
    assert all(torch.equal(x, y) for x, y in zip(wa, wb))


def test_s33_a_failing_reference_pass_in_its_thread_raises_in_the_update():
    model, ref_model = tiny_qwen3(), tiny_qwen3(seed=1)
    cfg = SSGRPOConfig(minibatches=1, micro_batch=3, beta=0.04)

    class Broken(TorchEngine):
        def ref_logprobs(self, *a, **kw):
            raise ValueError("reference pass failed")

    eng = Broken(model, cfg, ref_model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert eng.overlap_ref
    with pytest.raises(RuntimeError, match="pi_ref") as e:
        eng.update(make_batch(5), PAD, random.Random(0))
    assert isinstance(e.value.__cause__, ValueError)


def test_reference_passes_stay_in_line_for_a_gpu_reference(monkeypatch):
    """A pi_ref on a GPU is scored in line (a new thread would start on device 0)."""
    from backends.run import torch_engine

    model, ref_model = tiny_qwen3(), tiny_qwen3(seed=1)
    eng = TorchEngine(model, SSGRPOConfig(beta=0.04), ref_model)
    calls = []
    score = lambda **kw: calls.append(kw) or ["values"]  # noqa: E731
    bg = eng.score_ref(score, 1)  # on the CPU: in a thread
    bg.join()
    assert isinstance(bg, torch_engine.BackgroundLogprobs) and calls[-1]["longest_first"]
    monkeypatch.setattr(torch_engine, "_device_type", lambda m: "cuda")
    assert eng.score_ref(score, 1) == ["values"] and calls[-1] == {}

"""kv_sampler.KVSampler against the reference sampler hf_sampler.HFSampler (HF generate), §3.1-3.2:
greedy rollouts are the same ids (stop ids, a multi-token stop string, budgets, batching, the tool
loop of the rollout engine); at T = 1 every next-token log-prob is a full forward's to 1e-5, the
inverse-CDF draw has the distribution's frequencies, and with draw="multinomial" the draws are
generate's draws from the same seed while no row has stopped.
"""
import pytest
import torch

import policy

from toy import model as toy_model
import toyfix as tf
from toy.kv_sampler import KVSampler, draw_inverse_cdf
from toy.hf_sampler import HFSampler


@pytest.fixture(scope="module", autouse=True)
def _threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    return tf.tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return toy_model.build_tiny_qwen3(tok, "XS", seed=0).eval()


def prompt(tok):
    return tf.encode(tok, "<|im_start|>user\nResearch Harta and report its year.<|im_end|>\n"
                          "<|im_start|>assistant\n")


class Force:
    """lm_head hook: at the j-th forward pass of a generate call (j = 1 is the prompt's), make
    token script[j - 1] certain for every row (None: leave that pass alone), and leave the logits
    alone past the script; tokens in `block` are never drawn."""

    def __init__(self, model, script, block=()):
        self.script, self.block, self.n = list(script), list(block), 0
        self.h = model.lm_head.register_forward_hook(self)

    def __call__(self, mod, inp, out):
        self.n += 1
        if self.n <= len(self.script) or self.block:
            out = out.clone()
            if self.n <= len(self.script) and self.script[self.n - 1] is not None:
                out[..., self.script[self.n - 1]] += 1e4
            out[..., self.block] -= 1e4  # tokens that may never be drawn
            return out

    def remove(self):
        self.h.remove()


def both(model, tok, prompts, budgets, temperature, seed=0, force=None, draw=(), **kw):
    """(HFSampler ids, KVSampler ids) for the same call and seed; draw: KVSampler's draw."""
    got = []
    for cls in (HFSampler, KVSampler):
        hook = Force(model, *force) if force else None
        try:
            torch.manual_seed(seed)
            extra = {"draw": draw[0]} if draw and cls is KVSampler else {}
            got.append(cls(model, tok, **kw, **extra).generate(prompts, budgets, temperature))
        finally:
            if hook:
                hook.remove()
    return got


def test_greedy_equals_hf_generate_for_mixed_lengths_budgets_and_batches_sec3_1(tok, model):
    p = prompt(tok)
    prompts = [p, p[:9], p[3:], p[:4], p[2:11], p[5:]]
    budgets = [40, 60, 0, 64, 1, 33]
    for bs in (64, 4):
        hf, kv = both(model, tok, prompts, budgets, 0.0, batch_size=bs)
        assert kv == hf
        assert [len(x) for x in kv][2:5] == [0, 64, 1]


def test_greedy_stops_at_the_first_stop_id_like_hf_sec3_2(tok, model):
    p = prompt(tok)
    stop, other = tok.convert_tokens_to_ids("</call_tool>"), tf.encode(tok, " year")[0]
    # the 3rd token is a stop: every row ends there; later forced tokens are never reached
    hf, kv = both(model, tok, [p, p[:6]], [30, 30], 0.0, force=([other, other, stop, other],))
    assert kv == hf == [[other, other, stop]] * 2


def test_multi_token_stop_string_cut_like_hf_sec3_2(model):
    ptok = tf.plain_tokenizer()
    m = toy_model.build_tiny_qwen3(ptok, "XS", seed=1).eval()
    text = tf.encode(ptok, " Harta year</call_tool> and more text after the call")
    assert len(tf.encode(ptok, "</call_tool>")) > 1  # spelt out: a stop string, not a stop id
    p = tf.encode(ptok, "user: find Harta\nassistant:")
    hf, kv = both(m, ptok, [p, p[2:]], [40, 40], 0.0, force=(text,))
    assert kv == hf
    for ids in kv:
        assert ptok.decode(ids).endswith("</call_tool>")
    # unforced: no stop string appears, both run to the budget with the same ids
    hf, kv = both(m, ptok, [p, p[2:]], [25, 12], 0.0)
    assert kv == hf and [len(x) for x in kv] == [25, 12]


def test_t1_draws_equal_hf_while_no_row_stops_sec3_1(tok, model):
    """With stop ids blocked and one budget, HF keeps every row to the end, and so does the KV loop:
    same logits, same multinomial calls on the same seed, same tokens."""
    p = prompt(tok)
    block = HFSampler(model, tok).stop_token_ids
    hf, kv = both(model, tok, [p, p[:9], p[4:]], [48] * 3, 1.0, seed=5, force=([], block),
                  draw=("multinomial",))
    assert kv == hf and all(len(x) == 48 for x in kv)


def test_t1_next_token_logprobs_equal_a_full_forward_sec3_1(tok, model):
    p = prompt(tok)
    prompts = [p, p[:7], p[3:]]
    torch.manual_seed(2)
    ids, lps = KVSampler(model, tok).decode(prompts, [40, 25, 40], 1.0, return_logprobs=True)
    assert [len(x) for x in ids] == [len(x) for x in lps] and any(len(x) > 5 for x in ids)
    for pr, new, lp in zip(prompts, ids, lps):
        seq = torch.tensor([pr + new])
        full = policy.token_logprobs(model, seq, torch.ones_like(seq))[0, len(pr):]
        assert torch.allclose(torch.tensor(lp), full, atol=1e-5, rtol=0), (lp, full)


def test_repeated_prompts_prefill_once_and_sample_from_their_own_distribution_sec3_1(tok, model):
    """A prompt repeated in the batch (a reflection group's m candidates) is prefilled once; each
    copy still samples its own continuation, every log-prob a full forward's, and greedy copies
    equal the prompt decoded alone."""
    p = prompt(tok)
    prompts = [p, p[3:], p, p, p[3:]]
    rows = []
    hook = model.model.register_forward_hook(lambda m, a, kw, out: rows.append(kw["input_ids"].shape),
                                             with_kwargs=True)
    try:
        torch.manual_seed(4)
        ids, lps = KVSampler(model, tok).decode(prompts, [30] * 5, 1.0, return_logprobs=True)
    finally:
        hook.remove()
    assert rows[0] == (2, len(p))  # the prefill: two distinct prompts
    assert len({tuple(x) for x in ids[:1] + ids[2:4]}) > 1  # the copies draw independently
    for pr, new, lp in zip(prompts, ids, lps):
        seq = torch.tensor([pr + new])
        full = policy.token_logprobs(model, seq, torch.ones_like(seq))[0, len(pr):]
        assert torch.allclose(torch.tensor(lp), full, atol=1e-5, rtol=0)
    greedy = KVSampler(model, tok).decode(prompts, [20] * 5, 0.0)[0]
    assert greedy[0] == greedy[2] == greedy[3] == KVSampler(model, tok).decode([p], [20], 0.0)[0][0]
    assert greedy[1] == greedy[4] == KVSampler(model, tok).decode([p[3:]], [20], 0.0)[0][0]


def test_next_turn_reuses_the_kept_keys_and_values_sec3_2(tok, model):
    """A rollout's next turn (its context so far + a tool output) computes only the new tokens; the
    next-token log-probs stay a full forward's; after the weights change nothing is reused."""
    p = prompt(tok)
    smp = KVSampler(model, tok)
    torch.manual_seed(5)
    first = smp.generate([p, p[2:], p[5:]], [12, 12, 12], 1.0)
    tool_out = tf.encode(tok, "<call_tool>search Harta</call_tool>")
    nxt = [pr + new + tool_out for pr, new in zip([p, p[2:], p[5:]], first)]
    fed = []
    hook = model.model.register_forward_hook(lambda m, a, kw, out: fed.append(kw["input_ids"].shape),
                                             with_kwargs=True)
    try:
        torch.manual_seed(6)
        ids, lps = smp.decode(nxt, [20, 20, 20], 1.0, return_logprobs=True)
        # the prefill fed at most the tool output and the last sampled token of each row
        assert fed[0][1] <= len(tool_out) + 1 < min(len(x) for x in nxt)
        for pr, new, lp in zip(nxt, ids, lps):
            seq = torch.tensor([pr + new])
            full = policy.token_logprobs(model, seq, torch.ones_like(seq))[0, len(pr):]
            assert torch.allclose(torch.tensor(lp), full, atol=1e-5, rtol=0)
        second = smp.generate(nxt, [4, 4, 4], 1.0)
        cont = [nxt[0] + second[0] + tool_out]
        fed.clear()
        smp.decode(cont, [2], 1.0)
        assert fed[0][1] <= len(tool_out) + 1  # the kept context of the second call is reused
        fed.clear()
        with torch.no_grad():
            model.lm_head.weight.mul_(1.0)  # an in-place change (an optimizer step's kind)
        smp.decode(cont, [2], 1.0)
        assert fed[0][1] == len(cont[0])  # the whole context again
    finally:
        hook.remove()


def test_rollout_engine_greedy_tool_loop_same_rollouts_sec3_2(tok, model):
    """Inside the rollout engine (tool calls, environment tokens, several rounds), greedy rollouts
    are the same trajectories with either sampler."""
    queries = tf.train_queries()[:2]
    stop = tok.convert_tokens_to_ids("</call_tool>")
    out = []
    for cls in (HFSampler, KVSampler):
        inner = cls(model, tok)
        hook = Force(model, [])

        class EveryRound:  # the 4th new token of every round is </call_tool>
            def generate(self, prompts, budgets, temperature):
                hook.script, hook.n = [None, None, None, stop], 0
                return inner.generate(prompts, budgets, temperature)

        try:
            engine = tf.make_engine(EveryRound(), tok, max_response_tokens=160, max_rounds=3,
                                    temperature=0.0)
            ros = engine.run(queries, n=2)
        finally:
            hook.remove()
        out.append([(r.response_ids, r.loss_mask, r.stage_ids, r.truncated) for r in ros])
    assert out[0] == out[1]
    assert all(len(r[0]) > 0 and 0 in r[1] for r in out[1])  # tool outputs were inserted


def test_config_sampler_kv_builds_the_kv_sampler(tok, model):
    from backends.run import build, config as settings, presets

    cfg = presets.toy_preset()
    cfg.sampler = "kv"
    settings.validate_config(cfg)
    assert isinstance(build.build_sampler(cfg, model, tok), KVSampler)
    cfg.sampler = "hf"
    s = build.build_sampler(cfg, model, tok)
    assert isinstance(s, HFSampler) and not isinstance(s, KVSampler)


def test_inverse_cdf_draw_has_the_distribution_frequencies_sec3_1():
    """Every row a draw from p: frequencies within 5 sigma over 200,000 rows, zero-probability ids
    never drawn, the last id reachable, and the float32 cumulative sums of an 8k-vocabulary softmax
    within 1e-6 of exact ones."""
    p = torch.tensor([0.5, 0.25, 0.0, 0.125, 0.0625, 0.0, 0.0625])
    N = 200_000
    torch.manual_seed(0)
    x = draw_inverse_cdf(p.expand(N, -1))
    freq = torch.bincount(x, minlength=len(p)).double() / N
    sigma = (p.double() * (1 - p.double()) / N).sqrt()
    assert ((freq - p.double()).abs() <= 5 * sigma + 1e-12).all(), freq
    assert freq[2] == 0 and freq[5] == 0 and freq[6] > 0
    big = torch.softmax(torch.randn(64, 8192) * 3, dim=-1)
    exact = big.double().cumsum(-1)
    assert float((big.cumsum(-1).double() - exact).abs().max()) < 1e-6
    with pytest.raises(ValueError):
        KVSampler(toy_model.build_tiny_qwen3(tf.tiny_tokenizer(), "XS"), tf.tiny_tokenizer(), draw="x")


def test_growing_cache_gives_dynamic_cache_floats_bit_for_bit_sec3_1(tok, model, monkeypatch):
    """new_cache's in-place layers hold the numbers transformers' DynamicCache holds: the same
    draws and the same log-probs, bit for bit, through a deduplicated prefill (row copies), rows
    stopping at different steps (row selection), capacity growth and a next turn from the prefix
    cache."""
    from transformers import DynamicCache

    from toy import kv_sampler

    p = prompt(tok)
    tool_out = tf.encode(tok, "<call_tool>search Harta</call_tool>")

    def two_turns():
        smp = KVSampler(model, tok)
        torch.manual_seed(11)
        kept: dict = {}
        ids, lps = smp.decode([p, p, p[4:], p], [40, 7, 90, 25], 1.0, return_logprobs=True,
                              keep=kept)  # budgets past the first capacity (prompt + 64)
        smp._kept, smp._kept_weights = kept, smp._weights()  # as generate stores them
        nxt = [x + y + tool_out for x, y in zip([p, p, p[4:], p], ids)]
        ids2, lps2 = smp.decode(nxt, [30, 30, 30, 30], 1.0, return_logprobs=True)
        return ids, lps, ids2, lps2, smp

    grown = two_turns()
    assert grown[4]._kept  # the second turn could reuse kept rows
    layers = {type(lay).__name__ for lay in kv_sampler.new_cache(model.config).layers}
    assert layers == {"GrowingLayer"}
    monkeypatch.setattr(kv_sampler, "new_cache", lambda config: DynamicCache(config=config))
    plain = two_turns()
    assert grown[0] == plain[0] and grown[2] == plain[2]  # the same draws
    assert grown[1] == plain[1] and grown[3] == plain[3]  # the same log-probs, bit for bit
    assert len({len(x) for x in grown[0]}) > 1  # rows stopped at different steps

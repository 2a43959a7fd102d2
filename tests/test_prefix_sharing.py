"""Prefix sharing in the SS-GRPO update, the fast path's (backends/run/fast_logprobs.py: pack_rows,
SharedPrefixRows, token_logprobs' segment rows): sequences that begin with the same loss-free prompt
(a reflection group's m candidates, §3.4) are packed into one row, the prompt once. Every log-prob
and every gradient must be what the plain path's separate rows give (policy.token_logprobs,
policy.PaddedRows; to float rounding), for any grouping; which sequences get packed follows
share_groups' rule."""
import copy
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import policy

from backends.run import fast_logprobs as fast
from toy import model as toy_model
from backends.run.torch_engine import TorchEngine
from policy import UpdateBatch
from hparams import SSGRPOConfig

V, PAD = 61, 0


def tiny_qwen3(seed: int = 0, attn: str | None = None):
    """A randomly initialised XS Qwen3 (toy_model.SIZES) over a 61-token vocabulary."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=V, max_position_embeddings=256, tie_word_embeddings=True,
                      pad_token_id=PAD, **toy_model.SIZES["XS"])
    if attn is not None:
        cfg._attn_implementation = attn
    return Qwen3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3()


def grouped_batch(shape: list, seed: int = 0) -> UpdateBatch:
    """shape: per group (prompt length, [continuation lengths]); continuations are loss-masked
    except a 2-token environment stretch in the longer ones; advantages vary per token."""
    g = torch.Generator().manual_seed(seed)
    b = UpdateBatch()
    for P, conts in shape:
        prompt = torch.randint(1, V, (P,), generator=g).tolist()
        for T in conts:
            m = [0] * P + [1] * T
            if T >= 6:
                m[P + 3: P + 5] = [0, 0]
            b.ids.append(prompt + torch.randint(1, V, (T,), generator=g).tolist())
            b.mask.append(m)
            b.adv.append([x * float(torch.rand(1, generator=g) * 2 - 1) for x in m])
            b.kind.append("reflection")
    return b


def separate(model, batch: UpdateBatch) -> list:
    """Each sequence's log-probs from a row of its own."""
    out = []
    for ids in batch.ids:
        x = torch.tensor([ids])
        out.append(policy.token_logprobs(model, x, torch.ones_like(x))[0])
    return out


groups = st.lists(st.tuples(st.integers(1, 24), st.lists(st.integers(1, 8), min_size=1, max_size=4)),
                  min_size=1, max_size=4)


@settings(max_examples=25, deadline=None)
@given(groups, st.integers(0, 3))
def test_packed_rows_give_each_sequences_own_logprobs(model, shape, seed):
    batch = grouped_batch(shape, seed)
    idx = list(range(len(batch.ids)))
    random.Random(seed).shuffle(idx)
    ids, att, mask, adv, layout = fast.pack_rows(batch, idx, PAD, share=True)
    with torch.no_grad():
        got = fast.unpack(fast.token_logprobs(model, ids, att), layout,
                            [len(x) for x in batch.ids])
        want = separate(model, batch)
    assert sorted(got) == sorted(idx)
    for i in idx:
        assert got[i].shape == want[i].shape
        assert float((got[i] - want[i]).abs().max()) < 1e-5
    # the packed tensors carry every loss-masked token and its advantage exactly once
    assert int(mask.sum()) == sum(sum(m) for m in batch.mask)
    assert abs(float(adv[mask].sum()) - sum(sum(a) for a in batch.adv)) < 1e-4


def test_a_reflection_group_is_one_row_and_short_prompts_stay_apart():
    # two groups behind long prompts, one group whose prompt is shorter than its continuations
    batch = grouped_batch([(20, [3, 4, 5]), (18, [2, 6]), (3, [7, 9])])
    groups_ = fast.share_groups(batch, range(7))
    assert groups_ == [[0, 1, 2], [3, 4], [5], [6]]
    ids, att, *_ = fast.pack_rows(batch, list(range(7)), PAD)
    assert ids.shape[0] == 4
    assert att[0].tolist()[:20] == [1] * 20 and set(att[0].tolist()[20:32]) == {2, 3, 4}
    # same prompt ids but a different loss-free length are not one group
    b2 = grouped_batch([(10, [2, 2])])
    b2.mask[1][10] = 0
    assert fast.share_groups(b2, [0, 1]) == [[0], [1]]


def test_without_sharing_every_sequence_is_its_own_right_padded_row():
    batch = grouped_batch([(20, [3, 4]), (5, [9])])
    idx = [2, 0, 1]
    ids, att, mask, adv, layout = fast.pack_rows(batch, idx, PAD, share=False)
    L = max(len(batch.ids[i]) for i in idx)
    assert ids.shape == att.shape == mask.shape == adv.shape == (3, L)
    for r, i in enumerate(idx):
        n = len(batch.ids[i])
        assert ids[r].tolist() == batch.ids[i] + [PAD] * (L - n)
        assert att[r].tolist() == [1] * n + [0] * (L - n)
        assert mask[r].tolist() == [bool(x) for x in batch.mask[i]] + [False] * (L - n)
        assert torch.equal(adv[r, :n], torch.tensor(batch.adv[i])) and not adv[r, n:].any()
        assert layout[r] == [(i, 0, 0, n)]
    assert all(torch.equal(x, y) for x, y in zip(policy.pad_rows(batch, idx, PAD), (ids, att, mask, adv)))
    # the plain layout places and unpacks per-sequence values as the packer's unshared layout does
    rows, vals = policy.PaddedRows(), [torch.rand(len(x)) for x in batch.ids]
    *_, plain_layout = rows.pack(batch, idx, PAD)
    assert plain_layout == idx
    placed = rows.place(vals, plain_layout, ids.shape)
    assert torch.equal(placed, fast.place(vals, layout, ids.shape))
    back = rows.unpack(placed, plain_layout, [len(x) for x in batch.ids])
    assert sorted(back) == sorted(idx) and all(torch.equal(back[i], vals[i]) for i in idx)


def test_eager_attention_packs_too_and_others_are_refused():
    batch = grouped_batch([(16, [3, 5, 2])])
    eager = tiny_qwen3(attn="eager")
    ids, att, _, _, layout = fast.pack_rows(batch, [0, 1, 2], PAD)
    with torch.no_grad():
        got = fast.unpack(fast.token_logprobs(eager, ids, att), layout,
                            [len(x) for x in batch.ids])
        want = separate(eager, batch)
    assert max(float((got[i] - want[i]).abs().max()) for i in range(3)) < 1e-5
    other = tiny_qwen3()
    other.config._attn_implementation = "flash_attention_2"  # as a model loaded for FlashAttention
    with pytest.raises(ValueError, match="fast_logprobs"):
        fast.token_logprobs(other, ids, att)


class RecordingOpt:
    """Optimizer stand-in: keeps each step's gradients and leaves the weights alone."""

    def __init__(self, params):
        self.params, self.grads = list(params), []

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        self.grads.append([p.grad.detach().clone() for p in self.params])


class GroupedPaddedRows(policy.PaddedRows):
    """One sequence per row, but the minibatch split and the passes take SharedPrefixRows' units:
    the plain path's values for the packed path's plan."""

    def units(self, batch):
        return fast.SharedPrefixRows().units(batch)


@pytest.mark.parametrize("agg", ["token_mean", "paper"])
@pytest.mark.parametrize("minibatches,micro", [(1, 16), (1, 4), (2, 4), (2, 3), (2, 1)])  # (1, 4): the toy preset
def test_update_with_sharing_has_the_unshared_losses_and_gradients(agg, minibatches, micro):
    # With sharing, a packed group is one unit of the plan (one optimizer step, one pass); the
    # unshared run takes the same plan with one sequence per row, so the two must agree
    batch = grouped_batch([(22, [3, 4, 6, 2]), (19, [5, 1, 7]), (4, [8, 6])], seed=3)
    ref_model = tiny_qwen3(seed=1)  # a reference unlike the policy: the KL term has a gradient
    runs = []
    for share in (False, True):
        model = tiny_qwen3()
        cfg = SSGRPOConfig(minibatches=minibatches, micro_batch=micro, agg=agg, beta=0.04,
                           grad_clip=1e9)
        opt = RecordingOpt(model.parameters())
        engine = TorchEngine(model, cfg, copy.deepcopy(ref_model), opt, fast=share)
        if not share:
            engine.rows = GroupedPaddedRows()
        out = engine.update(batch, PAD, random.Random(0))
        runs.append((out, opt.grads))
    (o0, g0), (o1, g1) = runs
    assert len(g0) == len(g1) == minibatches
    for k in ("loss/total", "loss/policy", "kl", "clip_frac", "grad_norm"):
        assert abs(o0[k] - o1[k]) < 1e-5, (k, o0[k], o1[k])
    worst = max(float((a - b).abs().max()) for s0, s1 in zip(g0, g1) for a, b in zip(s0, s1))
    assert worst < 1e-5, worst
    assert max(float(a.abs().max()) for a in g0[0]) > 1e-3  # a real gradient


def test_per_sequence_aggregation_is_never_packed(monkeypatch):
    calls = []  # per micro-batch the update lays out: packed (True) or one sequence per row
    for cls in (policy.PaddedRows, fast.SharedPrefixRows):
        monkeypatch.setattr(cls, "pack", lambda self, b, i, p, real=cls.pack: calls.append(
            isinstance(self, fast.SharedPrefixRows)) or real(self, b, i, p))
    batch = grouped_batch([(20, [3, 4])])
    cfg = SSGRPOConfig(minibatches=2, micro_batch=4, agg="seq_mean_token_mean", beta=0.01)
    TorchEngine(tiny_qwen3(), cfg, fast=True).update(batch, PAD, random.Random(0))
    assert calls and not any(calls)
    calls.clear()
    TorchEngine(tiny_qwen3(), SSGRPOConfig(micro_batch=4, beta=0.01), fast=True).update(
        batch, PAD, random.Random(0))
    assert calls and all(calls)
    calls.clear()  # the plain path (fast_logprobs off) never packs
    TorchEngine(tiny_qwen3(), SSGRPOConfig(micro_batch=4, beta=0.01)).update(batch, PAD,
                                                                             random.Random(0))
    assert calls and not any(calls)


def test_sequence_logprobs_with_sharing_keeps_the_pass_count(model):
    batch = grouped_batch([(20, [3, 4, 2]), (17, [5, 1])], seed=2)
    calls = []

    def fn(ids, att, mask=None):
        calls.append(ids.shape[0])
        return fast.token_logprobs(model, ids, att)

    plain = policy.sequence_logprobs(fn, batch, PAD, 2, 4)
    n_plain = len(calls)
    calls.clear()
    shared = policy.sequence_logprobs(fn, batch, PAD, 2, 4, None, fast.SharedPrefixRows())
    assert len(calls) == n_plain == 4  # 3 passes of 2 sequences + 1 padding pass, either way
    for a, b in zip(plain, shared):
        assert float((a - b).abs().max()) < 1e-5


def test_at_micro_batch_1_a_reflection_group_is_one_pass_of_one_row():
    # The full preset's micro_batch 1: a pass is one unit, so a group's m candidates go through as
    # one row holding their shared trajectory once (the dry run counts these tokens)
    shape = [(30, [4, 5, 3, 6]), (26, [2, 7, 4, 3])]
    batch = grouped_batch(shape, seed=5)
    seen = []
    engine = TorchEngine(tiny_qwen3(), SSGRPOConfig(minibatches=1, micro_batch=1, beta=0.04),
                         fast=True)
    real = engine.logprobs
    engine.logprobs = lambda ids, att, mask=None, **kw: seen.append(tuple(ids.shape)) or real(
        ids, att, mask, **kw)
    engine.update(batch, PAD, random.Random(0))
    packed = sorted((1, P + sum(c)) for P, c in shape)
    assert sorted(seen) == packed  # the loss passes: one row per group, the prompt once
    unpacked = sum(P + T for P, c in shape for T in c)
    assert sum(L for _, L in seen) < 0.5 * unpacked


def test_a_group_longer_than_the_max_pack_is_split_into_rows_within_it():
    batch = grouped_batch([(20, [3, 4, 5, 2, 6])])
    assert fast.share_groups(batch, range(5), max_tokens=28) == [[0, 1], [2, 3], [4]]
    rows = fast.SharedPrefixRows(max_tokens=28)
    assert rows.units(batch) == [[0, 1], [2, 3], [4]]
    ids, *_ = rows.pack(batch, list(range(5)), PAD)
    assert ids.shape == (3, 27) and fast.SharedPrefixRows().units(batch) == [[0, 1, 2, 3, 4]]
    assert fast.SharedPrefixRows().units(grouped_batch([(3, [7, 9])])) is None  # nothing packs


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=12), st.integers(1, 4), st.integers(1, 3),
       st.integers(1, 3), st.integers(0, 10**6))
def test_plan_update_keeps_every_unit_whole_on_one_rank_one_step_one_pass(sizes, world, mb, micro,
                                                                          seed):
    units, n = [], 0
    for k in sizes:
        units.append(list(range(n, n + k)))
        n += k
    batch = UpdateBatch([[1, 2, 3]] * n, [[0, 1, 1]] * n, [[0.0, 1.0, 1.0]] * n, ["reflection"] * n)
    shards, plans = policy.plan_update(batch, world, mb, micro, random.Random(seed), units)
    whole = {tuple(u) for u in units}
    got, passes = [], {len(p.n_micro) for p in plans}
    assert len(passes) == 1 and all(p.n_micro == plans[0].n_micro for p in plans)
    for p in plans:
        for j, step in enumerate(p.units if any(len(u) > 1 for u in units) else
                                 [[[i] for i in m] for m in p.minibatches]):
            assert len(step) <= micro * p.n_micro[j]  # n_micro passes of `micro` units hold them
            for u in step:
                got.append(tuple(p.index[i] for i in u))
    assert sorted(got) == sorted(whole)  # every unit once, whole
    assert sum(plans[0].n_seq) == n and sum(plans[0].n_tok) == 2 * n
    # singleton units are units=None: the same plan, the same rng draws
    a = policy.plan_update(batch, world, mb, micro, random.Random(seed), [[i] for i in range(n)])
    b = policy.plan_update(batch, world, mb, micro, random.Random(seed))
    assert [p.__dict__ for p in a[1]] == [p.__dict__ for p in b[1]]
    with pytest.raises(ValueError, match="partition"):
        policy.plan_update(batch, world, mb, micro, None, [list(range(n - 1))] if n > 1 else [[]])

"""The log pi pass behind every SS-GRPO ratio and KL term (§3.3). policy.token_logprobs (the plain
path) equals the model's own full-logits log_softmax; backends/run/fast_logprobs.token_logprobs (the
fast path: chunked, head on loss-masked columns only, recomputed in the backward) equals the plain
path: values for several chunk sizes, right and left padding, gradients with and without
recomputing each chunk in the backward, temperatures; recomputing keeps no (tokens x vocab)
tensor alive for the backward; and a pass calls its head module (fast_logprobs.ChunkedHead) once,
whatever its number of chunks (what keeps ZeRO-3 ranks in step: tests/test_zero3_collectives.py)."""
import os

import pytest
import torch

import policy

from backends.run import fast_logprobs as fast
from toy import model as toy_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = 97


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, max_position_embeddings=64, tie_word_embeddings=True,
                      **toy_model.SIZES["XS"])
    return Qwen3ForCausalLM(cfg).eval()


def hf_logprobs(model, ids, att, T: float = 1.0):
    """The model's own forward: full (B, L, V) logits / T -> log_softmax -> gather; column 0 = 0;
    positions counted from each row's first real token."""
    pos = (att.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=att, position_ids=pos).logits.float()
    lp = torch.log_softmax(logits[:, :-1] / T, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], 1)


plain = policy.token_logprobs  # the plain path: the reference of every fast-path test below


def batch(lengths, left: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.randint(0, V, (len(lengths), L), generator=g)
    att = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        if left:
            att[r, L - n:] = 1
        else:
            att[r, :n] = 1
    return ids, att


def valid(att):
    """Columns t whose token and predecessor are both real (the ones a loss mask can select)."""
    v = att.bool().clone()
    v[:, 1:] &= att[:, :-1].bool()
    v[:, 0] = False
    return v


@pytest.mark.parametrize("left", [False, True], ids=["right_pad", "left_pad"])
def test_plain_path_is_the_models_own_log_softmax(model, left):
    """policy.token_logprobs: values and gradients of the HF forward's log_softmax (logits / T);
    T <= 0 or not finite raises."""
    ids, att = batch([19, 11, 4], left)
    m = valid(att)
    w = torch.randn(ids.shape, generator=torch.Generator().manual_seed(9)) * m
    for T in (1.0, 0.7):
        grads = []
        for fn in (lambda: policy.token_logprobs(model, ids, att, temperature=T),
                   lambda: hf_logprobs(model, ids, att, T)):
            model.zero_grad(set_to_none=True)
            lp = fn()
            (lp * w).sum().backward()
            grads.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (got, g_got), (want, g_want) = grads
        assert got.shape == ids.shape and got.dtype == torch.float32
        assert torch.equal(got[:, 0], torch.zeros(3))
        assert torch.allclose(got[m], want[m], atol=1e-5, rtol=0), (got[m] - want[m]).abs().max()
        for n in g_want:
            assert torch.allclose(g_got[n], g_want[n], atol=1e-6, rtol=1e-4), (T, n)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            policy.token_logprobs(model, ids, att, temperature=bad)


@pytest.mark.parametrize("left", [False, True], ids=["right_pad", "left_pad"])
@pytest.mark.parametrize("chunk", [1, 3, 7, 18, 19, 1024])
def test_chunked_equals_plain_values(model, chunk, left):
    ids, att = batch([19, 11, 4], left)
    with torch.no_grad():
        got, want = fast.token_logprobs(model, ids, att, chunk), plain(model, ids, att)
    assert got.shape == ids.shape and got.dtype == torch.float32
    assert torch.equal(got[:, 0], torch.zeros(3))
    m = valid(att)
    assert torch.allclose(got[m], want[m], atol=1e-5, rtol=0), (got[m] - want[m]).abs().max()


def test_left_padding_equals_each_sequence_alone(model):
    ids, att = batch([12, 5], left=True, seed=3)
    with torch.no_grad():
        for lp in (fast.token_logprobs(model, ids, att, chunk_size=4), plain(model, ids, att)):
            for r in range(2):
                real = att[r].bool()
                alone = plain(model, ids[r:r + 1, real], att[r:r + 1, real])[0]
                assert torch.allclose(lp[r, real][1:], alone[1:], atol=1e-5)


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "keep"])
@pytest.mark.parametrize("left", [False, True], ids=["right_pad", "left_pad"])
def test_chunked_gradients_equal_plain(model, left, recompute):
    ids, att = batch([16, 9], left, seed=1)
    w = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2)) * valid(att)

    def grads(fn):
        model.zero_grad(set_to_none=True)
        (fn() * w).sum().backward()  # an advantage-weighted sum, like the surrogate at rho = 1
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    g_chunk = grads(lambda: fast.token_logprobs(model, ids, att, chunk_size=5, recompute=recompute))
    g_plain = grads(lambda: plain(model, ids, att))
    for n in g_plain:
        assert torch.allclose(g_chunk[n], g_plain[n], atol=1e-6, rtol=1e-4), n


def _saved_numel(fn) -> int:
    """Elements of every tensor autograd saves for the backward while fn() runs."""
    total = [0]

    def pack(t):
        total[0] += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


def test_recompute_saves_no_tokens_by_vocab_tensor_for_the_backward(model, monkeypatch):
    ids, att = batch([40, 40], left=False, seed=4)
    B, L = ids.shape
    keep = _saved_numel(lambda: fast.token_logprobs(model, ids, att, 8, recompute=False))
    # the default keeps a log-softmax under RECOMPUTE_ABOVE_BYTES (this one is 2 * 39 * V floats)
    assert _saved_numel(lambda: fast.token_logprobs(model, ids, att, 8)) == keep
    monkeypatch.setattr(fast, "RECOMPUTE_ABOVE_BYTES", B * (L - 1) * V * 4 - 1)
    auto = _saved_numel(lambda: fast.token_logprobs(model, ids, att, 8))  # grad on: recompute
    # Without recomputation the log-softmax of every chunk is kept: >= B * (L - 1) * V elements.
    assert keep >= B * (L - 1) * V
    # With it, what remains is the decoder's activations plus each chunk's hidden input; removing
    # the head's share must save at least the (B, L-1, V) log-softmax.
    assert keep - auto >= B * (L - 1) * V, (keep, auto)
    with torch.no_grad():
        assert torch.equal(fast.token_logprobs(model, ids, att, 8),
                           fast.token_logprobs(model, ids, att, 8, recompute=True))


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 1024])
def test_loss_mask_projects_only_the_used_columns(model, chunk, recompute, monkeypatch):
    """With loss_mask the head runs on the masked columns only: those equal the full pass (values
    and gradients of an advantage-weighted sum), every other column is 0, and the chunks hold
    exactly N rows, at most chunk x B each (one chunk of 0 rows when nothing is masked)."""
    ids, att = batch([17, 12, 6], left=False, seed=5)
    g = torch.Generator().manual_seed(6)
    lm = (torch.rand(ids.shape, generator=g) < 0.5) & valid(att)
    w = torch.randn(ids.shape, generator=g) * lm
    seen, project = [], fast._project

    def spy(weight, bias, h, nxt, rc, temperature=1.0):
        seen.append(h.shape[0])
        return project(weight, bias, h, nxt, rc, temperature)

    monkeypatch.setattr(fast, "_project", spy)
    model.zero_grad(set_to_none=True)
    got = fast.token_logprobs(model, ids, att, chunk, recompute=recompute, loss_mask=lm)
    (got * w).sum().backward()
    g_mask = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert sum(seen) == int(lm.sum()) and max(seen) <= chunk * 3
    assert len(seen) == -(-int(lm.sum()) // (chunk * 3))
    seen.clear()
    with torch.no_grad():
        none = fast.token_logprobs(model, ids, att, chunk, loss_mask=torch.zeros_like(lm))
    assert seen == [0] and not none.any()
    model.zero_grad(set_to_none=True)
    full = plain(model, ids, att)
    (full * w).sum().backward()
    assert torch.allclose(got[lm], full[lm], atol=1e-6, rtol=0)
    assert not got[~lm].any()
    for n, p in model.named_parameters():
        assert torch.allclose(g_mask[n], p.grad, atol=1e-6, rtol=1e-4), n


@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
def test_one_head_module_call_per_pass_whatever_the_chunk_count(model, recompute):
    """What keeps ZeRO-3 ranks in step (backends/distributed/zero3.py): a pass calls its ChunkedHead
    exactly once, forward and backward (a recompute included), whether its loss tokens fill 0, 1
    or many chunks, masked or not, and never calls the LM's head module itself (each module call is
    a parameter gather under ZeRO-3)."""
    head = fast.ChunkedHead(model.get_output_embeddings())
    calls = {"head": 0, "lm_head": 0, "backward": 0}
    hooks = [head.register_forward_hook(lambda *a: calls.__setitem__("head", calls["head"] + 1)),
             head.register_full_backward_hook(
                 lambda *a: calls.__setitem__("backward", calls["backward"] + 1)),
             model.lm_head.register_forward_hook(
                 lambda *a: calls.__setitem__("lm_head", calls["lm_head"] + 1))]
    ids, att = batch([30, 30], left=False, seed=11)
    one = torch.zeros_like(att, dtype=torch.bool)
    one[1, 10:15] = True  # 5 loss tokens: one chunk of 4 x 2 rows
    masks = {"none": torch.zeros_like(one), "one chunk": one, "many chunks": valid(att),
             "all columns": None}
    try:
        for name, lm in masks.items():
            n = int(valid(att).sum() if lm is None else lm.sum())
            assert (n == 0) == (name == "none")
            assert (n > 4 * 2) == (name in ("many chunks", "all columns"))  # more than one chunk
            calls.update(head=0, lm_head=0, backward=0)
            lp = fast.token_logprobs(model, ids, att, 4, recompute=recompute, loss_mask=lm, head=head)
            lp.sum().backward()
            assert calls == {"head": 1, "lm_head": 0, "backward": 1}, (name, calls)
    finally:
        for hk in hooks:
            hk.remove()
    with pytest.raises(ValueError, match="chunk_size"):
        fast.token_logprobs(model, ids, att, 0)


def test_loss_mask_on_packed_rows(model):
    """A prefix-shared row (segment ids) with a loss mask: each continuation's masked columns are
    its own sequence's log-probs."""
    g = torch.Generator().manual_seed(7)
    prefix, a, b = (torch.randint(0, V, (n,), generator=g) for n in (9, 5, 4))
    ids = torch.cat([prefix, a, b])[None]
    seg = torch.tensor([[1] * 9 + [2] * 5 + [3] * 4])
    lm = seg >= 2
    with torch.no_grad():
        got = fast.token_logprobs(model, ids, seg, loss_mask=lm)[0]
        for cont, start in ((a, 9), (b, 14)):
            x = torch.cat([prefix, cont])[None]
            alone = plain(model, x, torch.ones_like(x))[0, 9:]
            assert torch.allclose(got[start: start + len(cont)], alone, atol=1e-5, rtol=0)
    assert not got[:9].any()


@pytest.mark.parametrize("masked", [False, True], ids=["all_columns", "loss_mask"])
@pytest.mark.parametrize("recompute", [False, True])
def test_temperature_gives_the_sampling_distributions_log_probs(model, masked, recompute):
    """temperature T: the fast path's log_softmax(logits / T) at the token equals the plain path's,
    values and gradients (the distribution a sampler at T draws from); T = 1 is bit-identical to
    the default; T <= 0 raises."""
    ids, att = batch([15, 9], left=False, seed=7)
    lm = valid(att) if masked else None
    m = valid(att)
    w = torch.randn(ids.shape, generator=torch.Generator().manual_seed(8)) * m
    for T in (0.7, 1.3):
        model.zero_grad(set_to_none=True)
        got = fast.token_logprobs(model, ids, att, 4, recompute=recompute, loss_mask=lm,
                                  temperature=T)
        (got * w).sum().backward()
        g_got = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        want = plain(model, ids, att, temperature=T)
        (want * w).sum().backward()
        assert torch.allclose(got[m], want[m], atol=1e-5, rtol=0), T
        assert not torch.allclose(got[m], plain(model, ids, att).detach()[m], atol=1e-3)
        for n, p in model.named_parameters():
            assert torch.allclose(g_got[n], p.grad, atol=1e-5, rtol=1e-4), (T, n)
    with torch.no_grad():
        assert torch.equal(fast.token_logprobs(model, ids, att, 4, loss_mask=lm, temperature=1.0),
                           fast.token_logprobs(model, ids, att, 4, loss_mask=lm))
        for bad in (0.0, -1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="temperature"):
                fast.token_logprobs(model, ids, att, 4, temperature=bad)

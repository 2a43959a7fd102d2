"""Properties of Stage-Structured GRPO (§3.3 of arXiv 2605.10899), module ss_grpo.

Test names cite what they check: eq_G (G = R Lambda^T), eq_A (stagewise group normalisation),
eq_tok (token advantages), eq_clip (PPO-clip surrogate), eq_k3 (KL estimator), eq_L (the loss and
its aggregation), and the K = 1 reduction to GRPO.
"""
import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import ss_grpo as S

NAN = float("nan")
MODES = S.AGG_MODES


# ----------------------------------------------------------------------------- strategies
@st.composite
def scores(draw, min_n=1, max_n=8, k=None, nan=False):
    """(n, K) float64 scores in [0, 1] with frequent ties (grid values) and optional NaN."""
    n = draw(st.integers(min_n, max_n))
    kk = k if k is not None else draw(st.integers(1, 4))
    elem = st.one_of(st.sampled_from([0.0, 0.25, 0.35, 0.5, 1.0]), st.floats(0.0, 1.0))
    if nan:
        elem = st.one_of(elem, st.just(NAN))
    vals = draw(st.lists(elem, min_size=n * kk, max_size=n * kk))
    return torch.tensor(vals, dtype=torch.float64).view(n, kk)


def varied(x: torch.Tensor) -> bool:
    """Every column has at least two distinct values (so its std is positive)."""
    return x.shape[0] >= 2 and bool(((x.max(0).values - x.min(0).values) > 1e-3).all())


def ref_adv(G, eps, ddof, missing=None):
    """Independent numpy implementation of A = (G - mean) / (Std + eps), per column."""
    G = np.asarray(G, dtype=np.float64)
    miss = np.isnan(G) if missing is None else (np.asarray(missing) | np.isnan(G))
    A = np.zeros_like(G)
    for k in range(G.shape[1]):
        ok = ~miss[:, k]
        x = G[ok, k]
        if len(x) < 2 or np.all(x == x[0]):
            continue
        A[ok, k] = (x - x.mean()) / (x.std(ddof=ddof) + eps)
    return A


def batch(seed, n, T, p_mask=0.7, dtype=torch.float64, spread=0.3):
    """Random (logp, old_logp, ref_logp, adv, mask), all (n, T); logp is a leaf needing grad."""
    g = torch.Generator().manual_seed(seed)
    logp = (-3 * torch.rand(n, T, generator=g, dtype=torch.float64))
    old = logp + spread * torch.randn(n, T, generator=g, dtype=torch.float64)
    ref = logp + 0.5 * torch.randn(n, T, generator=g, dtype=torch.float64)
    adv = torch.randn(n, T, generator=g, dtype=torch.float64)
    mask = torch.rand(n, T, generator=g) < p_mask
    mask[:, 0] = True  # every sequence has at least one trained token
    return (logp.to(dtype).requires_grad_(True), old.to(dtype), ref.to(dtype), adv.to(dtype), mask)


seeds = st.integers(0, 2**31 - 1)
shapes = st.tuples(st.integers(1, 5), st.integers(1, 7))


# ----------------------------------------------------------------------------- Lambda, Eq. G
def test_paper_lambda_is_valid_and_matches_digest():
    lam = S.validate_lambda(S.PAPER_LAMBDA, expected_k=4)
    assert lam.dtype == torch.float64 and lam.shape == (4, 4)
    assert lam[0].tolist() == [1.0, 0.4, 0.6, 0.8] and lam[2].tolist() == [0.0, 0.0, 1.0, 0.8]
    assert S.STAGE_NAMES == ("plan", "research", "review", "answer")


@pytest.mark.parametrize("lam, msg", [
    ([[1.0, 0.5, 0.0]], "square"),
    ([1.0, 0.0], "square"),
    (torch.zeros(0, 0), "at least one stage"),
    ([[1.0, 0.5], [0.3, 1.0]], "upper triangular"),
    ([[1.0, 0.5], [0.0, 0.9]], "unit diagonal"),
    ([[1.0, NAN], [0.0, 1.0]], "finite"),
    ([[1.0, float("inf")], [0.0, 1.0]], "finite"),
    ([[1.0, 0.5], [0.0]], "could not read"),
])
def test_validate_lambda_rejects_invalid(lam, msg):
    with pytest.raises(ValueError, match=msg):
        S.validate_lambda(lam)


def test_validate_lambda_wrong_k_message():
    with pytest.raises(ValueError, match="Lambda is 3x3 but there are 4 stages"):
        S.validate_lambda(torch.eye(3), expected_k=4)
    with pytest.raises(ValueError, match="Lambda is 4x4 but there are 2 stages"):
        S.stage_returns(torch.rand(3, 2), S.PAPER_LAMBDA)


@given(scores())
def test_eq_G_identity_lambda_gives_R(R):
    G, missing = S.stage_returns(R, torch.eye(R.shape[1]))
    assert torch.equal(G, R) and not missing.any()


@given(scores(k=4))
def test_eq_G_equals_R_times_lambda_transposed(R):
    G, _ = S.stage_returns(R, S.PAPER_LAMBDA)
    lam = np.array(S.PAPER_LAMBDA)
    np.testing.assert_allclose(G.numpy(), R.numpy() @ lam.T, rtol=1e-12, atol=1e-12)


def test_eq_G_worked_example_paper_lambda():
    R = torch.tensor([[0.5, 0.25, 1.0, 0.75]], dtype=torch.float64)
    G, _ = S.stage_returns(R, S.PAPER_LAMBDA)
    expected = [0.5 + 0.4 * 0.25 + 0.6 * 1.0 + 0.8 * 0.75, 0.25 + 0.4 * 1.0 + 0.8 * 0.75,
                1.0 + 0.8 * 0.75, 0.75]
    np.testing.assert_allclose(G[0].numpy(), expected, rtol=1e-12)


@given(scores(k=4), scores(k=4), st.integers(0, 3))
def test_eq_G_causality_stage_k_ignores_earlier_stages(R, R2, k):
    """G[:, k] depends only on R[:, j >= k] (Lambda upper triangular)."""
    n = min(R.shape[0], R2.shape[0])
    R, R2 = R[:n].clone(), R2[:n].clone()
    R2[:, k:] = R[:, k:]  # same present/future scores, arbitrary past
    G, _ = S.stage_returns(R, S.PAPER_LAMBDA)
    G2, _ = S.stage_returns(R2, S.PAPER_LAMBDA)
    assert torch.equal(G[:, k:], G2[:, k:])


def test_stage_returns_rejects_inf_and_bad_shapes():
    with pytest.raises(ValueError, match="inf"):
        S.stage_returns(torch.tensor([[float("inf")]]), [[1.0]])
    with pytest.raises(ValueError, match=r"\(n, K\)"):
        S.stage_returns(torch.rand(3), [[1.0]])
    with pytest.raises(ValueError, match="groups of 2"):
        S.stage_returns(torch.rand(3, 1), [[1.0]], group_size=2)


# ----------------------------------------------------------------------------- Eq. A
@given(scores(), st.sampled_from(["sample", "population"]))
def test_eq_A_zero_mean_per_stage(G, std):
    A = S.group_advantages(G, std=std)
    assert torch.allclose(A.mean(0), torch.zeros(G.shape[1], dtype=A.dtype), atol=1e-12)


@given(scores())
def test_eq_A_unit_sample_std_when_group_varies(G):
    assume(varied(G))
    A0 = S.group_advantages(G, std="sample", eps=0.0)
    ones = torch.ones(G.shape[1], dtype=A0.dtype)
    assert torch.allclose(A0.std(0, unbiased=True), ones, atol=1e-9)
    A = S.group_advantages(G)  # defaults: sample std, eps = 1e-6 -> std = s / (s + eps) < 1
    sd = G.std(0, unbiased=True)
    assert torch.allclose(A.std(0, unbiased=True), sd / (sd + 1e-6), atol=1e-9)


@given(scores())
def test_eq_A_unit_population_std_variant(G):
    assume(varied(G))
    A = S.group_advantages(G, std="population", eps=0.0)
    ones = torch.ones(G.shape[1], dtype=A.dtype)
    assert torch.allclose(A.std(0, unbiased=False), ones, atol=1e-9)


@given(scores(nan=True), st.sampled_from([0.0, 1e-6, 1e-3, 0.1, 1.0]),
       st.sampled_from(["sample", "population"]))
def test_eq_A_matches_formula_eps_outside_std(G, eps, std):
    """A = (G - mean)/(Std + eps): eps added to the std, not inside the square root."""
    A = S.group_advantages(G, std=std, eps=eps)
    np.testing.assert_allclose(A.numpy(), ref_adv(G.numpy(), eps, 1 if std == "sample" else 0),
                               rtol=1e-9, atol=1e-9)


def test_eq_A_eps_placement_worked_example():
    G = torch.tensor([[0.0], [0.002]], dtype=torch.float64)  # sample std = 0.002 / sqrt(2)
    s = 0.002 / math.sqrt(2)
    A = S.group_advantages(G, std="sample", eps=1e-3)
    assert math.isclose(A[1, 0].item(), 0.001 / (s + 1e-3), rel_tol=1e-12)


@given(scores(k=4), st.floats(0.01, 100.0), st.floats(-10.0, 10.0),
       st.sampled_from(["sample", "population"]))
def test_eq_A_invariant_to_positive_affine_map_of_scores(R, a, b, std):
    """a R + b (a > 0) shifts each G column by a constant and scales it by a: A is unchanged
    exactly when eps = 0; with eps > 0 the change is bounded by the eps/std ratio."""
    assume(varied(R @ torch.tensor(S.PAPER_LAMBDA, dtype=torch.float64).T))
    G, _ = S.stage_returns(R, S.PAPER_LAMBDA)
    G2, _ = S.stage_returns(a * R + b, S.PAPER_LAMBDA)
    A = S.group_advantages(G, std=std, eps=0.0)
    A2 = S.group_advantages(G2, std=std, eps=0.0)
    assert torch.allclose(A, A2, rtol=1e-7, atol=1e-7)
    # eps > 0: |A_eps - A_0| <= |A_0| * eps / std, for each scale
    eps = 1e-6
    sd = G.std(0, unbiased=(std == "sample"))
    Ae = S.group_advantages(G, std=std, eps=eps)
    assert ((Ae - A).abs() <= A.abs() * eps / sd + 1e-9).all()


@given(st.integers(1, 16), st.sampled_from([0.35, 0.0, 1.0, 0.1, 0.7, 1 / 3, 123.456]),
       st.sampled_from([torch.float32, torch.float64]), st.sampled_from(["sample", "population"]),
       st.sampled_from([0.0, 1e-6]), seeds)
def test_eq_A_constant_stage_gives_exactly_zero(n, c, dtype, std, eps, seed):
    g = torch.Generator().manual_seed(seed)
    G = torch.rand(n, 3, generator=g).to(dtype)
    G[:, 1] = c  # e.g. fp32 0.35, not exactly representable
    A = S.group_advantages(G, std=std, eps=eps)
    assert A.dtype == dtype and torch.isfinite(A).all()
    assert (A[:, 1] == 0).all()


@given(st.integers(1, 16), st.sampled_from([0.35, 0.1, 0.7, 1 / 3]), seeds)
def test_eq_A_constant_later_scores_give_zero_through_stage_returns_fp32(n, c, seed):
    """R columns j >= k all constant -> G[:, k:] constant -> A[:, k:] exactly 0, in float32."""
    g = torch.Generator().manual_seed(seed)
    R = torch.rand(n, 4, generator=g)
    R[:, 2:] = c
    G, missing = S.stage_returns(R, S.PAPER_LAMBDA)
    A = S.group_advantages(G, missing=missing)
    assert G.dtype == torch.float32 and (A[:, 2:] == 0).all()


@given(st.floats(1e-3, 1e3), st.integers(2, 12), st.sampled_from([torch.float32, torch.float64]),
       st.sampled_from(["sample", "population"]), st.sampled_from([0.0, 1e-6]))
def test_eq_A_near_constant_stage_is_bounded(c, n, dtype, std, eps):
    """Values one ulp apart: no NaN, no inf, |A| <= sqrt(n) (bound of a standardised sample)."""
    x = torch.full((n, 1), c, dtype=dtype)
    x[0, 0] = torch.nextafter(x[0, 0], torch.tensor(math.inf, dtype=dtype))
    A = S.group_advantages(x, std=std, eps=eps)
    assert torch.isfinite(A).all() and (A.abs() <= math.sqrt(n)).all()


def test_eq_A_single_rollout_gives_zero():
    for std in S.STD_MODES:
        A = S.group_advantages(torch.tensor([[0.3, 0.9]]), std=std)
        assert torch.equal(A, torch.zeros(1, 2))


@given(scores(nan=True), st.randoms(use_true_random=False))
def test_eq_A_permuting_rollouts_permutes_advantages(G, rnd):
    perm = list(range(G.shape[0]))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    A = S.group_advantages(G)
    assert torch.allclose(S.group_advantages(G[perm]), A[perm], atol=1e-12)


@given(scores(k=4, min_n=2), st.data())
def test_missing_score_zeroes_only_its_cell(R, data):
    n = R.shape[0]
    i, j = data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, 3))
    Rm = R.clone()
    Rm[i, j] = NAN
    G, missing = S.stage_returns(Rm, S.PAPER_LAMBDA)
    assert missing.sum() == 1 and missing[i, j]
    A = S.group_advantages(G, missing=missing)
    assert torch.isfinite(A).all() and A[i, j] == 0
    # column j: the other rows are normalised among themselves, as if row i were absent
    keep = [r for r in range(n) if r != i]
    Gk, _ = S.stage_returns(R[keep], S.PAPER_LAMBDA)
    assert torch.allclose(A[keep, j], S.group_advantages(Gk)[:, j], atol=1e-12)
    # earlier stages see the missing score replaced by the group mean of column j
    Ri = R.clone()
    Ri[i, j] = R[keep, j].mean()
    Gi, _ = S.stage_returns(Ri, S.PAPER_LAMBDA)
    assert torch.allclose(A[:, :j], S.group_advantages(Gi)[:, :j], atol=1e-9)


def test_missing_whole_column_and_direct_nan_in_G():
    R = torch.tensor([[0.1, NAN], [0.9, NAN], [0.5, NAN]])
    G, missing = S.stage_returns(R, [[1.0, 0.5], [0.0, 1.0]])
    assert torch.allclose(G[:, 0], R[:, 0])  # whole column missing -> imputed 0
    A = S.group_advantages(G, missing=missing)
    assert (A[:, 1] == 0).all() and (A[:, 0] != 0).any()
    # NaN passed straight in G counts as missing too
    assert torch.equal(S.group_advantages(R)[:, 1], torch.zeros(3))


@given(scores(k=4, nan=True, min_n=2), seeds, st.sampled_from(MODES))
def test_missing_scores_never_reach_loss_as_nan(R, seed, mode):
    n, T = R.shape[0], 6
    G, missing = S.stage_returns(R.float(), S.PAPER_LAMBDA)
    A = S.group_advantages(G, missing=missing)
    g = torch.Generator().manual_seed(seed)
    stage_ids = torch.randint(-1, 4, (n, T), generator=g)
    mask = torch.rand(n, T, generator=g) < 0.8
    logp, old, ref, _, _ = batch(seed, n, T, dtype=torch.float32)
    adv_tok = S.token_advantages(A, stage_ids, mask)
    loss, stats = S.ss_grpo_loss(logp, old, ref, adv_tok, mask, agg=mode)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(v) for v in stats.values())


@given(st.lists(st.integers(1, 5), min_size=1, max_size=5), seeds, st.sampled_from(S.STD_MODES))
def test_eq_A_batched_equals_per_group(sizes, seed, std):
    g = torch.Generator().manual_seed(seed)
    groups = [torch.rand(m, 3, generator=g, dtype=torch.float64) for m in sizes]
    for grp in groups:
        grp[0, 0] = NAN  # one missing cell per group
    expected = torch.cat([S.group_advantages(grp, std=std) for grp in groups])
    ids = torch.cat([torch.full((m,), 7 * b) for b, m in enumerate(sizes)])
    perm = torch.randperm(len(ids), generator=g)
    got = S.group_advantages_batched(torch.cat(groups)[perm], group_ids=ids[perm], std=std)
    assert torch.allclose(got, expected[perm], atol=1e-12)
    if len(set(sizes)) == 1:
        got2 = S.group_advantages_batched(torch.cat(groups), group_size=sizes[0], std=std)
        assert torch.allclose(got2, expected, atol=1e-12)


def test_group_advantages_argument_errors():
    G = torch.rand(4, 2)
    for kwargs, msg in [({"std": "biased"}, "std must be"), ({"eps": -1.0}, "eps"),
                        ({"missing": torch.zeros(4, 3, dtype=torch.bool)}, "missing must")]:
        with pytest.raises(ValueError, match=msg):
            S.group_advantages(G, **kwargs)
    with pytest.raises(ValueError, match="inf"):
        S.group_advantages(torch.tensor([[float("inf")], [0.0]]))
    with pytest.raises(ValueError, match="not both"):
        S.group_advantages_batched(G, group_size=2, group_ids=torch.tensor([0, 0, 1, 1]))
    with pytest.raises(ValueError, match="groups of 3"):
        S.group_advantages_batched(G, group_size=3)


@given(scores(k=1, nan=True), st.integers(1, 4), st.sampled_from(S.STD_MODES))
def test_flat_advantages_broadcast_one_terminal_score(r, K, std):
    """Baseline RL: one normalised terminal score, the same for every stage (K = 1 GRPO)."""
    r = r[:, 0]
    A = S.flat_advantages(r, K, std=std)
    assert A.shape == (len(r), K)
    G, missing = S.stage_returns(r[:, None], [[1.0]])
    one = S.group_advantages(G, std=std, missing=missing)
    assert torch.equal(A, one.expand(-1, K))
    assert (A[torch.isnan(r)] == 0).all()


# ----------------------------------------------------------------------------- Eq. token advantages
@given(st.integers(1, 4), st.integers(1, 9), st.integers(1, 4), seeds)
def test_eq_tok_every_token_gets_its_stage_block_advantage(n, T, K, seed):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(n, K, generator=g)
    stage_ids = torch.randint(-1, K, (n, T), generator=g)
    mask = (torch.rand(n, T, generator=g) < 0.7).long()
    At = S.token_advantages(A, stage_ids, mask)
    for i in range(n):
        for t in range(T):
            k = stage_ids[i, t].item()
            want = A[i, k].item() if (mask[i, t] == 1 and k >= 0) else 0.0
            assert At[i, t].item() == want


def test_token_advantages_rejects_bad_inputs():
    A = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"\[-1, 3\]"):
        S.token_advantages(A, torch.full((2, 3), 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="integer"):
        S.token_advantages(A, torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="0 and 1"):
        S.token_advantages(A, torch.zeros(2, 3, dtype=torch.long), torch.full((2, 3), 2))
    with pytest.raises(ValueError, match="both be"):
        S.token_advantages(A, torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4))


def test_skipped_stage_credit_moves_a_skipped_stages_advantage_to_the_skipping_token():
    """Option ss_grpo.skipped_stage_credit (ours): a rollout without a Review block gives A_review to
    the first loss-masked Answer token (the <answer> tag written where <review> was due); nothing
    else changes, and a rollout with every stage, or none after the skipped one, is untouched."""
    A = torch.tensor([0.3, -0.2, -0.9, 0.1])
    st_ids = torch.tensor([-1, -1, 0, 0, 1, 1, 1, 3, 3, 3])  # prompt, plan, research, answer
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 1])  # a tool-output token in research
    adv = S.token_advantages(A[None], st_ids[None], mask[None])[0]
    got = S.skipped_stage_credit(adv, A, st_ids, mask, (True, True, False, True))
    want = adv.clone()
    want[7] = -0.9
    assert torch.equal(got, want) and adv[7] == 0.1  # adv itself is not modified
    assert torch.equal(S.skipped_stage_credit(adv, A, st_ids, mask, (True,) * 4), adv)
    assert torch.equal(S.skipped_stage_credit(adv, A, st_ids, mask, (True, True, False, False)), adv)
    # the first skipped stage counts: research and review missing -> A_research on the answer tag
    st2 = torch.tensor([-1, 0, 0, 3, 3])
    m2 = torch.tensor([0, 1, 1, 0, 1])  # the answer's first token is masked: the next one gets it
    adv2 = S.token_advantages(A[None], st2[None], m2[None])[0]
    got2 = S.skipped_stage_credit(adv2, A, st2, m2, (True, False, False, True))
    assert got2.tolist() == pytest.approx([0, 0.3, 0.3, 0, -0.2])
    with pytest.raises(ValueError, match="stages"):
        S.skipped_stage_credit(adv, A, st_ids, mask, (True, True, True))


def test_update_batch_applies_skipped_stage_credit_only_when_asked():
    """train.update_batch: the option off gives §3.3's token advantages; on, the <answer> token of a
    rollout that skipped its review carries A_review."""
    import scaffold
    import train

    text = "<structured_plan>p</structured_plan><state_evaluation>s</state_evaluation><answer>a</answer>"
    parsed = scaffold.parse_response(text)
    assert parsed.has_stage == (True, True, False, True)
    r = scaffold.Rollout(query=None, bank_items=[], prompt_ids=[5, 6],
                         response_ids=[1, 2, 3, 4], loss_mask=[1, 1, 1, 1],
                         stage_ids=[0, 1, 3, 3], text=text, parsed=parsed)
    A = torch.tensor([[0.5, 0.2, -0.7, 0.05]])
    off = train.update_batch([r], A).adv[0]
    on = train.update_batch([r], A, skip_credit=True).adv[0]
    assert off == pytest.approx([0, 0, 0.5, 0.2, 0.05, 0.05])
    assert on == pytest.approx([0, 0, 0.5, 0.2, -0.7, 0.05])


# ----------------------------------------------------------------------------- Eq. clip, Eq. L
def agg_weights(mask, mode):
    """d aggregate / d per_token[i, t] for each mode (batch normalisers)."""
    m = mask.double()
    n = m.shape[0]
    if mode == "paper":
        return m / n
    if mode == "token_mean":
        return m / m.sum()
    return m / (n * m.sum(1, keepdim=True).clamp(min=1))


@given(seeds, shapes, st.sampled_from(MODES))
def test_eq_clip_gradient_at_rho_one_is_minus_A_times_weight(seed, shape, mode):
    logp, _, _, adv, mask = batch(seed, *shape)
    loss, _ = S.ss_grpo_loss(logp, logp.detach().clone(), None, adv, mask, beta=0.0, agg=mode)
    loss.backward()
    assert torch.allclose(logp.grad, -adv * agg_weights(mask, mode), atol=1e-12)


@given(seeds, shapes, st.floats(0.05, 0.5), st.sampled_from(MODES), st.booleans())
def test_eq_clip_gradient_zero_on_clipped_side(seed, shape, eta, mode, high):
    """rho > 1 + eta with A > 0, or rho < 1 - eta with A < 0: the clipped branch, no gradient."""
    logp, _, _, adv, mask = batch(seed, *shape)
    g = torch.Generator().manual_seed(seed + 1)
    u = torch.rand(shape, generator=g, dtype=torch.float64)
    if high:
        adv, rho = adv.abs() + 0.1, (1 + eta) * (1.01 + u)
    else:
        adv, rho = -adv.abs() - 0.1, (1 - eta) * (0.99 - 0.9 * u)
    old = logp.detach() - torch.log(rho)
    loss, stats = S.ss_grpo_loss(logp, old, None, adv, mask, eta=eta, beta=0.0, agg=mode)
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros_like(logp))
    assert stats["clip_frac"].item() == pytest.approx(1.0)
    assert loss.item() == pytest.approx(S.aggregate(
        -torch.clamp(rho, 1 - eta, 1 + eta) * adv, mask, mode).item(), rel=1e-12)


@given(seeds, shapes, st.floats(0.05, 0.5), st.sampled_from(MODES), st.booleans())
def test_eq_clip_gradient_unclipped_side_is_minus_rho_A(seed, shape, eta, mode, high):
    """rho > 1 + eta with A < 0, or rho < 1 - eta with A > 0: min picks rho A, gradient -rho A w."""
    logp, _, _, adv, mask = batch(seed, *shape)
    g = torch.Generator().manual_seed(seed + 2)
    u = torch.rand(shape, generator=g, dtype=torch.float64)
    if high:
        adv, rho = -adv.abs() - 0.1, (1 + eta) * (1.01 + u)
    else:
        adv, rho = adv.abs() + 0.1, (1 - eta) * (0.99 - 0.9 * u)
    old = logp.detach() - torch.log(rho)
    loss, stats = S.ss_grpo_loss(logp, old, None, adv, mask, eta=eta, beta=0.0, agg=mode)
    loss.backward()
    assert torch.allclose(logp.grad, -rho * adv * agg_weights(mask, mode), rtol=1e-9, atol=1e-12)
    assert stats["clip_frac"].item() == 0.0


@given(seeds, shapes)
def test_eq_clip_fraction_counts_masked_tokens_only(seed, shape):
    logp, old, _, adv, mask = batch(seed, *shape, spread=0.5)
    _, clipped = S.clipped_surrogate(logp, old, adv, eta=0.2, mask=mask)
    rho = torch.exp(logp.detach() - old)
    want = (((adv > 0) & (rho > 1.2)) | ((adv < 0) & (rho < 0.8))) & mask
    assert torch.equal(clipped, want)
    _, stats = S.ss_grpo_loss(logp, old, None, adv, mask, beta=0.0)
    assert stats["clip_frac"].item() == pytest.approx(want.sum().item() / mask.sum().item())


@given(seeds, shapes, st.sampled_from(MODES), st.sampled_from([NAN, math.inf, -math.inf, 1e30]))
def test_eq_L_masked_tokens_zero_loss_and_zero_gradient_even_with_garbage(seed, shape, mode, junk):
    logp, old, ref, adv, mask = batch(seed, *shape, p_mask=0.5)
    clean, _ = S.ss_grpo_loss(logp, old, ref, adv, mask, beta=0.1, agg=mode)
    dirty_logp = torch.where(mask, logp, torch.tensor(junk, dtype=logp.dtype))
    junked = [torch.where(mask, x, torch.tensor(junk, dtype=x.dtype)) for x in (old, ref, adv)]
    loss, stats = S.ss_grpo_loss(dirty_logp, *junked, mask, beta=0.1, agg=mode)
    assert loss.item() == clean.item()
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert (logp.grad[~mask] == 0).all()


@given(seeds, shapes, st.sampled_from(MODES))
def test_eq_L_equals_policy_plus_beta_kl(seed, shape, mode):
    logp, old, ref, adv, mask = batch(seed, *shape)
    loss, stats = S.ss_grpo_loss(logp, old, ref, adv, mask, beta=0.05, agg=mode)
    pg = S.aggregate(S.clipped_surrogate(logp, old, adv, mask=mask)[0], mask, mode)
    kl = S.aggregate(S.kl_k3(logp, ref, mask=mask), mask, mode)
    assert kl.item() >= 0
    assert loss.item() == pytest.approx(pg.item() + 0.05 * kl.item(), rel=1e-12, abs=1e-12)
    assert stats["kl"].item() == pytest.approx(kl.item(), rel=1e-12, abs=1e-15)
    assert stats["loss/policy"].item() == pytest.approx(pg.item(), rel=1e-12, abs=1e-15)


@given(seeds, shapes, st.sampled_from(MODES))
def test_eq_L_gradient_step_on_kl_term_lowers_kl(seed, shape, mode):
    """With A = 0 only beta * KL remains: a small gradient step must lower the KL (+ sign)."""
    logp, _, ref, _, mask = batch(seed, *shape)
    ref = ref.clamp(logp.detach() - 5, logp.detach() + 5)
    kl0 = S.aggregate(S.kl_k3(logp, ref), mask, mode)
    assume(kl0.item() > 1e-8)
    zero_adv = torch.zeros_like(logp)
    loss, _ = S.ss_grpo_loss(logp, logp.detach(), ref, zero_adv, mask, beta=1.0, agg=mode)
    loss.backward()
    step = 1e-3 / (1 + logp.grad.abs().max())
    kl1 = S.aggregate(S.kl_k3(logp.detach() - step * logp.grad, ref), mask, mode)
    assert kl1.item() < kl0.item()


# ----------------------------------------------------------------------------- Eq. k3
@given(st.lists(st.tuples(st.floats(-60, 0), st.floats(-80, 80)), min_size=1, max_size=20),
       st.sampled_from([torch.float32, torch.float64]))
def test_eq_k3_nonnegative_zero_iff_equal_and_exact(pairs, dtype):
    logp = torch.tensor([p for p, _ in pairs], dtype=torch.float64)
    d = torch.tensor([d for _, d in pairs], dtype=torch.float64)
    ref = logp + d
    k3 = S.kl_k3(logp.to(dtype)[None], ref.to(dtype)[None])[0]
    assert (k3 >= 0).all()
    d_eff = ref.to(dtype).double() - logp.to(dtype).double()  # after rounding to dtype
    assert (k3[d_eff == 0] == 0).all()
    big = d_eff.abs() >= (1e-3 if dtype == torch.float32 else 1e-5)
    assert (k3[big] > 0).all()
    want = torch.expm1(d_eff) - d_eff
    assert torch.allclose(k3.double(), want, rtol=1e-4 if dtype == torch.float32 else 1e-10,
                          atol=1e-9 if dtype == torch.float32 else 1e-15)


@given(st.lists(st.floats(-80, 80), min_size=1, max_size=20), st.floats(-30, 0))
def test_eq_k3_finite_value_and_gradient_for_log_ratios_up_to_80_fp32(ds, base):
    d = torch.tensor(ds + [80.0, -80.0, 1e4, -1e4], dtype=torch.float32)[None]  # (1, T)
    logp = torch.full_like(d, base).requires_grad_(True)
    k3 = S.kl_k3(logp, logp.detach() + d)
    k3.sum().backward()
    assert torch.isfinite(k3).all() and torch.isfinite(logp.grad).all()
    rho_loss, _ = S.clipped_surrogate(logp, logp.detach() - d, torch.ones_like(d))
    assert torch.isfinite(rho_loss).all()


# ----------------------------------------------------------------------------- Eq. L aggregation
@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), seeds, st.sampled_from(MODES),
       st.integers(0, 3))
def test_eq_L_padded_batch_equals_sum_of_single_sequences(lengths, seed, mode, extra_pad):
    """Padding (mask 0, garbage values) changes nothing: with the global normalisers the padded
    batch loss is the sum of the losses of each unpadded sequence alone."""
    n, T = len(lengths), max(lengths) + extra_pad
    logp, old, ref, adv, _ = batch(seed, n, T)
    mask = torch.zeros(n, T, dtype=torch.bool)
    for i, L in enumerate(lengths):
        mask[i, :L] = True
    garbage = torch.tensor(NAN, dtype=logp.dtype)
    padded = [torch.where(mask, x, garbage) for x in (logp, old, ref, adv)]
    full, _ = S.ss_grpo_loss(*padded, mask, beta=0.01, agg=mode)
    parts = [S.ss_grpo_loss(logp[i:i + 1, :L], old[i:i + 1, :L], ref[i:i + 1, :L],
                            adv[i:i + 1, :L], torch.ones(1, L), beta=0.01, agg=mode,
                            num_sequences=n, num_tokens=sum(lengths))[0]
             for i, L in enumerate(lengths)]
    assert full.item() == pytest.approx(sum(p.item() for p in parts), rel=1e-10, abs=1e-12)


@given(seeds, st.integers(2, 6), st.integers(1, 7), st.sampled_from(MODES), st.data())
def test_eq_L_microbatch_gradient_accumulation_equals_full_batch(seed, n, T, mode, data):
    logp, old, ref, adv, mask = batch(seed, n, T)
    full, fstats = S.ss_grpo_loss(logp, old, ref, adv, mask, beta=0.01, agg=mode)
    (g_full,) = torch.autograd.grad(full, logp)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, n - 1), max_size=3))))
    bounds = list(zip([0] + cuts, cuts + [n]))
    total, acc = 0.0, {k: 0.0 for k in fstats}
    for a, b in bounds:
        loss, stats = S.ss_grpo_loss(logp[a:b], old[a:b], ref[a:b], adv[a:b], mask[a:b], beta=0.01,
                                     agg=mode, num_sequences=n, num_tokens=int(mask.sum()))
        loss.backward()
        total += loss.item()
        acc = {k: acc[k] + stats[k].item() for k in acc}
    assert total == pytest.approx(full.item(), rel=1e-10, abs=1e-12)
    assert torch.allclose(logp.grad, g_full, rtol=1e-10, atol=1e-14)
    assert acc == pytest.approx({k: v.item() for k, v in fstats.items()}, rel=1e-10, abs=1e-12)


@given(seeds, shapes)
def test_eq_L_token_mean_is_paper_formula_rescaled(seed, shape):
    """DEFAULT_AGG = token_mean equals the paper's (1/n) sum sum times n / N_tokens."""
    logp, old, ref, adv, mask = batch(seed, *shape)
    paper, _ = S.ss_grpo_loss(logp, old, ref, adv, mask, agg="paper")
    tok, _ = S.ss_grpo_loss(logp, old, ref, adv, mask, agg="token_mean")
    (gp,) = torch.autograd.grad(paper, logp)
    (gt,) = torch.autograd.grad(tok, logp)
    scale = shape[0] / mask.sum().item()
    assert tok.item() == pytest.approx(paper.item() * scale, rel=1e-10, abs=1e-14)
    assert torch.allclose(gt, gp * scale, rtol=1e-10, atol=1e-14)
    assert S.DEFAULT_AGG == "token_mean" and S.DEFAULT_STD == "sample" and S.DEFAULT_EPS == 1e-6


def test_aggregate_argument_errors_and_empty_mask():
    x, m = torch.ones(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="unknown aggregation mode"):
        S.aggregate(x, m, "dr_grpo")
    with pytest.raises(ValueError, match="num_tokens must be > 0"):
        S.aggregate(x, m, "token_mean", num_tokens=0)
    with pytest.raises(ValueError, match="one shape"):
        S.aggregate(x, torch.ones(2, 4), "paper")
    for mode in MODES:
        assert S.aggregate(torch.full((2, 3), NAN), torch.zeros(2, 3), mode).item() == 0.0
    with pytest.raises(ValueError, match="ref_logp is required"):
        S.ss_grpo_loss(x, x, None, x, m, beta=0.1)
    with pytest.raises(ValueError, match="eta"):
        S.clipped_surrogate(x, x, x, eta=1.5)


# ----------------------------------------------------------------------------- K = 1: GRPO
def grpo_reference_loss(r, logp, old, ref, mask, eta, beta, eps, ddof, mode):
    """GRPO from its published formulas (DeepSeekMath; PPO-clip; Schulman's k3), written without
    ss_grpo: A_i = (r_i - mean r)/(std r + eps) on every token of rollout i."""
    rn = r.numpy()
    A = torch.tensor((rn - rn.mean()) / (rn.std(ddof=ddof) + eps), dtype=logp.dtype)[:, None]
    ratio = torch.exp(logp - old)
    surr = -torch.min(ratio * A, torch.clamp(ratio, 1 - eta, 1 + eta) * A)
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    m = mask.to(logp.dtype)
    per_tok = (surr + beta * kl) * m
    if mode == "paper":
        return per_tok.sum() / len(r)
    if mode == "token_mean":
        return per_tok.sum() / m.sum()
    return (per_tok.sum(1) / m.sum(1)).mean()


@given(scores(k=1, min_n=2), seeds, st.integers(1, 7), st.sampled_from(MODES),
       st.sampled_from(S.STD_MODES), st.sampled_from([1e-6, 1e-2]), st.floats(0.001, 0.5))
def test_K1_ss_grpo_reduces_to_grpo(R, seed, T, mode, std, eps, beta):
    n = R.shape[0]
    logp, old, ref, _, mask = batch(seed, n, T, spread=0.4)
    G, missing = S.stage_returns(R, [[1.0]])
    A = S.group_advantages(G, std=std, eps=eps, missing=missing)
    adv_tok = S.token_advantages(A, torch.zeros(n, T, dtype=torch.long), mask)
    loss, _ = S.ss_grpo_loss(logp, old, ref, adv_tok, mask, eta=0.2, beta=beta, agg=mode)
    want = grpo_reference_loss(R[:, 0], logp, old, ref, mask, 0.2, beta, eps,
                               1 if std == "sample" else 0, mode)
    (g1,) = torch.autograd.grad(loss, logp)
    (g2,) = torch.autograd.grad(want, logp)
    assert loss.item() == pytest.approx(want.item(), rel=1e-9, abs=1e-9)
    assert torch.allclose(g1, g2, rtol=1e-8, atol=1e-9)
    # the flat baseline with K = 1 is the same GRPO advantage
    assert torch.allclose(S.flat_advantages(R[:, 0], 1, std=std, eps=eps), A)

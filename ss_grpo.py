"""Stage-Structured GRPO ("SS-GRPO") from "RubricEM: Meta-RL with Rubric-guided Policy
Decomposition beyond Verifiable Rewards" (arXiv 2605.10899).

Implements §3.3 (stage returns, stagewise group normalisation, token-level clipped loss with a
k3 KL penalty) and, as an executable statement, Theorem 1 of §3.2 (stage information).

Glossary (paper symbols -> names here)
    n            rollouts of one query (a GRPO group); rows of R, G, A
    K            stages, 4 in the paper: Plan, Research, Review, Answer (STAGE_NAMES)
    R[i, k]      judge score in [0, 1] of rollout i's stage k against its rubrics; NaN = missing
    Lambda[k, j] causal stage-dependence weight (upper triangular, unit diagonal); `lam`
    G[i, k]      stage return of rollout i at stage k
    A[i, k]      stagewise group-normalised advantage
    B_{i,k}      token block of rollout i in stage k; here `stage_ids[i, t] == k`
    rho[i, t]    pi_theta / pi_theta_old on token t, from log-probs `logp`, `old_logp`
    eta, beta    PPO clip range and KL coefficient; T: padded token length

Equations and the function computing each
    Eq. G = R Lambda^T, G[i,k] = sum_{j>=k} Lambda[k,j] R[i,j]         stage_returns
    Eq. A[i,k] = (G[i,k] - mean_i' G[i',k]) / (Std_i' G[i',k] + eps)   group_advantages(_batched)
    Eq. A_tok[i,t] = A[i,k] for t in B_{i,k}                            token_advantages
    (ours, option) A_tok[i,t*] = A[i,k] for the token t* that skipped k  skipped_stage_credit
    Eq. -min(rho A, clip(rho, 1-eta, 1+eta) A)                          clipped_surrogate
    Eq. k3 = exp(ref - logp) - (ref - logp) - 1                         kl_k3
    Eq. L = -(1/n) sum_i sum_k sum_{t in B_ik} min(...) + beta D_KL     ss_grpo_loss (+ aggregate)
    Baseline RL of the ablations (one terminal score broadcast)        flat_advantages
    Theorem 1: V_stage >= V_flat, strict under aliasing                 theorem1_values/_condition

Aggregation. The paper's formula sums each rollout's masked per-token terms and divides by n:
`aggregate(..., mode="paper")`. The presets use DEFAULT_AGG = "token_mean" (divide the same sum by
the number of masked tokens). Within one batch the two differ by the constant factor N_tokens / n,
so they give the same gradient direction; "token_mean" only removes the dependence of the step size
on response length, which would otherwise make one learning rate wrong for both the toy preset
(tens of tokens) and the full one (up to 18,432 tokens). "seq_mean_token_mean" (original GRPO) is
offered for comparison; it weights short responses' tokens more, a length bias we avoid by default.

Deviations from the paper
    1. Missing judge scores (NaN in R) do not occur in the paper. We impute R[i,j] with the group's
       NaN-aware mean of column j (0 if the whole column is missing) before G = R Lambda^T; the
       imputed term equals its column's mean, so centring removes it from A[i, k<j] (no signal);
       the cell (i, j) itself is left out of stage j's mean/std and gets A[i, j] = 0 exactly.
    2. Std convention: the paper writes "Std" without saying which; we default to the sample std
       (n - 1), as torch.std and the GRPO code of TRL and verl do; "population" is available.
    3. eps = 1e-6 sits outside the square root, as in the paper's formula (verl's default value).
       A stage whose (non-missing) returns are all equal, or that has fewer than two of them, gets
       A = 0 exactly: the exact formula gives 0/(0 + eps), but floating-point means of equal values
       need not be exact, so we detect equality explicitly instead of trusting eps.
    4. The paper writes beta * D_KL(pi_theta || pi_ref); we use the per-token k3 estimator (the
       appendix names "k3") inside the loss, aggregated with the same mode as the surrogate.
    5. Log-ratios are clamped to +-LOG_RATIO_CLAMP = 80 before exp in rho and k3. Within that range
       (exp(80) ~ 5.5e34 is finite in float32) everything is exact; beyond it float32 would overflow
       to inf. A tighter clamp (verl uses 20) would silently zero the KL gradient of exactly the
       tokens that drifted furthest from the reference, so we only guard against overflow.
    6. Masked tokens (tool output, template glue, prompt, padding) are removed with torch.where on
       the inputs as well as the outputs, so garbage (NaN/inf) log-probs under the mask give exactly
       zero loss and zero gradient; the paper only says tool-output tokens get no gradient.
    7. Option, off by default (`ss_grpo.skipped_stage_credit`, hparams.SSGRPOConfig): a rollout that skips a stage
       gives that stage's advantage to the token that skipped it (skipped_stage_credit,
       A_tok[i, t*] = A[i, k]); under the paper's rule no token carries a skipped stage's A[i, k].
    8. pi_theta, pi_theta_old and pi_ref in rho and k3 are the distributions that drew the tokens:
       log-probs of softmax(logits / T) at the batch's sampling temperature T
       (policy.UpdateBatch.temperature), as TRL, verl and open-instruct compute them. Task rollouts
       are sampled at T = 1 (the paper's; nothing changes); the reflection candidates at T = 0.7
       (§3.4), and the paper does not say under which distribution their GRPO group is scored.
       Scored at T = 1, a candidate drawn at 0.7 gets the gradient of a distribution it was not
       drawn from (`reflection.score_at_temperature = false` does that, for comparison).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Sequence

import numpy as np
import torch


# PAPER: Lambda of §3.3; rows k = Plan, Research, Review, Answer, columns j likewise.
PAPER_LAMBDA = [
    [1.0, 0.4, 0.6, 0.8],
    [0.0, 1.0, 0.4, 0.8],
    [0.0, 0.0, 1.0, 0.8],
    [0.0, 0.0, 0.0, 1.0],
]
STAGE_NAMES = ("plan", "research", "review", "answer")  # = scaffold.STAGES (tests/test_paper_text.py)
STD_MODES = ("sample", "population")
AGG_MODES = ("paper", "token_mean", "seq_mean_token_mean")
DEFAULT_STD = "sample"  # not fixed by the paper; see deviation 2
DEFAULT_EPS = 1e-6  # the paper has "+ eps" but no value; verl's default
DEFAULT_AGG = "token_mean"  # the paper's formula is "paper"; see "Aggregation" above
DEFAULT_ETA = 0.2  # the paper says "PPO clipping" without a value; the usual PPO/GRPO choice
PAPER_BETA = 0.001  # PAPER: KL coefficient (appendix), k3 estimator
LOG_RATIO_CLAMP = 80.0  # deviation 5: exp(80) is finite in float32 with headroom for sums


# ----------------------------------------------------------------------------- Lambda and G
def validate_lambda(lam, expected_k: Optional[int] = None) -> torch.Tensor:
    """Check a causal stage-dependence matrix Lambda (§3.3) and return it as a float64 tensor.

    Args:
        lam: (K, K) list of lists or tensor. Required: 2-D, square, K >= 1, finite,
            Lambda[k, j] == 0 for j < k (upper triangular), Lambda[k, k] == 1.
        expected_k: if given, K must equal it (the number of stages of the scores).
    Returns:
        (K, K) float64 tensor (a copy, on lam's device if lam is a tensor).
    Raises:
        ValueError: naming the violated requirement (and the offending entry where there is one).
    """
    try:
        lam_t = torch.as_tensor(lam, dtype=torch.float64).clone()
    except (ValueError, TypeError, RuntimeError) as err:
        raise ValueError(f"Lambda must be a 2-D square matrix of numbers, could not read it: "
                         f"{err}") from err
    if lam_t.dim() != 2 or lam_t.shape[0] != lam_t.shape[1]:
        raise ValueError(f"Lambda must be a 2-D square matrix, got shape {tuple(lam_t.shape)}")
    k = lam_t.shape[0]
    if k < 1:
        raise ValueError("Lambda must have at least one stage (K >= 1), got a 0x0 matrix")
    if not torch.isfinite(lam_t).all():
        raise ValueError(f"Lambda must be finite, got {lam_t.tolist()}")
    if expected_k is not None and k != expected_k:
        raise ValueError(f"Lambda is {k}x{k} but there are {expected_k} stages")
    below = torch.tril(torch.ones(k, k, dtype=torch.bool, device=lam_t.device), diagonal=-1)
    bad = (below & (lam_t != 0)).nonzero()
    if len(bad):
        kk, jj = bad[0].tolist()
        raise ValueError(
            f"Lambda must be upper triangular (a stage's return cannot depend on earlier stages): "
            f"Lambda[{kk}, {jj}] = {lam_t[kk, jj].item()} but must be 0 for j < k")
    diag = torch.diagonal(lam_t)
    if not (diag == 1).all():
        raise ValueError(f"Lambda must have a unit diagonal (lambda_kk = 1), got {diag.tolist()}")
    return lam_t


def _group_index(n: int, group_size, group_ids, device) -> torch.Tensor:
    """(n,) int64 group index 0..B-1 from a contiguous group size, labels, or one group."""
    if group_size is not None and group_ids is not None:
        raise ValueError("give group_size or group_ids, not both")
    if group_size is not None:
        if int(group_size) < 1 or n % int(group_size) != 0:
            raise ValueError(f"{n} rows do not split into contiguous groups of {group_size}")
        return torch.arange(n, device=device) // int(group_size)
    if group_ids is not None:
        group_ids = torch.as_tensor(group_ids, device=device)
        if group_ids.shape != (n,) or group_ids.is_floating_point():
            raise ValueError(f"group_ids must be an integer tensor of shape ({n},), "
                             f"got {group_ids.dtype} {tuple(group_ids.shape)}")
        return torch.unique(group_ids, return_inverse=True)[1]
    return torch.zeros(n, dtype=torch.long, device=device)


def _dense(x: torch.Tensor, valid: torch.Tensor, gid: torch.Tensor):
    """Scatter rows (n, K) into a padded (B, g_max, K) layout by group, deterministically.

    Returns (xd, vd, rows, pos): xd float64 (B, g_max, K), vd bool (B, g_max, K) marking cells that
    exist and are valid, and the (group, position) of each original row, to gather results back.
    """
    n, k = x.shape
    num_groups = int(gid.max().item()) + 1
    order = torch.sort(gid, stable=True).indices
    counts = torch.bincount(gid, minlength=num_groups)  # (B,)
    start = torch.cumsum(counts, 0) - counts
    pos = torch.empty_like(gid)
    pos[order] = torch.arange(n, device=gid.device) - start[gid[order]]
    g_max = int(counts.max().item())
    xd = torch.zeros(num_groups, g_max, k, dtype=torch.float64, device=x.device)  # (B, g, K)
    vd = torch.zeros(num_groups, g_max, k, dtype=torch.bool, device=x.device)  # (B, g, K)
    xd[gid, pos] = x.to(torch.float64)
    vd[gid, pos] = valid
    return xd, vd, gid, pos


def _centred(xd: torch.Tensor, vd: torch.Tensor):
    """Group mean as base + offset, and each valid cell's deviation from it, over valid cells.

    base is the group minimum, so `xd - base` is exact for nearby values and the deviations
    `(xd - base) - offset` keep full relative precision even when the spread is a few ulps of the
    values (subtracting a rounded mean would not). A group of equal values gets exactly that value
    as its mean. Returns (mean (B, 1, K), dev (B, g, K)); mean 0 and dev 0 where nothing is valid.
    """
    count = vd.sum(1, keepdim=True)  # (B, 1, K)
    lo = torch.where(vd, xd, torch.inf).amin(1, keepdim=True)  # (B, 1, K)
    base = torch.where(count > 0, lo, 0.0)
    shifted = torch.where(vd, xd - base, 0.0)  # (B, g, K)
    offset = shifted.sum(1, keepdim=True) / count.clamp(min=1)
    mean = torch.where(count > 0, base + offset, 0.0)
    return mean, torch.where(vd, shifted - offset, 0.0)


def stage_returns(R: torch.Tensor, lam, *, group_size: Optional[int] = None,
                  group_ids: Optional[torch.Tensor] = None):
    """Stage returns G = R Lambda^T (§3.3), with missing judge scores imputed (deviation 1).

    Args:
        R: (n, K) float tensor of stage scores, nominally in [0, 1]; NaN marks a missing score.
            Any finite scale works (advantages are invariant to a*R + b, a > 0); +-inf is rejected.
        lam: (K, K) Lambda, list or tensor, checked by `validate_lambda(lam, expected_k=K)`.
        group_size / group_ids: how rows form GRPO groups (the imputation uses the group's own
            column mean): contiguous groups of `group_size` rows, or an (n,) integer label per row;
            neither = all rows are one group.
    Returns:
        (G, missing): G (n, K) finite, dtype of R (float32 if R is not floating point);
        missing (n, K) bool, True where R was NaN; pass it to `group_advantages(..., missing=)`.
    Raises:
        ValueError: R not 2-D or without rows, R contains +-inf, invalid Lambda or grouping.
    """
    if R.dim() != 2 or R.shape[0] < 1:
        raise ValueError(f"R must be (n, K) with n >= 1, got shape {tuple(R.shape)}")
    n, k = R.shape
    lam_t = validate_lambda(lam, expected_k=k).to(R.device)
    if torch.isinf(R).any():
        raise ValueError("R contains +-inf; use NaN for a missing judge score")
    out_dtype = R.dtype if R.is_floating_point() else torch.float32
    missing = torch.isnan(R)  # (n, K)
    gid = _group_index(n, group_size, group_ids, R.device)
    Rd, vd, rows, pos = _dense(R, ~missing, gid)
    col_mean = _centred(Rd, vd)[0].expand_as(Rd)[rows, pos]  # (n, K) group mean of each column
    R64 = torch.where(missing, col_mean, R.to(torch.float64))  # (n, K) imputed scores
    G = torch.zeros(n, k, dtype=torch.float64, device=R.device)  # (n, K)
    # We accumulate column by column instead of a matmul: every row then follows the same
    # floating-point path, so identical rows give bit-identical returns.
    for j in range(k):
        # Eq.: G[i,k] = sum_{j>=k} Lambda[k,j] R[i,j]   (G = R Lambda^T; Lambda[k,j] = 0 for j<k)
        G = G + R64[:, j:j + 1] * lam_t[:, j]
    return G.to(out_dtype), missing


# ----------------------------------------------------------------------------- advantages
def group_advantages_batched(G: torch.Tensor, *, group_size: Optional[int] = None,
                             group_ids: Optional[torch.Tensor] = None, std: str = DEFAULT_STD,
                             eps: float = DEFAULT_EPS,
                             missing: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Stagewise group normalisation (§3.3) for a batch of many groups at once.

    Each column k of each group is normalised over that group's non-missing rows:
    A[i,k] = (G[i,k] - mean G[:,k]) / (Std G[:,k] + eps). A cell is missing where `missing` is True
    or G is NaN; missing cells get A = 0 and are left out of the mean and std. A column of a group
    with fewer than two non-missing values, or whose non-missing values are all equal, gets A = 0
    exactly. Never returns NaN or inf; |A| <= sqrt(m) for a group with m non-missing values.

    Args:
        G: (n_total, K) float tensor of stage returns (rows of all groups).
        group_size / group_ids: contiguous groups of `group_size` rows, or an (n_total,) integer
            label per row (any order); neither = one group.
        std: "sample" (divide by m - 1, the default) or "population" (divide by m).
        eps: >= 0, added to the std outside the square root (as in the paper).
        missing: optional (n_total, K) bool mask from `stage_returns`.
    Returns:
        A: (n_total, K), dtype of G (float32 if G is not floating point), no gradient.
    Raises:
        ValueError: G not 2-D, empty or containing +-inf, bad std mode, eps < 0 or not finite,
            missing of the wrong shape, invalid grouping.
    """
    if G.dim() != 2 or G.shape[0] < 1 or G.shape[1] < 1:
        raise ValueError(f"G must be (n, K) with n, K >= 1, got shape {tuple(G.shape)}")
    if std not in STD_MODES:
        raise ValueError(f"std must be one of {STD_MODES}, got {std!r}")
    if not (eps >= 0 and eps < float("inf")):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    if torch.isinf(G).any():
        raise ValueError("G contains +-inf")
    out_dtype = G.dtype if G.is_floating_point() else torch.float32
    miss = torch.isnan(G)
    if missing is not None:
        if missing.shape != G.shape:
            raise ValueError(f"missing must have G's shape {tuple(G.shape)}, "
                             f"got {tuple(missing.shape)}")
        miss = miss | missing.to(device=G.device, dtype=torch.bool)
    gid = _group_index(G.shape[0], group_size, group_ids, G.device)
    with torch.no_grad():
        Gd, vd, rows, pos = _dense(G.detach(), ~miss, gid)  # (B, g, K)
        count = vd.sum(1, keepdim=True)  # (B, 1, K)
        lo = torch.where(vd, Gd, torch.inf).amin(1, keepdim=True)
        hi = torch.where(vd, Gd, -torch.inf).amax(1, keepdim=True)
        # Equal values (or < 2 of them) carry no ranking signal: exactly 0, whatever eps is.
        flat = (count < 2) | (hi == lo)  # (B, 1, K)
        _, dev = _centred(Gd, vd)  # (B, g, K) G[i,k] - mean_i' G[i',k]
        ddof = 1 if std == "sample" else 0  # the paper writes "Std"; convention ours (dev. 2)
        var = (dev * dev).sum(1, keepdim=True) / (count - ddof).clamp(min=1)
        denom = var.sqrt() + eps
        # Eq.: A[i,k] = (G[i,k] - mean_i' G[i',k]) / (Std_i' G[i',k] + eps)
        safe = denom.clamp(min=torch.finfo(torch.float64).tiny)  # only read where denom > 0
        A = torch.where(vd & ~flat & (denom > 0), dev / safe, 0.0)
        return A[rows, pos].to(out_dtype)  # (n_total, K)


def group_advantages(G: torch.Tensor, std: str = DEFAULT_STD, eps: float = DEFAULT_EPS,
                     missing: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Stagewise group normalisation (§3.3) over the n rollouts of ONE query.

    A[i,k] = (G[i,k] - mean_i' G[i',k]) / (Std_i' G[i',k] + eps); see `group_advantages_batched`
    for the handling of missing cells, constant columns and n = 1 (all give A = 0 exactly).

    Args:
        G: (n, K) float tensor, one group. std: "sample" | "population". eps: >= 0.
        missing: optional (n, K) bool mask (True = missing judge score).
    Returns:
        A: (n, K), dtype of G (float32 if G is not floating point), finite, no gradient.
    Raises:
        ValueError: as `group_advantages_batched`.
    """
    return group_advantages_batched(G, std=std, eps=eps, missing=missing)


def flat_advantages(r: torch.Tensor, num_stages: int = len(STAGE_NAMES), *, std: str = DEFAULT_STD,
                    eps: float = DEFAULT_EPS, group_size: Optional[int] = None,
                    group_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Baseline RL of the ablations (§3.3, "Baseline RL"): plain GRPO on one terminal score.

    A_i = (r_i - mean r) / (Std r + eps) over the group, broadcast to all K stages (K = 1 GRPO).
    A NaN score makes the whole row 0.

    Args:
        r: (n,) float tensor of terminal scores. num_stages: K >= 1 columns of the output.
        std, eps, group_size, group_ids: as `group_advantages_batched`.
    Returns:
        (n, K) advantages, every column equal; dtype of r (float32 if not floating point).
    Raises:
        ValueError: r not 1-D or empty, num_stages < 1, or as `group_advantages_batched`.
    """
    if r.dim() != 1 or r.shape[0] < 1:
        raise ValueError(f"r must be (n,) with n >= 1, got shape {tuple(r.shape)}")
    if int(num_stages) < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    # Eq.: A_i = (r_i - mean r) / (Std r + eps), the same for every stage
    a = group_advantages_batched(r[:, None], group_size=group_size, group_ids=group_ids,
                                 std=std, eps=eps)  # (n, 1)
    return a.expand(-1, int(num_stages)).clone()  # (n, K)


def token_advantages(A: torch.Tensor, stage_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give every token of block B_{i,k} the advantage A[i,k] (§3.3).

    Args:
        A: (n, K) float stage advantages.
        stage_ids: (n, T) integer tensor, values in {0..K-1}, or -1 for prompt/padding.
        mask: (n, T) bool or {0, 1} tensor; 0 on tool-output tokens, template glue and padding.
    Returns:
        (n, T) tensor of A's dtype: A[i, stage_ids[i,t]] where mask == 1 and stage_ids >= 0, else 0.
    Raises:
        ValueError: wrong dims or shapes, non-integer stage_ids or values outside [-1, K-1],
            mask values other than 0/1.
    """
    if A.dim() != 2 or stage_ids.dim() != 2:
        raise ValueError(f"A must be (n, K) and stage_ids (n, T), got {tuple(A.shape)} and "
                         f"{tuple(stage_ids.shape)}")
    n, k = A.shape
    if stage_ids.shape[0] != n or mask.shape != stage_ids.shape:
        raise ValueError(f"stage_ids and mask must both be ({n}, T), got {tuple(stage_ids.shape)} "
                         f"and {tuple(mask.shape)}")
    if stage_ids.is_floating_point() or stage_ids.dtype == torch.bool:
        raise ValueError(f"stage_ids must be an integer tensor, got {stage_ids.dtype}")
    if stage_ids.numel() and (stage_ids.min() < -1 or stage_ids.max() >= k):
        raise ValueError(f"stage_ids must lie in [-1, {k - 1}], got values in "
                         f"[{stage_ids.min().item()}, {stage_ids.max().item()}]")
    m = _bool_mask(mask)
    # Eq.: A_tok[i,t] = A[i,k] for t in B_{i,k}
    gathered = torch.gather(A, 1, stage_ids.clamp(min=0).long())  # (n, T)
    zero = torch.zeros((), dtype=A.dtype, device=A.device)
    return torch.where(m & (stage_ids >= 0), gathered, zero)


def skipping_token(stage_ids: torch.Tensor, mask: torch.Tensor,
                   has_stage: Sequence[bool]) -> tuple[int, int, int] | None:
    """The token that skipped a stage, for one rollout: (k, j, t) with k the first stage without a
    block, j the next stage whose block is present and t the index of that block's first
    loss-masked token (the tag written where stage k's was due), or None when no stage is missing
    before a present one or that block has no loss-masked token.

    stage_ids: (T,) int64, -1 outside the response; mask: (T,) {0, 1}; has_stage: K bools
    (ParsedResponse.has_stage). Not in the paper (see skipped_stage_credit).
    """
    for k, present in enumerate(has_stage):
        if present:
            continue
        later = [j for j in range(k + 1, len(has_stage)) if has_stage[j]]
        if not later:
            return None
        hit = ((stage_ids == later[0]) & (mask > 0)).nonzero()
        return (k, later[0], int(hit[0])) if hit.numel() else None
    return None


def skipped_stage_credit(adv: torch.Tensor, A: torch.Tensor, stage_ids: torch.Tensor,
                         mask: torch.Tensor, has_stage: Sequence[bool]) -> torch.Tensor:
    """Not in the paper (option `ss_grpo.skipped_stage_credit`, deviation 7): a rollout that skips
    stage k (no block B_{i,k}, e.g. <answer> written where <review> was due) has an advantage A[i,k]
    that no token carries under §3.3's rule, so nothing discourages the skip itself. This gives
    A[i,k] of the first skipped stage to the token that skipped it (`skipping_token`: the first
    loss-masked token of the next stage block present).

    Args:
        adv: (T,) float per-token advantages of one rollout (token_advantages' row).
        A: (K,) float its stage advantages. stage_ids: (T,) int64, -1 outside the response.
        mask: (T,) {0, 1} loss mask. has_stage: K bools (ParsedResponse.has_stage).
    Returns:
        (T,) a copy of adv, changed at one position at most (none when no stage is skipped before
        a present one). Raises ValueError when the lengths of has_stage and A differ.
    """
    if len(has_stage) != A.shape[0]:
        raise ValueError(f"has_stage has {len(has_stage)} entries for {A.shape[0]} stages")
    out = adv.clone()
    skip = skipping_token(stage_ids, mask, has_stage)
    if skip is not None:
        k, _, t = skip
        # A_tok[i, t*] = A[i, k], t* = the first token of the next block present
        out[t] = A[k]
    return out


# ----------------------------------------------------------------------------- per-token terms
def _bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """(n, T) bool view of a {0, 1} mask; rejects other values."""
    if mask.dtype == torch.bool:
        return mask
    if not ((mask == 0) | (mask == 1)).all():
        raise ValueError("mask must contain only 0 and 1")
    return mask != 0


def _check_same_shape(**tensors) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1 or any(len(s) != 2 for s in shapes.values()):
        raise ValueError(f"expected (n, T) tensors of one shape, got {shapes}")


def _clean(x: torch.Tensor, m: Optional[torch.Tensor]) -> torch.Tensor:
    """Replace values under the mask by 0 with torch.where, so garbage there (NaN/inf) can reach
    neither the value nor, through 0 * inf, the gradient (deviation 6)."""
    return x if m is None else torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                      eta: float = DEFAULT_ETA, mask: Optional[torch.Tensor] = None):
    """Per-token PPO-clip loss of §3.3: -min(rho A, clip(rho, 1 - eta, 1 + eta) A).

    rho = exp(logp - old_logp), with the log-ratio clamped to +-LOG_RATIO_CLAMP (deviation 5).
    Gradient flows through `logp` only; `old_logp` and `adv` are treated as constants.

    Args:
        logp, old_logp, adv: (n, T) float tensors (token log-probs under pi_theta, pi_theta_old;
            token advantages). eta: clip range, 0 < eta < 1.
        mask: optional (n, T) bool/{0,1}; where 0 the inputs are ignored (may be NaN/inf) and the
            outputs are 0 / False.
    Returns:
        (loss, clipped): loss (n, T) in logp's dtype; clipped (n, T) bool, True where the clipped
        branch is active and the token gets no gradient (A > 0, rho > 1 + eta or A < 0,
        rho < 1 - eta); its masked mean is the "clip fraction".
    Raises:
        ValueError: shapes differ or are not 2-D; eta outside (0, 1); bad mask values.
    """
    _check_same_shape(logp=logp, old_logp=old_logp, adv=adv, mask=mask)
    if not 0 < eta < 1:
        raise ValueError(f"eta must be in (0, 1), got {eta}")
    m = None if mask is None else _bool_mask(mask)
    logp, old_logp, adv = _clean(logp, m), _clean(old_logp.detach(), m), _clean(adv.detach(), m)
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rho = torch.exp(log_ratio)  # (n, T)
    # Eq.: l[i,t] = -min(rho A, clip(rho, 1-eta, 1+eta) A)
    loss = -torch.minimum(rho * adv, torch.clamp(rho, 1 - eta, 1 + eta) * adv)  # PAPER: PPO clip
    clipped = ((adv > 0) & (rho > 1 + eta)) | ((adv < 0) & (rho < 1 - eta))
    if m is not None:
        loss, clipped = _clean(loss, m), clipped & m
    return loss, clipped


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor,
          mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi_theta || pi_ref) (appendix: "k3"; Schulman's estimator).

    k3 = exp(d) - d - 1 with d = ref_logp - logp, computed as expm1(d) - d for accuracy near d = 0;
    unbiased for tokens sampled from pi_theta, and >= 0 with equality iff d = 0. d is clamped to
    +-LOG_RATIO_CLAMP (deviation 5), so value and gradient stay finite in float32 for any finite
    input and are exact for |d| <= 80. Gradient flows through `logp` only.

    Args:
        logp, ref_logp: (n, T) float tensors. mask: optional (n, T) bool/{0,1}; 0 -> output 0.
    Returns:
        (n, T) tensor of logp's dtype, >= 0.
    Raises:
        ValueError: shapes differ or are not 2-D; bad mask values.
    """
    _check_same_shape(logp=logp, ref_logp=ref_logp, mask=mask)
    m = None if mask is None else _bool_mask(mask)
    logp, ref_logp = _clean(logp, m), _clean(ref_logp.detach(), m)
    d = torch.clamp(ref_logp - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    # Eq.: k3 = exp(ref - logp) - (ref - logp) - 1   (>= 0; rounding could dip below, so clamp)
    k3 = torch.clamp_min(torch.expm1(d) - d, 0.0)
    return _clean(k3, m)


# ----------------------------------------------------------------------------- aggregation + loss
def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str = DEFAULT_AGG,
              num_sequences: Optional[float] = None,
              num_tokens: Optional[float] = None) -> torch.Tensor:
    """Reduce (n, T) per-token terms to a scalar over masked tokens (the normaliser of §3.3's L).

    "paper":  sum_i sum_{t: mask} x[i,t] / n            (the paper's -(1/n) sum_i sum_k sum_t;
              verl "seq-mean-token-sum"; TRL "dr_grpo" divides by n * max_len instead)
    "token_mean":  sum_i sum_{t: mask} x[i,t] / N_tok   (TRL "dapo"/"bnpo", verl "token-mean")
    "seq_mean_token_mean":  (1/n) sum_i mean_{t: mask} x[i,t]   (TRL "grpo", verl
              "seq-mean-token-mean"); a sequence with no masked token contributes 0.
    For gradient accumulation pass the FULL batch's n as `num_sequences` and its number of masked
    tokens as `num_tokens`: the sum of micro-batch results then equals the full-batch result, in
    value and gradient. The normaliser a mode does not use is ignored.

    Args:
        per_token: (n, T) float tensor; values under mask == 0 are ignored (may be NaN/inf).
        mask: (n, T) bool/{0,1}. mode: one of AGG_MODES.
        num_sequences, num_tokens: optional positive global normalisers (default: this batch's).
    Returns:
        0-dim tensor of per_token's dtype (0 when there are no masked tokens).
    Raises:
        ValueError: unknown mode, shape mismatch, bad mask values, non-positive normaliser.
    """
    _check_same_shape(per_token=per_token, mask=mask)
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {AGG_MODES}")
    for name, v in (("num_sequences", num_sequences), ("num_tokens", num_tokens)):
        if v is not None and not float(v) > 0:
            raise ValueError(f"{name} must be > 0, got {v}")
    m = _bool_mask(mask)
    x = _clean(per_token, m)
    n_seq = float(num_sequences) if num_sequences is not None else float(per_token.shape[0])
    if mode == "paper":
        # Eq.: (1/n) sum_i sum_{t in B_i} l[i,t]   # PAPER: the §3.3 loss normaliser
        return x.sum() / max(n_seq, 1.0)
    if mode == "token_mean":
        n_tok = num_tokens if num_tokens is not None else m.sum().clamp(min=1)
        # Eq.: sum_i sum_{t in B_i} l[i,t] / sum_i |B_i|
        return x.sum() / n_tok
    per_seq = x.sum(1) / m.sum(1).clamp(min=1)  # (n,)
    # Eq.: (1/n) sum_i (1/|B_i|) sum_{t in B_i} l[i,t]
    return per_seq.sum() / max(n_seq, 1.0)


def ss_grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: Optional[torch.Tensor],
                 adv_tok: torch.Tensor, mask: torch.Tensor, eta: float = DEFAULT_ETA,
                 beta: float = PAPER_BETA, agg: str = DEFAULT_AGG,
                 num_sequences: Optional[float] = None, num_tokens: Optional[float] = None):
    """SS-GRPO loss (§3.3): L = aggregate(clipped surrogate) + beta * aggregate(k3 KL).

    The KL enters with a + sign: minimising L lowers KL(pi_theta || pi_ref). Tokens with mask == 0
    contribute exactly zero loss and zero gradient, even if their inputs are NaN/inf.

    Args:
        logp: (n, T) float log-probs of the sampled tokens under pi_theta (requires grad).
        old_logp, ref_logp: (n, T) under pi_theta_old and pi_ref (constants); ref_logp may be None
            only when beta == 0.
        adv_tok: (n, T) token advantages (`token_advantages`). mask: (n, T) bool/{0,1}.
        eta: clip range in (0, 1). beta: KL coefficient >= 0 (paper: 0.001).
        agg: aggregation mode (`aggregate`); num_sequences, num_tokens: global normalisers for
            gradient accumulation.
    Returns:
        (loss, stats): loss 0-dim tensor (logp's dtype) with gradient; stats dict of detached 0-dim
        tensors "loss/total", "loss/policy", "kl" (aggregated like the loss) and "clip_frac"
        (clipped masked tokens / num_tokens or this batch's masked tokens). With the global
        normalisers every entry sums over micro-batches to its full-batch value.
    Raises:
        ValueError: shape mismatch, eta outside (0, 1), beta < 0, ref_logp None with beta > 0,
            bad mask, unknown agg, non-positive normaliser.
    """
    if not beta >= 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if ref_logp is None and beta > 0:
        raise ValueError("ref_logp is required when beta > 0")
    m = _bool_mask(mask)
    per_tok, clipped = clipped_surrogate(logp, old_logp, adv_tok, eta=eta, mask=m)
    pg = aggregate(per_tok, m, agg, num_sequences, num_tokens)
    if ref_logp is not None:
        kl = aggregate(kl_k3(logp, ref_logp, mask=m), m, agg, num_sequences, num_tokens)
    else:
        kl = torch.zeros((), dtype=pg.dtype, device=pg.device)
    # Eq.: L = -(1/n) sum_i sum_k sum_{t in B_ik} min(rho A, clip(rho) A) + beta * D_KL
    loss = pg + beta * kl
    n_tok = num_tokens if num_tokens is not None else m.sum().clamp(min=1)
    stats = {
        "loss/total": loss.detach(),
        "loss/policy": pg.detach(),
        "kl": kl.detach(),
        "clip_frac": (clipped.sum().to(pg.dtype) / n_tok).detach(),
    }
    return loss, stats


# ----------------------------------------------------------------------------- Theorem 1 (§3.2)
def _theorem1_tables(p, phi, z, U):
    """Exact tables Q[c][z][a] = sum_{h: phi(h)=c, z(h)=z} P(h) U(h, a), and P(c, z)."""
    if not (len(p) == len(phi) == len(z) == len(U)) or len(p) == 0:
        raise ValueError("p, phi, z and U must be non-empty and of equal length (one per h)")
    n_actions = len(U[0])
    if n_actions == 0 or any(len(row) != n_actions for row in U):
        raise ValueError("U must be a non-empty table with the same number of actions per h")
    p = [Fraction(x) for x in p]
    if any(x < 0 for x in p) or sum(p) == 0:
        raise ValueError("p must be nonnegative weights with a positive sum")
    total = sum(p)
    q = {}
    for ph, c, s, row in zip(p, phi, z, U):
        cell = q.setdefault(c, {}).setdefault(s, [Fraction(0)] * n_actions)
        for a, u in enumerate(row):
            cell[a] += ph / total * Fraction(u)
    mass = {c: {s: sum(p_ for p_, c_, s_ in zip(p, phi, z) if c_ == c and s_ == s) / total
                for s in q[c]} for c in q}
    return q, mass, n_actions


def theorem1_values(p: Sequence, phi: Sequence, z: Sequence, U: Sequence[Sequence]):
    """Flat and stage-aware decision values of Theorem 1 (§3.2), computed exactly.

    Decision points h = 0..H-1 have probability p[h] / sum(p), compressed state c = phi[h], stage
    label z[h] and expected downstream value U[h][a] for action a.
        V_flat  = E_c     [ max_a E[U(h, a) | c] ]
        V_stage = E_{c,z} [ max_a E[U(h, a) | c, z] ]
    Theorem 1: V_stage >= V_flat always (a max of sums <= the sum of maxes), strictly when
    `theorem1_condition` holds (perceptual aliasing resolved by the stage label).

    Args:
        p: H nonnegative weights (int, Fraction or float; floats are converted exactly).
        phi, z: H hashable labels. U: H rows of A numbers each.
    Returns:
        (V_flat, V_stage) as fractions.Fraction (exact rational arithmetic; float() to print).
    Raises:
        ValueError: length mismatch, empty or ragged U, negative weights or zero total weight.
    """
    q, _, n_actions = _theorem1_tables(p, phi, z, U)
    # Eq.: V_flat = sum_c P(c) max_a E[U|c] = sum_c max_a sum_z P(c,z) E[U|c,z]
    v_flat = sum(max(sum(q[c][s][a] for s in q[c]) for a in range(n_actions)) for c in q)
    # Eq.: V_stage = sum_{c,z} P(c,z) max_a E[U|c,z]
    v_stage = sum(max(q[c][s]) for c in q for s in q[c])
    return v_flat, v_stage


def theorem1_condition(p: Sequence, phi: Sequence, z: Sequence, U: Sequence[Sequence]) -> bool:
    """The sufficient condition of Theorem 1 (§3.2) for V_stage > V_flat.

    True iff some compressed state c has positive probability and two stage labels z != z' both
    have positive probability given c while their arg-max action sets of E[U | c, z] are disjoint.
    Arguments and errors as `theorem1_values`.
    """
    q, mass, _ = _theorem1_tables(p, phi, z, U)
    for c in q:
        best = [{a for a, v in enumerate(q[c][s]) if v == max(q[c][s])}
                for s in q[c] if mass[c][s] > 0]
        if any(not (best[i] & best[j]) for i in range(len(best)) for j in range(i + 1, len(best))):
            return True
    return False

# ----------------------------------------------------------------------------------------------------
# Advantages of the ablation arms (§3.3 and the paper's "Baseline RL" ablation)


def terminal_answer(R: torch.Tensor) -> torch.Tensor:
    """Baseline RL's terminal score (§3.3, ablations): r_i = R_{i,Answer}. R (N, 4) -> (N,), NaN kept."""
    return R[:, STAGE_NAMES.index("answer")]


def terminal_mean(R: torch.Tensor) -> torch.Tensor:
    """The information-matched terminal score (not in the paper): r_i = (1/4) sum_k R_{i,k}.
    R (N, 4) -> (N,); NaN (missing) if any stage is missing, so that rollout gets advantage 0."""
    # Eq.: r_i = mean_k R_{i,k}
    return R.mean(1)


TERMINAL_SCORES = {"terminal_answer": terminal_answer, "terminal_mean": terminal_mean}


def task_advantages(R: np.ndarray, n: int, cfg, kind: str = "ss_grpo"
                    ) -> tuple[torch.Tensor, dict]:
    """(N, 4) float32 advantages for N = groups x n rollouts from stage scores R (N, 4), NaN =
    missing, and the logged frac_zero_std_groups. kind (Arm.advantage): "ss_grpo" (§3.3 stagewise) or
    a key of TERMINAL_SCORES (one terminal score, GRPO-normalised per group, broadcast to all stages).
    Raises ValueError for an unknown kind."""
    Rt = torch.from_numpy(R).to(torch.float64)
    if kind == "ss_grpo":
        # Eq.: G = R Lambda^T, then A[i,k] = (G[i,k] - mean G[:,k]) / (Std G[:,k] + eps) per group
        G, missing = stage_returns(Rt, cfg.lam, group_size=n)
        A = group_advantages_batched(G, group_size=n, std=cfg.std, eps=cfg.eps,
                                             missing=missing)
    elif kind in TERMINAL_SCORES:
        r = TERMINAL_SCORES[kind](Rt)  # (N,)
        # Eq.: A_i = (r_i - mean r) / (Std r + eps), the same for every stage of rollout i
        A = flat_advantages(r, len(STAGE_NAMES), std=cfg.std, eps=cfg.eps, group_size=n)
        G = r[:, None].repeat(1, len(STAGE_NAMES))
    else:
        raise ValueError(f"unknown advantage kind {kind!r}; expected 'ss_grpo' or one of "
                         f"{tuple(TERMINAL_SCORES)}")
    Gg = G.reshape(-1, n, G.shape[1])  # (groups, n, K)
    zero_std = ((Gg.max(1).values - Gg.min(1).values) == 0).double().mean().item()
    return A.float(), {"frac_zero_std_groups": zero_std}


# ----------------------------------------------------------------------------------------------------
# Ablation arms (paper, "Ablation: RL training recipes": 600 steps from the same SFT checkpoint)


@dataclass(frozen=True)
class Arm:
    """What one ablation arm turns on. advantage: "ss_grpo" (stagewise, G = R Lambda^T, §3.3),
    "terminal_answer" (one terminal score, R_{i,Answer}, broadcast to every token) or
    "terminal_mean" (the mean of the four stage scores, broadcast); reflection: the reflection
    meta-policy branch, its bank upserts and its deferred GRPO update (§3.4); bank: rubric-bank
    retrieval into the rollout prompts (§3.5)."""

    advantage: str
    reflection: bool
    bank: bool
    reward: str = "judge"
    """"judge": R from the evolving judge (§3.4); "static": R = the toy judge's static stage scores,
    the ground truth (the reward ladder's oracle rungs; not in the paper; toy judge only)"""


ARMS = {
    "rubricem": Arm("ss_grpo", reflection=True, bank=True),  # PAPER: full RubricEM
    "ss_grpo": Arm("ss_grpo", reflection=False, bank=False),  # PAPER: "SS-GRPO" alone
    "meta_policy": Arm("terminal_answer", reflection=True, bank=True),  # PAPER: "Meta-Policy" alone
    "baseline_rl": Arm("terminal_answer", reflection=False, bank=False),  # PAPER: "Baseline RL", one
    # terminal rubric score broadcast to all tokens
    "baseline_rl_info": Arm("terminal_mean", reflection=False, bank=False),  # not in the paper: Baseline
    # RL matched in judge information (its terminal score averages all four stage scores, so it sees
    # what SS-GRPO sees, minus the stage-wise credit assignment)
    # The reward ladder (not in the paper; toy judge only): the same updates on ground-truth rewards.
    "oracle": Arm("terminal_answer", reflection=False, bank=False, reward="static"),  # flat GRPO on
    # the static Answer score
    "stage_oracle": Arm("ss_grpo", reflection=False, bank=False, reward="static"),  # SS-GRPO on the
    # static stage scores
}

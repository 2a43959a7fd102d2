"""The paper's constants against the paper's own words, and the per-query advantage at the training
call site.

RubricEM (arXiv 2605.10899). The quotations below are copied literally from the paper notes the
project was written from (their Chinese text is theirs); each test parses the quotation and compares
it with the code, so a constant edited in the code, or a misread of the text, fails here rather than
being compared with itself.
"""
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from backends.run import config as settings

from backends.run import presets
import ss_grpo
import train
from judge import BUFFER_CAPS, JudgeResult
from scaffold import STAGES, Rollout

# §3.3, the matrix used in the experiments, as the notes print it (flattened; "000" is three zeros).
PRINTED_LAMBDA = "Λ = 1.0 000 0.4 1.0 00 0.6 0.4 1.0 0 0.8 0.8 0.8 1.0 ."
# §3.3, the definition the matrix must satisfy.
LAMBDA_DEFINITION = ("SS-GRPO 不把终局分数广播到所有 token，而是定义一个 causal stage-dependence matrix "
                     "$Λ = (λ_{k, j})$ ，其中 $λ_{k, j} = 0$ for $j < k$ 且 $λ_{k, k} = 1$ ，并计算 stage return：")
STAGE_RETURN = "G_{i, k}^{Λ} = j = k \\sum K λ_{k, j} R_{i, j} ."
# Implementation details: the buffer caps, in prose and in the pseudocode of Algorithm 1.
CAPS_PROSE = "rubric buffer cap per stage = 3, 2, 2, 3"
CAPS_CODE = "judge, q, rollouts, active_buffers.get(q, init_stage_buffers()), caps=[3, 2, 2, 3]"
STAGE_ORDER = 'active_buffers = init_stage_buffers(stages=["Plan", "Research", "Review", "Answer"])'
# Ablation: RL training recipes (Fig. 5).
ARMS_TEXT = ("Figure 5 解读：600-step budget 下，Baseline RL、SS-GRPO、Meta-Policy、RubricEM 都从同一个 "
             "SFT checkpoint 出发。RubricEM 在 average delta over SFT、DRB、HealthBench、ResearchQA 上整体曲线"
             "最高，说明 SS-GRPO 的 stage-level credit 和 Reflection Meta-Policy 的 experience reuse 不是替代"
             "关系，而是互补；只加 SS-GRPO 或只加 Meta-Policy 均能改善，但 full recipe 最稳定。")
BASELINE_TEXT = "标准强化学习方法通常向所有 token 广播单个终端奖励，这对于长视野任务效率低下。"


def _numbers(text: str) -> list[float]:
    """The numbers of a printed matrix: "000" is three zeros, "1.0" one number."""
    out = []
    for tok in re.findall(r"\d+\.\d+|\d+", text):
        out += [float(tok)] if "." in tok else [0.0] * len(tok)
    return out


def test_lambda_is_the_printed_matrix_read_upper_triangular_sec3_3():
    """The notes print 16 numbers; read row by row they form a lower-triangular matrix, which the
    definition (lambda_{k,j} = 0 for j < k, unit diagonal) rules out, so the printed rows are Lambda's
    columns: Lambda = printed^T. The code's PAPER_LAMBDA must be exactly that."""
    vals = _numbers(PRINTED_LAMBDA)
    assert len(vals) == 16
    printed = np.array(vals).reshape(4, 4)
    lam = printed.T
    assert "λ_{k, j} = 0$ for $j < k$" in LAMBDA_DEFINITION and "λ_{k, k} = 1" in LAMBDA_DEFINITION
    assert np.all(np.tril(lam, -1) == 0) and np.all(np.diag(lam) == 1.0)
    assert not np.all(np.tril(printed, -1) == 0)  # the printed reading itself is not admissible
    np.testing.assert_array_equal(np.array(ss_grpo.PAPER_LAMBDA), lam)
    # G_{i,k} = sum_{j >= k} lambda_{k,j} R_{i,j}: the code's stage_returns on one-hot scores
    assert "λ_{k, j} R_{i, j}" in STAGE_RETURN
    G, _ = ss_grpo.stage_returns(torch.eye(4, dtype=torch.float64), ss_grpo.PAPER_LAMBDA)
    np.testing.assert_allclose(G.numpy(), lam.T)  # row j of G: stage j's score credited to each k
    assert presets.full_preset().ss_grpo.lam == ss_grpo.PAPER_LAMBDA


def test_buffer_caps_are_the_papers_per_stage_caps_sec3_4():
    prose = [int(x) for x in CAPS_PROSE.split("=")[1].split(",")]
    code = [int(x) for x in re.search(r"caps=\[([^\]]*)\]", CAPS_CODE).group(1).split(",")]
    assert prose == code == list(BUFFER_CAPS)
    order = re.findall(r'"(\w+)"', STAGE_ORDER)
    assert [s.lower() for s in order] == list(STAGES) == list(ss_grpo.STAGE_NAMES)  # caps[k]: stage k


def test_ablation_arms_are_the_papers_four_recipes_fig5():
    """Baseline RL (one terminal reward broadcast to every token), SS-GRPO alone (stage-level credit),
    Meta-Policy alone (reflection experience reuse) and RubricEM (both)."""
    names = re.search(r"下，(.*) 都从同一个", ARMS_TEXT).group(1).split("、")
    assert names == ["Baseline RL", "SS-GRPO", "Meta-Policy", "RubricEM"]
    arm = {n: settings.ARMS[re.sub(r"[\s-]+", "_", n.lower())] for n in names}
    assert "stage-level credit" in ARMS_TEXT and "experience reuse" in ARMS_TEXT
    stagewise = {n: a.advantage == "ss_grpo" for n, a in arm.items()}
    reuse = {n: a.reflection and a.bank for n, a in arm.items()}
    assert stagewise == {"Baseline RL": False, "SS-GRPO": True, "Meta-Policy": False, "RubricEM": True}
    assert reuse == {"Baseline RL": False, "SS-GRPO": False, "Meta-Policy": True, "RubricEM": True}
    # Baseline RL: one terminal score broadcast to all tokens ("向所有 token 广播单个终端奖励")
    assert "向所有 token 广播单个终端奖励" in BASELINE_TEXT
    assert arm["Baseline RL"].advantage in ss_grpo.TERMINAL_SCORES
    paper = {re.sub(r"[\s-]+", "_", n.lower()) for n in names}
    # ours, not the paper's: the information-matched Baseline RL, and the reward ladder's two rungs on
    # the toy judge's ground truth (the only arms that do not reward with the evolving judge)
    assert set(settings.ARMS) - paper == {"baseline_rl_info", "oracle", "stage_oracle"}
    assert {a for a, s in settings.ARMS.items() if s.reward != "judge"} == {"oracle", "stage_oracle"}


# ----------------------------------------------------------------------------------------------------
# Per-query advantages at the training call site (train.rl_step)

N_PER_QUERY = 4


class _Judge:
    """Two queries: every score of query "hi" is high, every score of query "lo" low; inside each
    group the rollouts are ordered best first."""

    concurrent_groups = False

    def judge_group(self, q, group, step):
        base = 0.8 if q.query == "hi" else 0.1
        R = np.array([[base + 0.05 * (len(group) - 1 - i)] * len(STAGES) for i in range(len(group))])
        return JudgeResult(R, [["-"] * len(STAGES) for _ in group], [[] for _ in STAGES],
                           {"proposed": 0, "pruned": 0, "missing": 0, "buffer_sizes": [0] * 4})


class _Policy:
    def __init__(self):
        self.batches = []

    def update(self, batch, pad_id, rng, joint=None):
        self.batches.append(batch)
        return {}

    def sync(self, sampler):
        pass


def _rollout(q):
    return Rollout(query=q, bank_items=[], prompt_ids=[5, 6], response_ids=[1, 2, 3, 4],
                   loss_mask=[1, 1, 1, 1], stage_ids=[0, 1, 2, 3])


def _run():
    cfg = presets.toy_preset()
    cfg.rollout.n, cfg.rollout.prompts_per_step = N_PER_QUERY, 2
    cfg.ss_grpo.skipped_stage_credit = False
    queries = [SimpleNamespace(query="hi"), SimpleNamespace(query="lo")]
    engine = SimpleNamespace(run=lambda qs, n, bank_items: [_rollout(q) for q in qs for _ in range(n)])
    return SimpleNamespace(cfg=cfg, policy=_Policy(), sampler=SimpleNamespace(stats={}, reseed=lambda s: None),
                           tok=SimpleNamespace(pad_token_id=0), train_q=queries,
                           order=SimpleNamespace(batch=lambda b: [0, 1]), bank=None,
                           arm=settings.ARMS["ss_grpo"], rollout_engine=engine, judge=_Judge())


def _check_per_query(batch) -> None:
    """Each query's group is normalised on its own: per stage its advantages sum to 0, its best
    rollout gains and its worst loses, whatever the other query scored."""
    adv = np.array([a[2:] for a in batch.adv])  # (N, 4): one response token per stage
    for g in range(2):
        A = adv[g * N_PER_QUERY:(g + 1) * N_PER_QUERY]
        np.testing.assert_allclose(A.sum(0), 0.0, atol=1e-5)
        assert np.all(A[0] > 0) and np.all(A[-1] < 0)


def test_rl_step_normalises_advantages_per_query_sec3_3():
    run = _run()
    train.rl_step(run, 0, train.ReflectionBatch(-1), __import__("random").Random(0), {})
    (batch,) = run.policy.batches
    assert [a[:2] for a in batch.adv] == [[0.0, 0.0]] * 2 * N_PER_QUERY  # prompts carry no advantage
    _check_per_query(batch)


def test_whole_batch_normalisation_fails_the_call_site_check(monkeypatch):
    """The mutation: advantages normalised over the whole batch (both queries' rollouts as one group)
    instead of per query. The call-site check above must catch it."""
    real = ss_grpo.group_advantages_batched
    monkeypatch.setattr(ss_grpo, "group_advantages_batched",
                        lambda G, group_size=None, **kw: real(G, group_size=G.shape[0], **kw))
    run = _run()
    train.rl_step(run, 0, train.ReflectionBatch(-1), __import__("random").Random(0), {})
    with pytest.raises(AssertionError):
        _check_per_query(run.policy.batches[0])

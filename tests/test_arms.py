"""The ablation arms (paper: "Ablation: RL training recipes"), one switch each: which components run
(advantage kind, reflection branch, bank upserts, bank retrieval) and the default run directory."""
import json

import numpy as np
import pytest
import torch

import bank as bank_mod
import ss_grpo
import hparams
import train
from backends.run import cli, config as settings, presets
from runfix import fast_args, metric_rows
from test_reflection import patch_sampler

EXPECTED = {  # arm: (advantage kind, reflection branch, bank retrieval)
    "rubricem": ("ss_grpo", True, True),
    "ss_grpo": ("ss_grpo", False, False),
    "meta_policy": ("terminal_answer", True, True),
    "baseline_rl": ("terminal_answer", False, False),
    "baseline_rl_info": ("terminal_mean", False, False),
    "oracle": ("terminal_answer", False, False),  # the reward ladder: static rewards
    "stage_oracle": ("ss_grpo", False, False),
}


def test_arm_table_sec3_3_sec3_4():
    assert {a: (s.advantage, s.reflection, s.bank) for a, s in settings.ARMS.items()} == EXPECTED
    assert {a for a, s in settings.ARMS.items() if s.reward == "static"} == {"oracle", "stage_oracle"}
    assert presets.toy_preset().arm == "rubricem" and presets.full_preset().arm == "rubricem"


def test_terminal_advantages_broadcast_one_score_sec3_3():
    g = torch.Generator().manual_seed(0)
    R = torch.rand(8, 4, generator=g, dtype=torch.float64).numpy()  # 2 groups of 4
    cfg = hparams.SSGRPOConfig()
    A_ans, _ = ss_grpo.task_advantages(R, 4, cfg, "terminal_answer")
    A_mean, _ = ss_grpo.task_advantages(R, 4, cfg, "terminal_mean")
    A_ss, _ = ss_grpo.task_advantages(R, 4, cfg, "ss_grpo")
    # Eq.: A_i = (r_i - mean r) / (Std r + eps) per group, the same for every stage
    ref_ans = ss_grpo.flat_advantages(torch.from_numpy(R[:, 3]), 4, group_size=4)
    ref_mean = ss_grpo.flat_advantages(torch.from_numpy(R.mean(1)), 4, group_size=4)
    torch.testing.assert_close(A_ans, ref_ans.float())
    torch.testing.assert_close(A_mean, ref_mean.float())
    assert (A_ans == A_ans[:, :1]).all() and (A_mean == A_mean[:, :1]).all()
    assert not (A_ss == A_ss[:, :1]).all()  # stagewise: columns differ
    R[0, 1] = np.nan  # a missing stage score: the mean is missing, that rollout gets advantage 0
    A_mean, _ = ss_grpo.task_advantages(R, 4, cfg, "terminal_mean")
    assert (A_mean[0] == 0).all()
    with pytest.raises(ValueError, match="advantage kind"):
        ss_grpo.task_advantages(R, 4, cfg, "flat")


@pytest.mark.parametrize("argv, arm, run_dir", [
    ([], "rubricem", "runs/toy"),
    (["--arm", "rubricem"], "rubricem", "runs/toy"),
    (["--arm", "ss_grpo"], "ss_grpo", "runs/toy-ss_grpo"),
    (["--arm", "baseline_rl", "--seed", "2"], "baseline_rl", "runs/toy-baseline_rl-seed2"),
    (["--arm", "baseline_rl_info", "--run-dir", "x"], "baseline_rl_info", "x"),
    (["--full", "--arm", "meta_policy"], "meta_policy", "runs/full-meta_policy"),
])
def test_arm_flag_sets_arm_and_default_run_dir(argv, arm, run_dir):
    cfg = cli.parse_args(argv)
    assert cfg.arm == arm and cfg.run_dir == run_dir


def test_advantage_flag_is_refused_with_a_pointer_to_arm():
    # --advantage flat used to keep reflection and bank on (Meta-Policy, not Baseline RL)
    with pytest.raises(ValueError, match="--arm baseline_rl"):
        cli.parse_args(["--toy", "--advantage", "flat"])


@pytest.mark.slow
@pytest.mark.parametrize("arm", list(EXPECTED))
def test_each_arm_runs_exactly_its_components(arm, tmp_path, toy_cache, monkeypatch):
    """2 steps with curriculum K = 1 (step 1 replays step 0's 4 queries in exact mode)."""
    kind, reflection, retrieval = EXPECTED[arm]
    calls, kinds, retrieves = [], [], []
    patch_sampler(monkeypatch, calls)
    adv = ss_grpo.task_advantages
    monkeypatch.setattr(ss_grpo, "task_advantages",
                        lambda R, n, cfg, k="ss_grpo": kinds.append(k) or adv(R, n, cfg, k))
    retrieve = bank_mod.RubricBank.retrieve
    monkeypatch.setattr(bank_mod.RubricBank, "retrieve",
                        lambda self, *a, **kw: retrieves.append(a) or retrieve(self, *a, **kw))
    run = tmp_path / "run"
    assert train.main(fast_args(run, toy_cache, 2, "--arm", arm, "--set", "curriculum.K=1",
                                "--set", "rollout.prompts_per_step=4", "--set",
                                "reflection.max_new_tokens=96", "--set", "eval.n_questions=0")) == 0
    r0, r1 = metric_rows(run)
    P, m = 4, 2
    assert kinds == [kind, kind]
    assert sum(t == 0.7 for _, t in calls) == (2 if reflection else 0)  # one batched call per step
    assert r0["bank/size"] == (P if reflection else 0)
    assert r1["update/reflection_seqs"] == (P * m if reflection else 0)
    assert len(retrieves) == (2 * P if retrieval else 0)
    assert r1["retrieval/mode_exact"] == 1
    assert r1["retrieval/hits"] == (1.0 if retrieval else 0.0)
    assert presets.load_config(json.load(open(run / "config.json"))).arm == arm

"""ZeRO-3 ranks stay in step whatever their data: with a head chunk of 8 positions, passes whose
ranks hold different numbers of loss tokens (5 chunks against 1, some against 0, every column
against a 2-token pass) finish and give a single process's values, for the reference pass, the
SS-GRPO update (§3.3; old, reference and gradient passes, the head recomputed in the backward and
not) and the SFT step (appendix, "Training configuration"; examples split 1 / 2 over the ranks).

Before fast_logprobs.ChunkedHead each chunk was a call of the LM head module, so each rank made as
many ZeRO-3 gathers as it had chunks and the ranks' collectives stopped matching: the reference pass
and the update hung, the SFT step failed in gloo on a message of the wrong size. One launch of
tests/zero3_collectives_check.py on 2 gloo ranks does every check (~30 s on 2 cores, ~50 s with
the single-process references); its collectives time out after one minute, so a hang fails the
test within about two. The model is an untied Qwen3 (as Qwen3-8B) whose head and embedding
(2,048 x 64) are above DeepSpeed's persistence threshold (1e5 elements), so both are gathered per
call as at scale.
Tolerances: log-probs 1e-5 absolute; update and SFT statistics rtol 1e-4; weights 1e-5 absolute
after steps of lr 1e-3 (measured 3e-6, against updates of 4e-3).
"""
import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import zero3_collectives_check as chk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_DS = (importlib.util.find_spec("deepspeed") is not None
           and importlib.util.find_spec("accelerate") is not None)
pytestmark = pytest.mark.skipif(not HAVE_DS, reason="deepspeed and accelerate are not installed")
LAUNCH_TIMEOUT_S = 240  # a backstop: a hung collective fails the launch after 60 s by itself


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(model dir, out dir) of one 2-rank launch of the worker."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tmp = tmp_path_factory.mktemp("zero3-collectives")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=chk.PAD)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp / "model")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT,
           "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "tests", "zero3_collectives_check.py"), str(tmp / "model"),
           str(tmp / "out")]
    # our own process group, so that a timeout kills torchrun and both ranks
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
    assert p.returncode == 0, (p.returncode, out[-2000:], err[-6000:])
    return tmp / "model", tmp / "out"


def _plain(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _max_weight_diff(out_dir, model) -> tuple[float, dict]:
    """(max |w_zero3 - w_single| over every tensor, the single process's state dict)."""
    from safetensors.torch import load_file

    saved = load_file(out_dir / "model.safetensors")
    sd = model.state_dict()
    assert set(saved) == set(sd)
    return max((saved[k] - sd[k]).abs().max().item() for k in saved), sd


def test_reference_pass_with_unequal_chunks_per_rank_equals_one_process(run):
    import policy

    model_dir, out = run
    model = _plain(model_dir).eval()
    for rank in (0, 1):
        got = torch.load(out / f"ref_rank{rank}.pt")
        assert len(got["inputs"]) == 3
        for (ids, att, mask), lp in zip(got["inputs"], got["logprobs"]):
            with torch.no_grad():
                want = policy.token_logprobs(model, ids, att)
            used = mask if mask is not None else torch.ones_like(ids, dtype=torch.bool)
            used = used.clone()
            used[:, 0] = False
            assert lp.shape == ids.shape and not lp[~used].any()
            assert torch.allclose(lp[used], want[used], atol=1e-5, rtol=0), (rank, (lp - want)[used])
            print(f"reference pass, rank {rank}: {int(used.sum())} columns, max |diff| "
                  f"{(lp - want)[used].abs().max().item() if used.any() else 0.0:.1e}")


def _single_process_update(model_dir):
    """The worker's two RL updates in one process (TorchEngine, the fast path): (model, per-step)."""
    import policy
    from backends.run.torch_engine import TorchEngine

    model = _plain(model_dir)
    cfg = chk.rl_config()
    batch = chk.rl_batch(model.config.vocab_size)
    engine = TorchEngine(model, cfg.ss_grpo, fast=True)
    shards, plans = policy.plan_update(batch, 1, cfg.ss_grpo.minibatches, cfg.ss_grpo.micro_batch)
    per_step = []
    for _ in range(2):
        policy.policy_update(engine, shards[0], cfg.ss_grpo, chk.PAD, plans[0], per_step)
    return model, per_step


def test_s33_update_with_unequal_chunks_per_rank_equals_one_process(run):
    model_dir, out = run
    model, want = _single_process_update(model_dir)
    got = json.loads((out / "rl_stats.json").read_text())
    assert len(got) == len(want) == 4  # 2 updates x 2 optimizer steps
    for g, w in zip(got, want):
        for k in ("loss/total", "loss/policy", "grad_norm"):
            assert g[k] == pytest.approx(w[k], rel=1e-4, abs=1e-7), (k, g, w)
        assert g["kl"] == pytest.approx(w["kl"], rel=1e-3, abs=1e-9)
    assert got[0]["kl"] == 0.0 and got[-1]["kl"] > 0  # pi_ref = the initial policy
    worst, sd = _max_weight_diff(out / "rl", model)
    init = _plain(model_dir).state_dict()
    moved = max((sd[k] - init[k]).abs().max().item() for k in init)
    assert worst < 1e-5 and moved > 1e-4, (worst, moved)
    print(f"RL: max |w_zero3 - w_single| {worst:.2e}, max update {moved:.2e}")


def test_sft_step_with_examples_split_unequally_equals_one_process(run):
    """One SFT step: the global token mean of -log pi over the loss-masked tokens (backends/sft/zero3.py),
    clipped to norm 1 and applied by AdamW (betas 0.9, 0.95), in one process."""
    import policy
    from backends.sft.pack import deal

    model_dir, out = run
    model = _plain(model_dir)
    examples = chk.sft_examples(model.config.vocab_size)
    assert [len(s) for s in deal(range(3), [len(i) for i, _ in examples], 2)] == [1, 2]
    n_tok = sum(sum(m) for _, m in examples)
    loss = 0.0
    for ids, mask in examples:
        x = torch.tensor([ids])
        # Eq.: L = - sum_t mask_t log pi(x_t | x_<t) / sum over the step of mask_t
        loss = loss - (policy.token_logprobs(model, x, torch.ones_like(x))[0]
                       * torch.tensor(mask)).sum() / n_tok
    opt = torch.optim.AdamW(model.parameters(), lr=chk.LR, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0)
    loss.backward()
    gn = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    opt.step()
    got = json.loads((out / "sft_records.json").read_text())
    # DeepSpeed's AdamW entry with "torch_adam": torch's AdamW, no FusedAdam to build
    assert got["optimizer"] == "AdamW"
    (rec,) = got["records"]
    assert rec["tokens"] == n_tok
    assert rec["loss"] == pytest.approx(float(loss.detach()), rel=1e-4)
    assert rec["grad_norm"] == pytest.approx(gn, rel=1e-4)
    worst, _ = _max_weight_diff(out / "sft", model)
    assert worst < 1e-5, worst
    print(f"SFT: max |w_zero3 - w_single| {worst:.2e}")

"""Full-mode memory: the LM-head recompute decision under ZeRO-3 (fast_logprobs._recompute_head reads
the vocabulary from `ds_shape`, not from the empty local partition), on 2 gloo ranks.

The 2-rank test launches tests/full_recompute_check.py under torchrun (~30 s on 2 cores): a tiny
untied Qwen3 (as Qwen3-8B: tie_word_embeddings false) with a vocabulary of 8,192, whose log-softmax
over one micro-batch (~100 positions x 8,192 x 4 B = 3 MiB) is above the threshold of 1 MiB set
there, so every gradient-recording head pass must take the recompute path. Inside the engine's
forward DeepSpeed's parameter getter (ZeROOrderedDict) gathers the head when it is touched, so there
`weight.shape[0]` happens to be right; outside it (a decision made before the forward, a benchmark,
another DeepSpeed version) the local partition is empty and only `ds_shape` is right: the test checks
both.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from backends.run import fast_logprobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_DS = (importlib.util.find_spec("deepspeed") is not None
           and importlib.util.find_spec("accelerate") is not None)
needs_ds = pytest.mark.skipif(not HAVE_DS, reason="deepspeed and accelerate are not installed")


def test_head_rows_reads_the_zero3_partition_shape():
    head = torch.nn.Linear(16, 300, bias=False)
    assert fast_logprobs.head_rows(head) == 300
    # a ZeRO-3 partition outside forward: an empty local tensor, the full shape in ds_shape
    head.weight = torch.nn.Parameter(torch.empty(0))
    head.weight.ds_shape = torch.Size([151936, 4096])
    assert fast_logprobs.head_rows(head) == 151936
    h = torch.zeros(26624, 16, requires_grad=True)
    # PAPER-scale decision: 26,624 positions x 151,936 x 4 B = 16 GB > 256 MiB -> recompute
    assert fast_logprobs._recompute_head(head, h, 26624)
    with torch.no_grad():
        # no backward, nothing kept
        assert not fast_logprobs._recompute_head(head, h.detach(), 26624)


@needs_ds
def test_zero3_two_ranks_vocab_above_threshold_takes_the_recompute_path(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "model")
    threshold = 2 ** 20
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT,
           "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "tests", "full_recompute_check.py"), str(tmp_path / "model"),
           str(tmp_path / "out"), str(threshold)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    for rank in (0, 1):
        res = json.load(open(tmp_path / "out" / f"rank{rank}.json"))
        assert res["vocab"] == 8192 and res["world_size"] == 2
        grad = [d for d in res["decisions"] if d["grad"]]
        assert grad, res["decisions"]  # the update's forward with gradient decided
        for d in grad:
            assert d["rows"] == 8192
            assert d["positions"] * 8192 * 4 > threshold
            assert d["verdict"] is True
        # Outside the forward the head is an empty partition: the old `weight.shape[0]` read 0 there
        # (0 x positions x 4 B is never above any threshold); ds_shape gives the true vocabulary.
        out = res["outside"]
        assert out["local_rows"] == 0 and out["rows"] == 8192 and out["verdict"] is True, out
        assert res["calls"]["recompute"] >= len(grad)  # the chunks ran under checkpoint
        # the scoring passes without gradient keep nothing, so they never recompute
        assert all(not d["verdict"] for d in res["decisions"] if not d["grad"])
        assert torch.isfinite(torch.tensor(res["stats"]["loss/total"]))

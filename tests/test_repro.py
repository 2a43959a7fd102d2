"""Toy mode is deterministic across processes (style rule 14): nothing that shapes the SFT data, the
warm start or the RL metrics may depend on Python's per-process string hashing (PYTHONHASHSEED), i.e.
on `hash()` or on the iteration order of a set of strings.

Each test runs the same work in two subprocesses with PYTHONHASHSEED=1 and =2 and compares digests.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Teacher data (20 trajectories + 20 reflections; a teacher that skips half the asked facts, so some
# trace skips two, whose order reaches the reflection text), the tokenizer trained on it, the encoded
# examples, and the weights after one SFT step over all of them.
SFT_DIGEST = r"""
import hashlib, json, sys
import torch
import policy, scaffold
from toy import model as toy_model
from toy import sft
from toy.world import BM25SearchTool, SYLLABLES, WorldConfig, make_world
torch.set_num_threads(1)
w = make_world(WorldConfig(seed=0, n_train_entities=40, n_heldout_entities=8))
cfg = sft.SFTConfig(n_trajectories=20, n_reflections=20, steps=1, batch_size=40)
ex, stats = sft.build_sft_data(w, BM25SearchTool(w.docs), scaffold.SYSTEM_PROMPT_COMPACT, cfg,
                               sft.TeacherConfig(p_skip=0.5))
texts = [d.title + " " + d.text for d in w.docs] + [sft.tok_text(m, s) for m, s in ex]
tok = toy_model.train_tokenizer(texts, names=list(w.entities), vocab_size=300, syllables=SYLLABLES)
enc = sft.encode_examples(tok, ex)
model = toy_model.build_tiny_qwen3(tok, "XS", seed=0)
torch.manual_seed(0)
sft.train_sft(model, tok, enc, cfg, progress=False)
h = hashlib.sha256()
for k, v in sorted(model.state_dict().items()):
    h.update(k.encode()); h.update(v.detach().numpy().tobytes())
dig = lambda o: hashlib.sha256(json.dumps(o).encode()).hexdigest()
print(json.dumps({"data": dig(ex), "stats": stats, "encoded": dig(enc), "weights": h.hexdigest()}))
"""


def _run(code: str, hashseed: int, *args: str) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": str(hashseed)}
    r = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_sft_data_and_one_sft_step_do_not_depend_on_string_hashing_appendix():
    a, b = _run(SFT_DIGEST, 1), _run(SFT_DIGEST, 2)
    assert a["stats"]["kept"] >= 20
    assert a == b


# A 1-step toy run (warm start on the data above, rollouts, judge, update, reflection, bank).
TOY_RUN = r"""
import json, sys
sys.path.insert(0, "tests")
import runfix, train
run_dir, cache = sys.argv[1], sys.argv[2]
args = runfix.fast_args(run_dir, cache, 1, "--set", "eval.n_questions=0", "--set", "teacher.p_skip=0.5",
                        "--set", "sft.n_trajectories=20", "--set", "sft.n_reflections=20",
                        "--set", "sft.batch_size=40", "--set", "sft.steps=1")
assert train.main(args) == 0
print(json.dumps({"metrics": runfix.metric_rows(run_dir),
                  "bank": runfix.sha256(run_dir + "/bank.jsonl"),
                  "weights": runfix.sha256(run_dir + "/final/model.safetensors")}))
"""


@pytest.mark.slow
def test_one_step_toy_run_does_not_depend_on_string_hashing_sec3_5(tmp_path):
    a = _run(TOY_RUN, 1, str(tmp_path / "r1"), str(tmp_path / "c1"))
    b = _run(TOY_RUN, 2, str(tmp_path / "r2"), str(tmp_path / "c2"))
    assert a == b

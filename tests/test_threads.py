"""Thread settings of the toy run: `threads` (training: SFT, updates) and `sample_threads` (the
samplers' decoding, hf_sampler.intra_op_threads), and train.py's default OMP_WAIT_POLICY. The sampled
tokens depend on the sampling threads only, so a run's rollouts and held-out evaluation do not
change with the training thread count.
"""
import os
import subprocess
import sys

import pytest
import torch

from backends.run import build, config as settings, presets
from toy.hf_sampler import HFSampler, intra_op_threads
from toy.kv_sampler import KVSampler
from test_kv_sampler import model, prompt  # noqa: F401  (the XS model fixture, a chat prompt)
from toyfix import tok  # noqa: F401  (module fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


def test_intra_op_threads_sets_and_restores(two_threads):
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with intra_op_threads(0):  # 0: the process's count, unchanged
        assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError, match="boom"):
        with intra_op_threads(1):
            raise RuntimeError("boom")
    assert torch.get_num_threads() == 2  # restored on an error too


@pytest.mark.parametrize("cls", [HFSampler, KVSampler])
def test_samplers_decode_on_their_threads_and_restore_the_count(cls, two_threads, tok, model):
    seen = []
    h = model.register_forward_pre_hook(lambda mod, args: seen.append(torch.get_num_threads()))
    try:
        cls(model, tok, threads=1).generate([prompt(tok)] * 2, [6, 6], 1.0)
    finally:
        h.remove()
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == 2


def test_sampled_tokens_do_not_depend_on_the_training_threads(tok, model):
    """sample_threads = 1 under a 2-thread process draws what a 1-thread process draws."""
    p = [prompt(tok), prompt(tok)[:-3], prompt(tok)]
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.manual_seed(7)
        ref = KVSampler(model, tok).generate(p, [40, 40, 40], 1.0)
        torch.set_num_threads(2)
        torch.manual_seed(7)
        got = KVSampler(model, tok, threads=1).generate(p, [40, 40, 40], 1.0)
    finally:
        torch.set_num_threads(n)
    assert got == ref and any(len(r) > 5 for r in ref)


def test_build_passes_sample_threads_to_every_toy_sampler(tok, model):
    cfg = presets.toy_preset()
    assert (cfg.threads, cfg.sample_threads) == (2, 1)
    cfg.sample_threads = 3
    for name in ("kv", "hf"):
        cfg.sampler = name
        assert build.build_sampler(cfg, model, tok).threads == 3
    engines = build.heldout_engines(cfg, model, model, tok, type("T", (), {"name": "search"})(), "")
    assert [e.sampler.threads for e in engines] == [3, 3]


@pytest.mark.parametrize("name,want", [("kv", "KVSampler"), ("hf", "HFSampler"),
                                       ("vllm", "HFSampler")])
def test_heldout_evaluation_samples_with_the_toy_sampler(tok, model, name, want):
    cfg = presets.toy_preset()
    cfg.sampler = name
    engines = build.heldout_engines(cfg, model, model, tok, type("T", (), {"name": "search"})(), "")
    assert [type(e.sampler).__name__ for e in engines] == [want, want]
    assert [e.sampler.model for e in engines] == [model, model]


@pytest.mark.parametrize("field,value", [("threads", 0), ("threads", True), ("threads", 1.5),
                                         ("sample_threads", -1)])
def test_thread_settings_are_validated(field, value):
    cfg = presets.toy_preset()
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=field):
        settings.validate_config(cfg)


def test_train_sets_a_passive_omp_wait_policy_unless_the_environment_does():
    code = "import os, train; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out[-1] == "PASSIVE"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                         env={**env, "OMP_WAIT_POLICY": "ACTIVE"}, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[-1] == "ACTIVE"

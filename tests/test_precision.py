"""The `precision` setting (hf_sampler.autocast): "bf16" runs the toy model's forwards (SFT, both
samplers, the update's log-probs) under bfloat16 autocast while weights, optimizer state, log-probs
and losses stay float32; "fp32" is the float32 path, unchanged. Samplers and the update must agree
with each other under the same precision, as they do in float32.
"""
import dataclasses

import pytest
import torch

import policy

from backends.run import torch_engine

from toy import model as toy_model
import toyfix as tf
from toy.hf_sampler import HFSampler, autocast
from backends.run.config import validate_config
from backends.run.presets import toy_preset
from hparams import SSGRPOConfig
from toy import sft
from toy.kv_sampler import KVSampler
from test_kv_sampler import model, prompt  # noqa: F401  (the XS model fixture, a chat prompt)
from toyfix import one_thread, tok  # noqa: F401  (module fixtures)


def test_autocast_rejects_an_unknown_precision():
    with pytest.raises(ValueError, match="precision"):
        autocast("fp16")
    with pytest.raises(ValueError, match="precision"):
        HFSampler(None, tf.tiny_tokenizer(), precision="half")


def test_bf16_logprobs_are_float32_close_to_fp32_and_not_equal(tok, model):
    p = prompt(tok)
    ids = torch.tensor([p, p[::-1]])
    att = torch.ones_like(ids)
    cfg = SSGRPOConfig()
    lp32 = torch_engine.TorchEngine(model, cfg).logprobs(ids, att)
    lp16 = torch_engine.TorchEngine(model, cfg, precision="bf16").logprobs(ids, att)
    assert lp16.dtype == torch.float32 and lp16.shape == lp32.shape
    # bfloat16 products: an 8-bit mantissa, so the log-probs move by up to a few 1e-2 ...
    assert torch.allclose(lp16, lp32, atol=0.1)
    # ... and do move: the products really ran in bfloat16
    assert not torch.equal(lp16, lp32)


def test_bf16_update_keeps_float32_weights_and_optimizer_state(tok):
    m = toy_model.build_tiny_qwen3(tok, "XS", seed=3)
    eng = torch_engine.TorchEngine(m, SSGRPOConfig(), precision="bf16")
    p = prompt(tok)
    batch = policy.UpdateBatch(ids=[p, p[2:]], mask=[[0] * 5 + [1] * (len(p) - 5)] * 2,
                               adv=[[0.0] * 5 + [1.0] * (len(p) - 5),
                                    [0.0] * 5 + [-1.0] * (len(p) - 7)],
                               kind=["task", "task"])
    batch.mask[1] = batch.mask[1][: len(p) - 2]
    before = [q.detach().clone() for q in m.parameters()]
    import random

    stats = eng.update(batch, tok.pad_token_id, random.Random(0))
    assert all(q.dtype == torch.float32 for q in m.parameters())
    assert all(v.dtype == torch.float32 for st in eng.opt.state.values() for v in st.values()
               if torch.is_tensor(v) and v.is_floating_point())
    assert any(not torch.equal(a, b) for a, b in zip(before, m.parameters()))
    assert all(torch.isfinite(torch.as_tensor(v)).all() for v in stats.values()
               if isinstance(v, (int, float)))


def test_bf16_kv_sampler_greedy_equals_hf_generate_under_bf16_sec3_1(tok, model):
    p = prompt(tok)
    prompts = [p, p[:9], p[3:], p[2:11]]
    budgets = [40, 60, 64, 33]
    out = []
    for cls in (HFSampler, KVSampler):
        out.append(cls(model, tok, precision="bf16").generate(prompts, budgets, 0.0))
    assert out[0] == out[1]


def test_bf16_kv_sampler_logprobs_equal_a_bf16_full_forward(tok, model):
    p = prompt(tok)
    torch.manual_seed(2)
    ids, lps = KVSampler(model, tok, precision="bf16").decode([p, p[:7]], [30, 30], 1.0,
                                                              return_logprobs=True)
    eng = torch_engine.TorchEngine(model, SSGRPOConfig(), ref_model=model, precision="bf16")
    for pr, new, lp in zip([p, p[:7]], ids, lps):
        seq = torch.tensor([pr + new])
        with torch.no_grad():
            full = eng.logprobs(seq, torch.ones_like(seq))[0, len(pr):]
        # the cached decode and the full forward round in different places: bf16-level agreement
        assert torch.allclose(torch.tensor(lp), full, atol=0.05, rtol=0), (lp, full)


def test_bf16_sft_step_trains_float32_weights(tok):
    m = toy_model.build_tiny_qwen3(tok, "XS", seed=1)
    ids = prompt(tok)
    enc = [(ids, [0] * 5 + [1] * (len(ids) - 5))] * 4
    cfg = sft.SFTConfig(steps=3, batch_size=2, warmup=1)
    res = {}
    for precision in ("fp32", "bf16"):
        mm = toy_model.build_tiny_qwen3(tok, "XS", seed=1)
        res[precision] = sft.train_sft(mm, tok, enc, cfg, progress=False, precision=precision)
        assert all(q.dtype == torch.float32 for q in mm.parameters())
    assert abs(res["bf16"]["loss"] - res["fp32"]["loss"]) < 0.1
    assert res["bf16"]["loss"] != res["fp32"]["loss"]


def test_bf16_warm_start_is_cached_apart_from_the_fp32_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    world = tf.tiny_world()
    cfg = sft.SFTConfig(n_trajectories=6, n_reflections=2, steps=2, batch_size=4, warmup=1, seed=0)
    args = (world, tf.tiny_tool(), tf.SYSTEM, cfg, tf.mild_teacher(), "XS", 300, str(tmp_path))
    key32 = sft.warm_start_key(world.config, tf.SYSTEM, cfg, tf.mild_teacher(), "XS", 300)
    _, _, info32, path32 = sft.warm_start(*args, progress=False)
    _, _, info16, path16 = sft.warm_start(*args, progress=False, precision="bf16")
    # fp32 keeps the key warm starts had before the option; bf16 trains its own, not the cached one
    assert info32["key"] == key32 and path32.endswith(key32)
    assert path16 != path32 and info16["cached"] is False
    assert (info32["precision"], info16["precision"]) == ("fp32", "bf16")


def test_precision_setting_is_validated():
    cfg = toy_preset()
    assert cfg.precision == "fp32"
    with pytest.raises(ValueError, match="precision"):
        validate_config(dataclasses.replace(cfg, precision="fp16"))
    bad = dataclasses.replace(cfg, precision="bf16", engine="zero3", model="/some/dir")
    with pytest.raises(ValueError, match="full.bf16"):
        validate_config(bad)

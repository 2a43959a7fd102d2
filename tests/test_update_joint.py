"""The deferred reflection update inside the task's optimizer steps (§3.4, Algorithm 1; policy.policy_update's
`joint`): one optimizer step takes the gradient of L_task + L_reflect, each term the SS-GRPO loss of
its own sequences normalised over its own tokens and scored at its own sampling temperature, so one
AdamW state moves the weights once per step for both objectives (no extra, momentum-carried step).
"""
import copy
import random

import pytest
import torch

from hparams import SSGRPOConfig
from backends.run.torch_engine import TorchEngine
from policy import UpdateBatch, plan_update
from test_update_fastpath import PAD, RecordingOpt, make_batch, tiny_qwen3


def reflection_batch(n: int, temperature: float = 0.7, seed: int = 5) -> UpdateBatch:
    """n 'candidates' behind one shared 8-token prompt (mask 0), 3-6 own tokens each."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, 64, (8,), generator=g).tolist()
    b = UpdateBatch(temperature=temperature)
    for i in range(n):
        own = torch.randint(1, 64, (3 + i % 4,), generator=g).tolist()
        b.ids.append(prompt + own)
        b.mask.append([0] * 8 + [1] * len(own))
        a = float(torch.randn((), generator=g))
        b.adv.append([0.0] * 8 + [a] * len(own))
        b.kind.append("reflection")
    return b


def grads_of(model, ref_model, cfg, batch, joint=None, fast=False):
    """The gradients handed to the first optimizer step, and the update's metrics."""
    opt = RecordingOpt(model.parameters())
    out = TorchEngine(model, cfg, ref_model, opt, fast=fast).update(batch, PAD, random.Random(0),
                                                                   joint=joint)
    return opt.grads, out


@pytest.mark.parametrize("fast", [False, True])
def test_s34_joint_step_gradient_is_the_sum_of_the_two_objectives(fast):
    """One optimizer step (minibatches 1): the joint gradient equals the task batch's gradient plus
    the reflection batch's, each computed alone from the same weights (to 1e-6), and the metrics
    report both parts."""
    model, ref_model = tiny_qwen3(), tiny_qwen3(seed=1)  # a real KL gradient too
    cfg = SSGRPOConfig(minibatches=1, micro_batch=3, beta=0.04, grad_clip=1e9)
    task, refl = make_batch(7), reflection_batch(6)
    g_task, _ = grads_of(copy.deepcopy(model), ref_model, cfg, task, fast=fast)
    g_refl, _ = grads_of(copy.deepcopy(model), ref_model, cfg, refl, fast=fast)
    g_joint, out = grads_of(copy.deepcopy(model), ref_model, cfg, task, refl, fast=fast)
    worst = max(float((j - a - b).abs().max()) for j, a, b in zip(g_joint, g_task, g_refl))
    assert worst < 1e-6, worst
    assert max(float(b.abs().max()) for b in g_refl) > 1e-3  # the reflection part is no zero
    assert {"loss/total", "joint/loss/total", "joint/kl", "joint/time_s"} <= set(out)
    assert "joint/grad_norm" not in out  # one norm per optimizer step: the one above


def test_s34_joint_update_takes_the_task_batch_optimizer_steps_only():
    """With minibatches M, the joint update takes M optimizer steps (the task's), not M plus the
    reflection batch's: AdamW's step count says so; a run without a joint batch takes M too."""
    cfg = SSGRPOConfig(minibatches=2, micro_batch=4, beta=0.001)
    for joint in (None, reflection_batch(6)):
        model, ref_model = tiny_qwen3(), tiny_qwen3(seed=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        TorchEngine(model, cfg, ref_model, opt).update(make_batch(8), PAD, random.Random(0), joint=joint)
        steps = {int(st["step"]) for st in opt.state.values()}
        assert steps == {2}, steps


def test_s34_joint_part_is_scored_at_its_own_temperature():
    """The reflection part's loss uses its batch's temperature (0.7): changing it changes the joint
    gradient while the task batch (at 1.0) is the same."""
    cfg = SSGRPOConfig(minibatches=1, micro_batch=4, beta=0.0, grad_clip=1e9)
    model = tiny_qwen3()
    task = make_batch(5)
    a, _ = grads_of(copy.deepcopy(model), model, cfg, task, reflection_batch(4, temperature=0.7))
    b, _ = grads_of(copy.deepcopy(model), model, cfg, task, reflection_batch(4, temperature=1.0))
    assert max(float((x - y).abs().max()) for x, y in zip(a, b)) > 1e-5


def test_s34_joint_batch_beside_an_empty_batch_is_refused():
    cfg = SSGRPOConfig(minibatches=1, micro_batch=4)
    model = tiny_qwen3()
    eng = TorchEngine(model, cfg, model, RecordingOpt(model.parameters()))
    with pytest.raises(ValueError, match="joint"):
        eng.update(UpdateBatch(), PAD, random.Random(0), joint=reflection_batch(2))
    assert eng.update(UpdateBatch(), PAD, random.Random(0), joint=UpdateBatch()) == {}


def test_s33_passes_take_units_longest_first_across_ranks():
    """Balanced passes: within an optimizer step, pass p on every rank takes the units of the p-th
    block of micro x W in longest-first order, so a lockstep pass pads to about its own longest unit
    (a permutation inside one optimizer step: the same gradient)."""
    batch = make_batch(23)
    size = {i: len(x) for i, x in enumerate(batch.ids)}
    for world, micro, mbs in ((1, 4, 2), (3, 2, 1), (4, 1, 2)):
        shards, plans = plan_update(batch, world, mbs, micro, random.Random(1))
        for j in range(len(plans[0].minibatches)):
            step_sizes = sorted((size[plans[r].index[i]] for r in range(world)
                                 for i in plans[r].minibatches[j]), reverse=True)
            for p in range(plans[0].n_micro[j]):
                got = sorted((size[plans[r].index[i]] for r in range(world)
                              for i in plans[r].minibatches[j][p * micro:(p + 1) * micro]), reverse=True)
                assert got == step_sizes[p * micro * world:(p + 1) * micro * world]

"""The full preset carries the paper's values (appendix) and no toy value: max prompt 8,192 and max pack
26,624 tokens, a reflection length and prompt fit for full mode (the paper gives neither), judge
prompts free of toy-world criteria, and Lambda anchored to the matrix as the paper prints it."""
import re

import pytest

import bank
import reflection
import scaffold
import ss_grpo
from backends.api import judge_prompts
from backends.run.config import validate_config
from backends.run.presets import full_preset, toy_preset

# The paper prints Lambda flattened (shared/paper/000_*.txt, §3.3):
PRINTED_LAMBDA = "1.0 000 0.4 1.0 00 0.6 0.4 1.0 0 0.8 0.8 0.8 1.0"


def _printed_rows():
    nums = []
    for tok in PRINTED_LAMBDA.split():
        nums += [0.0] * len(tok) if set(tok) == {"0"} else [float(tok)]
    assert len(nums) == 16
    return [nums[4 * r: 4 * r + 4] for r in range(4)]


def test_lambda_is_the_printed_matrix_read_column_by_column_sec3_3():
    rows = _printed_rows()
    # Read row by row, the print is lower triangular, against the definition lambda_{k,j} = 0 for j < k;
    # read column by column (its transpose) it is upper triangular with a unit diagonal: that reading.
    assert any(rows[k][j] for k in range(4) for j in range(k + 1, 4)) is False
    transposed = [[rows[j][k] for j in range(4)] for k in range(4)]
    assert ss_grpo.PAPER_LAMBDA == transposed
    assert [ss_grpo.PAPER_LAMBDA[k][k] for k in range(4)] == [1.0] * 4


def test_full_preset_prompt_and_pack_lengths_appendix(monkeypatch):
    cfg = full_preset()
    assert cfg.full.max_prompt_tokens == 8192  # PAPER: max prompt length
    assert cfg.rollout.max_response_tokens == 18432  # PAPER: max response length
    from backends.distributed import plan
    assert plan.pack_tokens(cfg) == 26624  # PAPER: max total pack length
    # the vLLM engine's context is the pack (build.build_sampler)
    from backends.run import build
    from types import SimpleNamespace

    seen = {}

    class Capture:
        def __init__(self, model_dir, tok, **kw):
            seen.update(kw)

    import backends.scale.vllm_sampler as vs
    monkeypatch.setattr(vs, "VLLMSampler", Capture)
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=40960))
    build.build_sampler(cfg, model, None)
    assert seen["max_model_len"] == 26624


def test_full_preset_reflection_length_and_prompt_demand_no_stage_tags():
    cfg = full_preset()
    cfg.model = "/models/sft"
    validate_config(cfg)
    assert cfg.reflection.max_new_tokens == 512 > toy_preset().reflection.max_new_tokens
    assert cfg.bank.max_chars == 3000
    system = reflection.reflection_system(cfg.reflection, scaffold.system_prompt(
        cfg.rollout.scaffold, cfg.rollout.system_prompt))
    assert system == reflection.REFLECT_SYSTEM
    # the task prompt demands the stage tags; the reflection prompt names none of them
    task = scaffold.system_prompt(cfg.rollout.scaffold, cfg.rollout.system_prompt)
    assert any(t in task for t in scaffold.SCAFFOLD_TAGS)
    assert not any(t in system for t in scaffold.SCAFFOLD_TAGS)
    assert "<" not in system
    # a reflection written as asked (prose, no tags) passes the bank's admission at the full length
    note = ("The research stage fell short: it searched only the first aspect. Lesson: search every "
            "aspect the question asks about before writing the review. ") * 10
    assert len(note) < cfg.bank.max_chars
    ok, reason = bank.validate_reflection(note, None, max_chars=cfg.bank.max_chars)
    assert ok, reason
    # the toy preset keeps the task prompt its SFT taught reflections under
    assert reflection.reflection_system(toy_preset().reflection, task) == task
    bad = full_preset()
    bad.model = "/models/sft"
    bad.reflection.system_prompt = "tags"
    with pytest.raises(ValueError, match="reflection.system_prompt"):
        validate_config(bad)


TOY_WORDS = ("look-alike", "old record", "hedging", "entity the query does not ask", "are long")


def test_full_mode_judge_prompts_carry_no_toy_world_criteria():
    prompts = {n: v for n, v in vars(judge_prompts).items() if n.startswith("SYSTEM") and isinstance(v, str)}
    assert {"SYSTEM_BASE", "SYSTEM_PROPOSE", "SYSTEM_SCORE", "SYSTEM_REFLECT"} <= set(prompts)
    for name, text in prompts.items():
        for w in TOY_WORDS:
            assert w not in text.lower(), (name, w)
        # the toy world's vocabulary (its entity and aspect words) stays out of the HTTP judge
        assert not re.search(r"\b(kuvebro|syllable|toy)\b", text.lower()), name


def test_full_preset_threads_are_the_cores_per_rank(monkeypatch):
    """DeepSpeedCPUAdam runs one OpenMP thread per torch thread (train.py sets config.threads): the
    full preset gives each rank its share of the node's cores, not the toy's 2."""
    from backends.run import presets

    assert presets.cores_per_rank({"LOCAL_WORLD_SIZE": "8"}, cores=192) == 24  # torchrun
    assert presets.cores_per_rank({"LOCAL_SIZE": "4"}, cores=96) == 24  # the deepspeed launcher
    assert presets.cores_per_rank({}, cores=2, hint=8) == 1  # not launched: the dry run's 8 GPUs
    assert presets.cores_per_rank({}, cores=128, hint=8) == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(presets.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert full_preset().threads == 16 and toy_preset().threads == 2

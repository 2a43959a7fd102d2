"""Asking a trained policy (scripts/ask.py) and the run card that carries its system prompt (runcard.py):
the §3.1-3.2 scaffold with real tool calls, printed stage by stage."""
import dataclasses
import json
import os

from runfix import load_script

ask = load_script("ask")
from toy import model as toy_model
from backends.run import runcard
import scaffold
from backends.run import build, presets
from toyfix import TINY, policy_segments, replay, teacher, tiny_tokenizer, torch_threads, train_queries


def _render(tok, messages) -> list:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_run_card_gives_plain_transformers_users_the_training_system_prompt(tmp_path):
    from transformers import AutoTokenizer

    tok = tiny_tokenizer()
    before = tok.chat_template
    system, user = scaffold.SYSTEM_PROMPT, {"role": "user", "content": "Who described Harta?"}
    runcard.save_with_run_card(str(tmp_path), tok, {"steps": 3}, system)
    assert tok.chat_template == before  # the training tokenizer is left as it was
    plain = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    trained = _render(tok, scaffold.build_messages(user["content"], [], system))
    assert _render(plain, [user]) == trained  # the default system message is the training one
    other = [{"role": "system", "content": "Be brief."}, user]
    assert _render(plain, other) == _render(tok, other)  # an explicit system message wins
    card, where = runcard.read_run_card(str(tmp_path))
    assert card["system_prompt"] == system and card["config"] == {"steps": 3} and where.endswith(runcard.CARD)
    # Saving again (a policy trained from a final/) replaces the default instead of stacking it.
    twice = runcard.with_default_system(plain.chat_template, "X")
    assert twice.count("rubricem: default system prompt") == 1 and '"X"' in twice


def test_format_trajectory_prints_stages_tool_calls_and_outputs_sec3_2():
    q = train_queries()[0]
    ro, _ = replay(q, policy_segments(teacher(q).segments))
    text = ask.format_trajectory(ro)
    heads = [text.index(f"[{s}]") for s in scaffold.STAGES]
    assert heads == sorted(heads)
    call = ro.tool_calls[0]
    line = f"  -> google_search({call.query!r}): {len(call.handles)} results [1]-[{call.handles[-1]}]"
    assert line in text and heads[1] < text.index(line) < heads[2]
    assert f"     | [1] {call.results[0].title} | " in text
    assert "<answer>" in text[heads[3]:] and text.rstrip().endswith("sampled tokens)")


def test_ask_runs_a_checkpoint_with_its_run_card(tmp_path, capsys):
    d = str(tmp_path / "final")
    tok = tiny_tokenizer()
    cfg = presets.toy_preset()
    cfg.world = dataclasses.replace(TINY)
    cfg.rollout.max_response_tokens = 24
    with torch_threads(1):
        toy_model.build_tiny_qwen3(tok, "XS", seed=0).save_pretrained(d)
        runcard.save_with_run_card(d, tok, dataclasses.asdict(cfg), scaffold.SYSTEM_PROMPT_COMPACT)
        assert ask.main([d, "What is Harta used for?", "--samples", "2", "--seed", "3"]) == 0
        out = capsys.readouterr().out
        res = ask.ask(d, None, samples=1)
    assert "question: What is Harta used for?" in out and "rubricem.json" in out
    assert out.count("=== rollout") == 2 and out.count("[plan]") == 2 and out.count("[answer]") == 2
    assert res["system"] == scaffold.SYSTEM_PROMPT_COMPACT and len(res["rollouts"]) == 1
    r = res["rollouts"][0]
    assert scaffold.SYSTEM_PROMPT_COMPACT in tok.decode(r.prompt_ids) and len(r.response_ids) <= 24
    assert res["question"] == build.build_environment(presets.load_config(
        json.load(open(os.path.join(d, runcard.CARD)))["config"]))[3][0].query  # a held-out question
    # Unusable input: exit code 2 with the reason.
    assert ask.main([str(tmp_path / "nope"), "q"]) == 2
    assert "ask.py: error" in capsys.readouterr().err

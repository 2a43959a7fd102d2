"""What a saved policy needs in order to be used as it was trained: the run card.

A policy learns its four-stage format under one system prompt (scaffold.SYSTEM_PROMPT or, in toy mode,
SYSTEM_PROMPT_COMPACT); asked without it, it answers out of distribution. So the final checkpoint
carries the prompt twice:

    rubricem.json     {"format": 1, "system_prompt": str, "config": the run's configuration (asdict)}
                      read by scripts/ask.py (world, search tool and rollout limits come from "config")
    chat template     the tokenizer's template puts the same prompt in as the default system message,
                      so plain transformers users get it:
                      tok.apply_chat_template([{"role": "user", "content": q}], ...) renders exactly
                      what training rendered for [{"role": "system", ...}, {"role": "user", ...}]
    generation_config.json   stops at `</call_tool>` (write_generation_stops), so plain `generate`
                      hands a tool call back instead of writing the tool's output itself
    README.md         how to use the folder: scripts/ask.py, or the tool loop around plain `generate`

Not part of the paper's method.
"""
from __future__ import annotations

import json
import os

CARD = "rubricem.json"
FORMAT = 1
_BEGIN = "{#- rubricem: default system prompt -#}"
_END = "{#- rubricem: end -#}"


def with_default_system(template: str | None, system: str) -> str | None:
    """A Jinja chat template that inserts `system` as the first message when the conversation has no
    system message, then renders as `template` does (unchanged otherwise). A default added earlier by
    this function is replaced, not stacked. None (no template) stays None."""
    if template is None:
        return None
    if template.startswith(_BEGIN) and _END in template:
        template = template.split(_END, 1)[1]
    # json.dumps gives a double-quoted literal with \n, \" and \uXXXX escapes, which Jinja decodes.
    head = (f"{_BEGIN}{{%- if not messages or messages[0]['role'] != 'system' %}}"
            f"{{%- set messages = [{{'role': 'system', 'content': {json.dumps(system)}}}] + messages %}}"
            f"{{%- endif %}}{_END}")
    return head + template


def save_with_run_card(out_dir: str, tokenizer, config: dict, system: str) -> None:
    """Save `tokenizer` into out_dir with `system` as its chat template's default system message, and
    write out_dir/rubricem.json (system prompt and `config`, a JSON-serialisable dict such as
    dataclasses.asdict(config.Config)). The tokenizer object itself is left unchanged. Raises OSError
    if a write fails."""
    old = tokenizer.chat_template
    try:
        tokenizer.chat_template = with_default_system(old, system)
        tokenizer.save_pretrained(out_dir)
    finally:
        tokenizer.chat_template = old
    with open(os.path.join(out_dir, CARD), "w", encoding="utf-8") as fh:
        json.dump({"format": FORMAT, "system_prompt": system, "config": config}, fh, indent=1)
    write_generation_stops(out_dir, tokenizer)
    with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8") as fh:
        fh.write(MODEL_CARD)


# final/README.md: what a person who finds the folder needs to use it.
MODEL_CARD = """# A RubricEM policy

A research agent trained with RubricEM (arXiv 2605.10899). It answers in four tagged stages (plan,
research with tool calls, review, answer) and expects a search tool to answer each
`<call_tool name="google_search">query</call_tool>` with a `<tool_output>` block.

- Ask it: `python scripts/ask.py THIS_DIR "question"` in the rubricem repository (scaffold and search tool
  as in training; `rubricem.json` holds the run's system prompt and configuration).
- Plain transformers `generate` stops at each `</call_tool>` (generation_config.json): run the search,
  append the tool output and generate again (docs/final_policy.md of the repository shows the loop).
"""


# Where plain `generate` must hand over to the environment: after a tool call the search tool answers
# (scaffold.RolloutEngine, scripts/ask.py); generating on would make up the tool's output.
STOP_STRINGS = ("</call_tool>",)


def write_generation_stops(out_dir: str, tokenizer) -> dict:
    """Add the tool-call stop to out_dir/generation_config.json, so that plain transformers
    `model.generate(...)` stops at `</call_tool>` as the rollout engine does: a stop string that is
    one token of `tokenizer` (the toy tokenizer's tags are) joins `eos_token_id` (works without
    passing the tokenizer); one that is several tokens goes into `stop_strings` (then
    `generate(..., tokenizer=tok)` is needed, as transformers requires for stop strings). Other
    fields are kept. Returns the written config dict. Raises OSError if a write fails."""
    path = os.path.join(out_dir, "generation_config.json")
    gen = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            gen = json.load(fh)
    eos = gen.get("eos_token_id", tokenizer.eos_token_id)
    eos = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
    strings = list(gen.get("stop_strings") or [])
    for stop in STOP_STRINGS:
        ids = tokenizer.encode(stop, add_special_tokens=False)
        if len(ids) == 1:
            eos += [ids[0]] if ids[0] not in eos else []
        elif stop not in strings:
            strings.append(stop)
    gen["eos_token_id"] = eos
    if strings:
        gen["stop_strings"] = strings
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(gen, fh, indent=2)
    return gen


def card_mismatch(model_dir: str, system: str, scaffold: str) -> str | None:
    """A one-line problem when `model_dir`'s run card says the policy was trained under another system
    prompt or scaffold than the run would use (a policy asked in a format it never saw), else None
    (the card agrees, or there is no card to compare). Raises ValueError for an unreadable card."""
    card, where = read_run_card(model_dir)
    if not card:
        return None
    saved = (card.get("config") or {}).get("rollout") or {}
    if saved.get("scaffold", scaffold) != scaffold:
        return (f"the policy in {model_dir} was trained in the {saved['scaffold']!r} scaffold ({where}); "
                f"this run uses {scaffold!r} (rollout.scaffold)")
    if "system_prompt" in card and card["system_prompt"] != system:
        return (f"the policy in {model_dir} was trained under another system prompt ({where}); set "
                "rollout.system_prompt to the one it learned, or retrain it with this one")
    return None


def read_run_card(model_dir: str) -> tuple[dict | None, str]:
    """(card, where) for a model directory: its rubricem.json; else, for a run's final/ saved before
    run cards existed, {"config": ...} from the run dir's config.json beside it (no system prompt);
    else (None, "none"). Raises ValueError for an unreadable or unknown-format card."""
    path = os.path.join(model_dir, CARD)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as fh:
                card = json.load(fh)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: unreadable run card ({e})") from None
        if not isinstance(card, dict) or card.get("format") != FORMAT:
            raise ValueError(f"{path}: unknown run-card format {card.get('format') if isinstance(card, dict) else card!r}")
        return card, path
    run_cfg = os.path.join(os.path.dirname(os.path.abspath(model_dir)), "config.json")
    if os.path.basename(os.path.normpath(model_dir)) == "final" and os.path.isfile(run_cfg):
        try:
            with open(run_cfg, encoding="utf-8") as fh:
                return {"config": json.load(fh)}, run_cfg
        except (OSError, ValueError) as e:
            raise ValueError(f"{run_cfg}: unreadable run configuration ({e})") from None
    return None, "none"

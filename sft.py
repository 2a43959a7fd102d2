"""The SFT stage (appendix): the paper's trajectory filters, its conversions and tool-output masking.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements the SFT recipe of the appendix ("Training configuration"): a teacher writes trajectories in
the four-stage scaffold (§3.2); trajectories that fail one of four filters are dropped; the rest are
converted and trained as single-turn ChatML examples with the loss on the assistant's own tokens and
the `<tool_output>` spans masked. The toy SFT (toy/sft.py) and the full SFT (backends/sft/zero3.py)
both use the functions here, so both drop and convert the same way.

Glossary: a trajectory is a list of *segments* (is_env, text): text the teacher wrote (is_env False)
and text the environment inserted (tool outputs, is_env True), in order; their concatenation is the
assistant turn.

Filters (PAPER, appendix; `sft_filter` returns the reason, or None to keep)
  (1) "no_closing_answer"                    no closing </answer>;
  (2) "non_final_turn_without_valid_call"    a non-final turn (a segment followed by a tool output)
                                             that does not end in a valid call;
  (3) "missing_required_tag"                 a required XML block missing (REQUIRED_TAGS, plus
                                             <state_evaluation> when a tool was called);
  (4) "consecutive_tool_errors"              two or more consecutive tool errors.
Conversions (PAPER, appendix; `convert_segments`, `to_chatml`)
  - `<scratchpad>` becomes `<think>` (`scratchpad_to_think`);
  - tool names are normalised (`normalise_tool_names`: TOOL_ALIASES -> "google_search");
  - each trajectory becomes one single-turn ChatML example (system, user, assistant).
Loss (`encode_trajectory`): per example, mask_t = 1 on tokens the teacher wrote (and the closing
<|im_end|>), 0 on the prompt and on tool outputs; SFT loss = sum_t mask_t (-log pi(x_t | x_<t)) /
sum_t mask_t over the optimizer step.

Deviations from the paper
1. Conversions run *before* the filters: a call written under a DR Tulu tool name
   (`snippet_search`, `browse_webpage`) is normalised first and then counts as a valid call for
   filter (2). The paper lists the filters first and does not say which order it used.
2. Tool-name normalisation maps every search-like name onto our one tool, `google_search`
   (TOOL_ALIASES); `browse_webpage` (DR Tulu fetches a URL) becomes a search for the URL. We have no
   page-fetching tool; see docs/full_mode.md, "The SFT stage", for what that costs.
3. An example longer than the maximum length (16,384 tokens) is dropped and counted, not truncated
   (a truncated trajectory would teach an answer without its end).

Launch lines (docs/full_mode.md, "The SFT stage"). The commands live in backends/ (this module is
imported by the toy SFT, and a command here would import the ZeRO-3 engine, whose configuration
imports the toy SFT: an import cycle):
    python -m backends.sft.teacher --queries queries.jsonl --out data/teacher.jsonl [--dry-run]
    deepspeed --num_gpus 8 --module backends.sft.zero3 --data data/teacher.jsonl \
        --model /models/Qwen3-8B --out /ckpt/qwen3-8b-sft
    python -m backends.sft.zero3 --data data/teacher.jsonl --model /models/Qwen3-8B --out x --dry-run
"""
from __future__ import annotations

import re
from typing import Any, Sequence

from scaffold import CALL_OPEN, SYSTEM_PROMPT, build_messages

Segment = tuple[bool, str]  # (is_env, text): policy-written text or environment-inserted text

# ----------------------------------------------------------------------------------------------------
# Filters


_VALID_CALL = re.compile(r'<call_tool\s+name="google_search"\s*>\s*\S.*?</call_tool>\s*$', re.S)
REQUIRED_TAGS = ("<structured_plan>", "</structured_plan>", "<review>", "</review>", "<answer>")
UNSTRUCTURED_REQUIRED_TAGS = ("<answer>",)  # ours: the unstructured scaffold has no other block
FILTER_REASONS = ("no_closing_answer", "non_final_turn_without_valid_call", "missing_required_tag",
                  "consecutive_tool_errors")


def sft_filter(segments: Sequence[Segment], scaffold: str = "structured") -> str | None:
    """The paper's four SFT filters. Returns the reason for dropping, or None to keep.

    The required tags of filter (3) are the scaffold's: REQUIRED_TAGS plus <state_evaluation> after
    a tool output (structured), or UNSTRUCTURED_REQUIRED_TAGS ("unstructured").

    Reasons: "no_closing_answer", "non_final_turn_without_valid_call", "missing_required_tag",
    "consecutive_tool_errors".
    """
    text = "".join(t for _, t in segments)
    if "</answer>" not in text:
        return "no_closing_answer"
    for j, (is_env, t) in enumerate(segments):
        if not is_env and j + 1 < len(segments) and segments[j + 1][0]:
            if not _VALID_CALL.search(t):
                return "non_final_turn_without_valid_call"
    if scaffold == "structured":
        tags = REQUIRED_TAGS + (("<state_evaluation>",) if any(e for e, _ in segments) else ())
    else:
        tags = UNSTRUCTURED_REQUIRED_TAGS
    if any(tag not in text for tag in tags):
        return "missing_required_tag"
    run = 0
    for is_env, t in segments:
        if is_env:
            run = run + 1 if t.lstrip().startswith("<tool_output>error:") else 0
            if run >= 2:
                return "consecutive_tool_errors"
    return None


# ----------------------------------------------------------------------------------------------------
# Conversions

# PAPER: "tool names normalised (e.g. google_search)". Every name a teacher or DR Tulu's SFT data uses
# for a search maps onto our one tool (deviation 2). A name not listed stays as written, so a
# trajectory that calls an unknown tool still fails filter (2).
TOOL_ALIASES = {
    "google_search": "google_search", "googlesearch": "google_search", "google": "google_search",
    "search": "google_search", "web_search": "google_search", "websearch": "google_search",
    "serper_search": "google_search", "snippet_search": "google_search",
    "browse_webpage": "google_search",
}
_CALL_NAME = re.compile(r'<call_tool\s+name\s*=\s*["\']([^"\']*)["\']\s*>')
_SCRATCH = re.compile(r"<(/?)\s*scratchpad\s*>", re.I)


def normalise_tool_names(text: str) -> str:
    """Rewrite every `<call_tool name="X">` whose X (case-folded, spaces and hyphens as
    underscores) is in TOOL_ALIASES to the canonical `<call_tool name="google_search">` (CALL_OPEN);
    other calls are left as written. Never raises for a str."""

    def one(m: re.Match) -> str:
        key = re.sub(r"[\s\-]+", "_", m.group(1).strip().lower())
        return CALL_OPEN if TOOL_ALIASES.get(key) == "google_search" else m.group(0)

    return _CALL_NAME.sub(one, text)


def scratchpad_to_think(text: str) -> str:
    """PAPER: reasoning tags `<scratchpad>` / `</scratchpad>` become `<think>` / `</think>`."""
    return _SCRATCH.sub(lambda m: f"<{m.group(1)}think>", text)


def convert_segments(segments: Sequence[Segment]) -> list[Segment]:
    """Both text conversions on the teacher's own segments; tool outputs are left as the environment
    wrote them. Returns a new list with the same number of segments."""
    return [(e, t if e else normalise_tool_names(scratchpad_to_think(t))) for e, t in segments]


def to_chatml(query: str, segments: Sequence[Segment], system: str = SYSTEM_PROMPT) -> dict:
    """PAPER: one single-turn ChatML example {"messages": [system, user, assistant]}; the assistant
    content is the whole trajectory, tool outputs inline (sft_segments splits it back)."""
    msgs = build_messages(query, (), system)
    return {"messages": msgs + [{"role": "assistant", "content": "".join(t for _, t in segments)}]}


def filter_and_convert(trajectories: Sequence[dict], scaffold: str = "structured",
                       system: str = SYSTEM_PROMPT) -> tuple[list[dict], dict]:
    """Teacher trajectories -> (ChatML examples, stats). Each trajectory is a dict with "query" (str)
    and "segments" (list of [is_env, text]); conversions first (deviation 1), then `sft_filter`.
    stats: "trajectories", "kept", and one count per filter reason (0 when none dropped). A record
    without a usable query or segments is counted under "malformed", never raised."""
    stats = {"trajectories": 0, "kept": 0, "malformed": 0, **{r: 0 for r in FILTER_REASONS}}
    out = []
    for tr in trajectories:
        stats["trajectories"] += 1
        try:
            q = tr["query"]
            segs = [(bool(e), str(t)) for e, t in tr["segments"]]
            if not isinstance(q, str) or not q.strip() or not segs:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            stats["malformed"] += 1
            continue
        segs = convert_segments(segs)
        why = sft_filter(segs, scaffold)
        if why:
            stats[why] += 1
            continue
        stats["kept"] += 1
        out.append(to_chatml(q, segs, system))
    return out, stats


# ----------------------------------------------------------------------------------------------------
# Tokens and the loss mask


def encode_trajectory(tok, example: dict, max_len: int | None = None) -> tuple[list[int], list[int]] | None:
    """Token ids and loss mask (0/1 ints, same length) of one ChatML example from `to_chatml`.

    The prompt (system, user) is the tokenizer's chat template with the generation prompt (mask 0);
    the assistant turn is split at its tool outputs (sft_segments) and tokenised
    segment by segment, as the rollout engine appends them: teacher text mask 1, tool outputs mask 0
    (PAPER: span masking of <tool_output>); "<|im_end|>" closes the turn with mask 1. Returns None
    when max_len is given and the example is longer (deviation 3). Raises ValueError for an example
    that validate_messages refuses.
    """
    prompt, segments = sft_example(example["messages"])
    ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    ids = list(ids)
    mask = [0] * len(ids)
    for is_env, text in list(segments) + [(False, "<|im_end|>")]:
        seg = tok.encode(text, add_special_tokens=False)
        ids += seg
        mask += [0 if is_env else 1] * len(seg)
    if max_len is not None and len(ids) > max_len:
        return None
    return ids, mask

# ----------------------------------------------------------------------------------------------------
# One SFT example: chat messages whose last assistant turn is split at its tool outputs (masked)

ROLES = ("system", "user", "assistant", "tool")
TOOL_OPEN, TOOL_CLOSE = "<tool_output>", "</tool_output>"


def validate_messages(messages: Any, index: int = -1) -> list[dict]:
    """Check one SFT example: a list of {role, content} dicts (roles in ROLES, content str), with at
    least one user turn and the last turn from the assistant. Returns the list. Raises ValueError
    naming the row index, the message position and the field."""
    where = f"row {index}"
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: `messages` must be a non-empty list")
    for j, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"{where}: messages[{j}] must be an object with `role` and `content`")
        if m.get("role") not in ROLES:
            raise ValueError(f"{where}: messages[{j}].role must be one of {ROLES}, got {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: messages[{j}].content must be a string")
    if messages[-1]["role"] != "assistant" or not messages[-1]["content"].strip():
        raise ValueError(f"{where}: the last message must be a non-empty assistant turn")
    if not any(m["role"] == "user" for m in messages[:-1]):
        raise ValueError(f"{where}: no user turn before the assistant turn")
    return messages


_SPAN = re.compile(r"\n?" + re.escape(TOOL_OPEN) + r".*?(?:" + re.escape(TOOL_CLOSE) + r"\n?|\Z)",
                   re.S)


def sft_segments(text: str) -> list[tuple[bool, str]]:
    """Split an assistant message into sft.Segment pairs (is_env, text) at <tool_output> spans.

    Environment segments are "\\n?<tool_output>...</tool_output>\\n?" (deviation 1; an unclosed span
    runs to the end); everything else is policy text. The texts concatenate to `text` exactly, and
    no segment is empty. Raises TypeError if text is not a str.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    segs: list[tuple[bool, str]] = []
    pos = 0
    for m in _SPAN.finditer(text):
        if m.start() > pos:
            segs.append((False, text[pos : m.start()]))
        segs.append((True, m.group(0)))
        pos = m.end()
    if pos < len(text):
        segs.append((False, text[pos:]))
    return segs


def sft_example(messages: Sequence[dict], index: int = -1) -> tuple[list[dict], list[tuple[bool, str]]]:
    """(prompt messages, segments) of one SFT example: the prompt is everything before the last
    assistant turn, the segments split that turn (sft_segments). Feed both to
    sft.encode_example(tok, prompt, segments): tool outputs get loss mask 0 (PAPER: span masking of
    <tool_output>). Raises ValueError as validate_messages."""
    msgs = validate_messages(list(messages), index)
    return list(msgs[:-1]), sft_segments(msgs[-1]["content"])

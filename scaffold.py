"""The rubric-guided scaffold (§3.2): prompt, stage grammar, parser, and the multi-turn rollout engine.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements §3.1 (trajectory tau = (a_1, o_1, ..., a_T, o_T), a_t ~ pi_theta(. | h_t)) and §3.2 (the
four tagged stages Plan / Research / Review / Answer, at most 10 tool calls).

Stage grammar (one assistant turn; tags may be single added tokens or plain text, the parser works on
text either way):

    <structured_plan><analysis>..</analysis><rubrics>..</rubrics><research_plan>..</research_plan>
    </structured_plan>                                                          -> Plan      (k = 0)
    <call_tool name="google_search">query</call_tool>
    <tool_output>..inserted by the environment..</tool_output>
    <state_evaluation>..</state_evaluation>          (repeated)                 -> Research  (k = 1)
    <review><rubrics_review>..</rubrics_review><writing_plan>..</writing_plan></review> -> Review (k = 2)
    <answer>.. cited with [1], [2] ..</answer>                                  -> Answer    (k = 3)

The unstructured scaffold (the paper's scaffold ablation, Fig. 6a-c; `rollout.scaffold =
"unstructured"`): a ReAct-like agent with no Plan, no Review and no self-written rubrics:

    <think>..</think>                                 (optional, any number)
    <call_tool name="google_search">query</call_tool>
    <tool_output>..inserted by the environment..</tool_output>      (repeated)
    <answer>.. cited with [1], [2] ..</answer>

`parse_unstructured` reads it; having no stages, the whole response is the Answer block (K = 1, see
there), and the loss mask is set by the engine exactly as for the structured scaffold.

Glossary: n rollouts per query form a *group*; B_{i,k} is the *stage block* of rollout i in stage k
(the tokens with stage id k); the loss mask is 1 on tokens the policy sampled and 0 on tokens the
environment inserted (tool outputs), so tool outputs get no gradient (§3.3, "masked").

What the functions compute
- `parse_response(text, env_spans)`: text -> stage boundaries and stage texts; never raises.
- `parse_unstructured(text, env_spans)`: the same for the unstructured scaffold; never raises.
- `stage_of_chars` / `assign_stage_ids`: the stage id of every character / token.
- `RolloutEngine.run`: batched multi-turn generation through a `Sampler`, token-in/token-out.
- `autocast(precision)` / `pad_multiple(precision)`: the context of the toy model's forwards (float32,
  or bfloat16 autocast) and the length multiple its padded batches round up to (samplers, the torch
  engine and the SFT warm start use both).
- `intra_op_threads(n)`: the torch thread count the samplers decode on (settings `sample_threads`).

How the parser places text it cannot place (documented rule, tested by fuzzing)
Stage boundaries are the *first* occurrence of each opening marker:
    Research starts at the end of the first `</structured_plan>`, or at the first `<call_tool`,
             `<tool_output>` or `<state_evaluation>`, whichever comes first;
    Review   starts at the first `<review>` (or `<rubrics_review>` / `<writing_plan>` if `<review>`
             is missing);
    Answer   starts at the first `<answer>`.
Each boundary is then lowered to at most the next one (b_research <= b_review <= b_answer), so stage
ids are monotone Plan <= Research <= Review <= Answer over the response by construction. Text before
the first marker is Plan; text between blocks belongs to the stage that was last opened; a missing
stage is an empty block; a tag of an earlier stage that appears after a later stage opened (out of
order, repeated) belongs to the later stage. Unclosed blocks run to the next boundary or the end.

Safety: only the environment inserts tool outputs. The engine records the character spans it
inserted (`env_spans`); any `<tool_output>` the policy writes itself is *forged*: it is counted,
replaced by a marker in `Rollout.judge_text`, and never becomes evidence (citations resolve only
against `Rollout.evidence`, which the environment fills). Forged means any spelling a reader would
take for the tag (other case, spaces, attributes, fullwidth or look-alike letters, zero-width
characters) and a closing tag on its own (`forged_spans`).

Deviations from the paper
1. Tool outputs are numbered snippets "[h] title | text" with per-rollout handles h = 1, 2, ...
   (see toy/world.py); the paper's web snippets carry URLs.
2. An 11th tool call is not executed: the environment answers it with a refusal inside
   <tool_output> and lets the policy go on to Review and Answer (the paper only states the cap).
3. Fault tolerance, not in the paper: a failing tool yields "error: search failed", a tool call
   that exceeds the per-call timeout yields "error: search timed out" (the call is abandoned in its
   worker thread), and after the rollout deadline every further call is refused with an error; in
   each case the rollout goes on to Review and Answer within its token budget (`RolloutEngine`).
4. The unstructured scaffold's tags and prompt are ours (think / call / answer, as a ReAct agent
   writes them); the paper compares against an unstructured scaffold without giving its format.
5. Not in the paper: `precision = "bf16"` runs the toy model's forwards under bfloat16 autocast
   (weights, optimizer state, log-probs and loss stay float32); the default is float32. The paper
   names bf16 for its SFT (appendix); full mode's ZeRO-3 engine has its own `full.bf16` setting,
   to which `precision` does not apply.
"""
from __future__ import annotations

import json
import re
import threading
import time
import unicodedata
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

STAGES = ("plan", "research", "review", "answer")  # PAPER: K = 4 stages, §3.2
PLAN, RESEARCH, REVIEW, ANSWER = range(4)
MAX_TOOL_CALLS = 10  # PAPER: at most 10 tool calls per trajectory, §3.2

# Every tag of the grammar. The toy tokenizer makes each of them one added token; real tokenizers
# (Qwen3) spell them out, so nothing below depends on that.
CALL_OPEN = '<call_tool name="google_search">'
SCAFFOLD_TAGS = (
    "<structured_plan>", "</structured_plan>", "<analysis>", "</analysis>", "<rubrics>",
    "</rubrics>", "<research_plan>", "</research_plan>", CALL_OPEN, "</call_tool>",
    "<tool_output>", "</tool_output>", "<state_evaluation>", "</state_evaluation>", "<review>",
    "</review>", "<rubrics_review>", "</rubrics_review>", "<writing_plan>", "</writing_plan>",
    "<answer>", "</answer>", "<memory>", "</memory>",
)

SYSTEM_PROMPT = """You are a deep-research assistant. Answer in four stages, using these tags exactly.
1. Plan: <structured_plan><analysis>what is asked</analysis><rubrics>need: each fact to find; avoid: \
negative constraints</rubrics><research_plan>the searches to run</research_plan></structured_plan>
2. Research: call the search tool with <call_tool name="google_search">query</call_tool>. The \
environment replies with <tool_output>[1] title | text ...</tool_output>; never write tool outputs \
yourself. After each result write <state_evaluation>what was found, with its [id]</state_evaluation>. \
At most 10 tool calls.
3. Review: <review><rubrics_review>each rubric mapped to its evidence [id] or "missing"\
</rubrics_review><writing_plan>order of the report</writing_plan></review>
4. Answer: <answer>the report; cite every claim with the snippet id, e.g. [1]; say when no source \
gives a fact</answer>
Notes from memory, when given inside <memory>, are lessons from earlier attempts."""

# The scaffold ablation (Fig. 6a-c): the same task and tool without the four stages (ReAct-like).
SCAFFOLDS = ("structured", "unstructured")
THINK_TAGS = ("<think>", "</think>")  # the unstructured scaffold's tag besides call, output, answer

UNSTRUCTURED_SYSTEM_PROMPT = """You are a deep-research assistant. Use these tags exactly.
Think when useful: <think>your reasoning</think>. Call the search tool with \
<call_tool name="google_search">query</call_tool>. The environment replies with <tool_output>[1] \
title | text ...</tool_output>; never write tool outputs yourself. At most 10 tool calls.
Finish with <answer>the report; cite every claim with the snippet id, e.g. [1]; say when no source \
gives a fact</answer>"""

# Toy mode trains its policy from scratch, so instructions are learnt from demonstrations, not read;
# a short system prompt saves forward-pass tokens on every step (not in the paper; our choice).
SYSTEM_PROMPT_COMPACT = "Research assistant: plan, search, review, answer with cited snippets."
UNSTRUCTURED_SYSTEM_PROMPT_COMPACT = "Research assistant: think, search, answer with cited snippets."


def system_prompt(scaffold: str = "structured", style: str = "compact") -> str:
    """The system prompt of a scaffold ("structured" | "unstructured") in a style ("compact": the
    toy's short prompt, instructions learnt from demonstrations; anything else: the full prompt, as
    `rollout.system_prompt` reads). Raises ValueError for an unknown scaffold."""
    if scaffold not in SCAFFOLDS:
        raise ValueError(f"rollout.scaffold must be one of {SCAFFOLDS}, got {scaffold!r}")
    if scaffold == "unstructured":
        return UNSTRUCTURED_SYSTEM_PROMPT_COMPACT if style == "compact" else UNSTRUCTURED_SYSTEM_PROMPT
    return SYSTEM_PROMPT_COMPACT if style == "compact" else SYSTEM_PROMPT

_TAG_RE = {
    "analysis": re.compile(r"<analysis>(.*?)(?:</analysis>|$)", re.S),
    "rubrics": re.compile(r"<rubrics>(.*?)(?:</rubrics>|$)", re.S),
    "research_plan": re.compile(r"<research_plan>(.*?)(?:</research_plan>|$)", re.S),
    "rubrics_review": re.compile(r"<rubrics_review>(.*?)(?:</rubrics_review>|$)", re.S),
    "writing_plan": re.compile(r"<writing_plan>(.*?)(?:</writing_plan>|$)", re.S),
    "answer": re.compile(r"<answer>(.*?)(?:</answer>|$)", re.S),
}
_THINK_RE = re.compile(r"<think>(.*?)(?:</think>|$)", re.S)
_STATE_EVAL_RE = re.compile(r"<state_evaluation>(.*?)(?:</state_evaluation>|$)", re.S)
_CALL_RE = re.compile(r'<call_tool\s+name="([^"]*)"\s*>(.*?)</call_tool>', re.S)
_TOOL_OUT_RE = re.compile(r"<tool_output>.*?(?:</tool_output>|$)", re.S)
_CITE_RE = re.compile(r"\[(\d{1,3})\]")

# Forged tool outputs in any spelling. The detector reads a *view* of the text (`_tag_view`): NFKC
# (fullwidth and mathematical forms become ASCII), zero-width / format characters and combining
# marks dropped, and the Cyrillic / Greek look-alikes of the tag's letters folded to Latin; then a
# case-insensitive tag pattern that tolerates spaces, separators and attributes. The view is used
# only to find spans; the text itself is never rewritten except where a forged span is replaced.
_LOOKALIKES = {
    "<": "\u2039\u27e8\u3008\u02c2",  # single angle quotation mark, math / CJK angle bracket, arrowhead
    ">": "\u203a\u27e9\u3009\u02c3",
    "/": "\u2044\u2215",  # fraction slash, division slash
    "t": "\u0442\u03c4",  # Cyrillic te, Greek tau (capitals fold to these after NFKC + lower)
    "o": "\u043e\u03bf\u0585",  # Cyrillic o, Greek omicron, Armenian oh
    "l": "\u04cf\u03b9\u0131",  # Cyrillic palochka, Greek iota, dotless i
    "u": "\u03c5\u057d\u1d1c",  # Greek upsilon, Armenian seh, small capital u
    "p": "\u0440\u03c1",  # Cyrillic er, Greek rho
}
_FOLD = str.maketrans({c: latin for latin, chars in _LOOKALIKES.items() for c in chars})
_TAG_TAIL = r"\s*tool[\s_.\-]*output\b[^<>]*>"  # the name, then anything up to the bracket
# A block (closed or not), or a closing tag on its own together with the text since the previous
# tag, which it passes off as tool output (`(?<![^<>])`: starts right after a tag or at the start).
_FORGED_RE = re.compile(rf"<{_TAG_TAIL}.*?(?:<\s*/{_TAG_TAIL}|$)|(?<![^<>])[^<>]*<\s*/{_TAG_TAIL}",
                        re.S | re.I)


def build_user_message(query: str, bank_items: Sequence[str] = ()) -> str:
    """The user turn: the query, then retrieved rubric-bank items (§3.4-3.5) inside <memory>."""
    items = [s.strip() for s in bank_items if s and s.strip()]
    if not items:
        return query
    return query + "\n<memory>" + "\n".join(f"- {s}" for s in items) + "</memory>"


def build_messages(query: str, bank_items: Sequence[str] = (), system: str = SYSTEM_PROMPT) -> list:
    """ChatML messages (system, user) for one rollout prompt."""
    return [{"role": "system", "content": system},
            {"role": "user", "content": build_user_message(query, bank_items)}]


def format_tool_output(results, first_handle: int) -> str:
    """Environment text for one tool result: "\\n<tool_output>[h] title | text\\n...</tool_output>\\n".

    `results` is a list of SearchResult; handles count up from `first_handle` (int >= 1).
    """
    if not results:
        body = "no results"
    else:
        body = "\n".join(f"[{first_handle + j}] {r.title} | {r.text}" for j, r in enumerate(results))
    return f"\n<tool_output>{body}</tool_output>\n"


def format_tool_error(message: str) -> str:
    """Environment text for a failed, refused or timed-out tool call (the rollout goes on)."""
    return f"\n<tool_output>error: {message}</tool_output>\n"


# ----------------------------------------------------------------------------------------------------
# Parser


@dataclass
class ParsedResponse:
    """Stage structure of one response text. `bounds` = (b_research, b_review, b_answer) char offsets,
    monotone; stage k covers text[bounds[k-1]:bounds[k]] (b_plan = 0, b_end = len(text))."""

    bounds: tuple[int, int, int]
    stage_texts: tuple[str, str, str, str]
    fields: dict[str, str]
    state_evaluations: list[str]
    calls: list[tuple[str, str]]  # (tool name, query) as written by the policy
    citations: list[int]  # handles cited inside <answer>
    has_stage: tuple[bool, bool, bool, bool]
    closed: dict[str, bool]
    forged_tool_outputs: int
    scaffold: str = "structured"  # which grammar parsed it (SCAFFOLDS)

    @property
    def well_formed(self) -> bool:
        """Structured: all four stages present, their blocks closed, the answer closed.
        Unstructured: an answer, closed, and every <think> closed."""
        if self.scaffold == "unstructured":
            return self.has_stage[ANSWER] and all(self.closed.values())
        return all(self.has_stage) and all(self.closed.values())

    @property
    def answer_defect(self) -> str:
        """Why the answer block is malformed beyond `well_formed` ("" if it is not): a tool call
        written after <answer> opened, or a second <answer> (tool outputs are not read). Ours."""
        ans = _strip_tool_outputs(self.stage_texts[ANSWER])
        ans = ans[ans.find("<answer>"):] if "<answer>" in ans else ""
        if "<call_tool" in ans:
            return "tool call inside the answer"
        return "second answer block" if ans.count("<answer>") > 1 else ""

    @property
    def well_formed_strict(self) -> bool:
        """`well_formed` and no `answer_defect` (the toy judge's judge.toy_fixes "answer_block")."""
        return self.well_formed and not self.answer_defect


def _first(text: str, needles: Sequence[str], end: bool = False) -> int:
    best = len(text)
    for nd in needles:
        p = text.find(nd)
        if p >= 0:
            best = min(best, p + (len(nd) if end else 0))
    return best


def parse_response(text: str, env_spans: Sequence[tuple[int, int]] = ()) -> ParsedResponse:
    """Split a response into its four stage blocks (§3.2). Never raises, for any input string.

    Args: text (str) the decoded response; env_spans: (start, end) char spans the environment inserted
    (tool outputs). Tool output the policy wrote outside these spans, in any spelling
    (`forged_spans`), is counted in `forged_tool_outputs`.
    Returns a ParsedResponse; see the module docstring for how unplaceable text is assigned.
    """
    if not isinstance(text, str):
        text = str(text)
    n = len(text)
    b1 = min(_first(text, ["</structured_plan>"], end=True),
             _first(text, ["<call_tool", "<tool_output>", "<state_evaluation>"]))
    b2 = _first(text, ["<review>"])
    if b2 == n:
        b2 = _first(text, ["<rubrics_review>", "<writing_plan>"])
    b3 = _first(text, ["<answer>"])
    b2 = min(b2, b3)
    b1 = min(b1, b2)
    # (b_research, b_review, b_answer): monotone by construction.
    spans = [(0, b1), (b1, b2), (b2, b3), (b3, n)]
    st = tuple(text[a:b] for a, b in spans)

    fields = {}
    for key, rx in _TAG_RE.items():
        src = st[PLAN] if key in ("analysis", "rubrics", "research_plan") else (
            st[REVIEW] if key in ("rubrics_review", "writing_plan") else st[ANSWER])
        m = rx.search(src)
        fields[key] = m.group(1).strip() if m else ""
    research = st[RESEARCH]
    clean_research = _strip_tool_outputs(research)
    evals = [m.group(1).strip() for m in _STATE_EVAL_RE.finditer(clean_research)]
    calls = [(m.group(1), m.group(2).strip()) for m in _CALL_RE.finditer(clean_research)]
    cites = [int(c) for c in _CITE_RE.findall(fields["answer"])]
    has = ("<structured_plan>" in st[PLAN], bool(calls) or "<state_evaluation>" in research,
           "<review>" in st[REVIEW] or "<rubrics_review>" in st[REVIEW], "<answer>" in st[ANSWER])
    closed = {"structured_plan": "</structured_plan>" in st[PLAN],
              "review": "</review>" in st[REVIEW], "answer": "</answer>" in st[ANSWER]}
    forged = len(forged_spans(text, env_spans))
    return ParsedResponse((b1, b2, b3), st, fields, evals, calls, cites, has, closed, forged)


def parse_unstructured(text: str, env_spans: Sequence[tuple[int, int]] = ()) -> ParsedResponse:
    """Parse a response of the unstructured scaffold (the scaffold ablation, Fig. 6a-c): optional
    <think> blocks, tool calls and their environment outputs, then <answer>. Never raises.

    Args: as `parse_response`. Returns a ParsedResponse with scaffold = "unstructured":
    - stage ids: the scaffold has no stages, so the whole response is one block, the Answer block:
      bounds = (0, 0, 0), stage_texts = ("", "", "", text), and every token gets stage id ANSWER (3).
      The terminal-score advantage (ss_grpo.ARMS "baseline_rl": A_i from R_{i,Answer}, the same
      in every column of A) then gives every sampled token the one advantage A_i (K = 1 GRPO).
    - calls and <think> texts (fields["think"], one per line) are read before the first <answer>
      with tool-output blocks stripped, as the structured parser reads the Research stage;
      fields["answer"] and citations exactly as `parse_response` reads them (from the first
      <answer>, up to </answer> or the end); the structured fields are "".
    - has_stage = (False, False, False, answer opened); closed = {"think": every <think> closed,
      "answer": </answer> present}; well_formed = answer opened and everything closed.
    - forged_tool_outputs as `parse_response` (the loss mask is the engine's, not the parser's:
      tool outputs have mask 0 for both scaffolds).
    """
    if not isinstance(text, str):
        text = str(text)
    b = _first(text, ["<answer>"])
    before, block = _strip_tool_outputs(text[:b]), text[b:]
    m = _TAG_RE["answer"].search(block)
    fields = {key: "" for key in _TAG_RE}
    fields["answer"] = m.group(1).strip() if m else ""
    fields["think"] = "\n".join(t.group(1).strip() for t in _THINK_RE.finditer(before))
    calls = [(c.group(1), c.group(2).strip()) for c in _CALL_RE.finditer(before)]
    cites = [int(c) for c in _CITE_RE.findall(fields["answer"])]
    has = (False, False, False, "<answer>" in block)
    closed = {"think": before.count("<think>") <= before.count("</think>"),
              "answer": "</answer>" in block}
    forged = len(forged_spans(text, env_spans))
    return ParsedResponse((0, 0, 0), ("", "", "", text), fields, [], calls, cites, has, closed,
                          forged, "unstructured")


PARSERS = {"structured": parse_response, "unstructured": parse_unstructured}


def _strip_tool_outputs(s: str) -> str:
    return _TOOL_OUT_RE.sub("", s)


def stage_of_chars(parsed: ParsedResponse, n_chars: int) -> list[int]:
    """Stage id (0..3) of every character, from the parsed boundaries; monotone non-decreasing."""
    b1, b2, b3 = parsed.bounds
    return [0 if c < b1 else 1 if c < b2 else 2 if c < b3 else 3 for c in range(n_chars)]


def assign_stage_ids(token_char_starts: Sequence[int], parsed: ParsedResponse) -> list[int]:
    """Stage id of each token = stage of its first character (a token straddling a boundary goes to
    the stage where it starts). token_char_starts: non-decreasing char offsets, one per token."""
    b1, b2, b3 = parsed.bounds
    return [0 if c < b1 else 1 if c < b2 else 2 if c < b3 else 3 for c in token_char_starts]


def _tag_view(text: str) -> tuple[str, list[int] | None]:
    """The text as the forged-tag detector reads it (see `_LOOKALIKES`), and for each of its
    characters the index of the character of `text` it comes from (None: the view is `text`)."""
    if text.isascii():
        return text, None  # nothing to fold; the pattern ignores case
    chars, where = [], []
    for i, ch in enumerate(text):
        for c in unicodedata.normalize("NFKC", ch).lower().translate(_FOLD):
            if unicodedata.category(c) not in ("Cf", "Mn"):  # zero-width, format, combining
                chars.append(c)
                where.append(i)
    return "".join(chars), where


def forged_spans(text: str, env_spans: Sequence[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """(start, end) char spans of `text` where the policy wrote tool output itself (§3.2: only the
    environment inserts tool outputs).

    A span is a tool-output block in any spelling (case, spaces, attributes, separators, fullwidth,
    look-alike letters, zero-width characters; closed or running to the end of its stretch), or a
    closing tag on its own with the text since the previous tag. Only the text outside `env_spans`
    (the environment's insertions, (start, end) char offsets, clipped to the text) is searched, so a
    forged block ends where an environment insertion begins and never covers one. Sorted, disjoint;
    never raises.
    """
    n = len(text)
    cuts = sorted((max(0, a), min(n, b)) for a, b in env_spans if min(n, b) > max(0, a))
    out, pos = [], 0
    for a, b in cuts + [(n, n)]:
        if a > pos:  # a stretch the policy wrote
            view, where = _tag_view(text[pos:a])
            for m in _FORGED_RE.finditer(view):
                s, e = (m.start(), m.end()) if where is None else (where[m.start()], where[m.end() - 1] + 1)
                out.append((pos + s, pos + e))
        pos = max(pos, b)
    return out


def neutralise_forged(text: str, env_spans: Sequence[tuple[int, int]]) -> str:
    """The response as the judge reads it: policy-written tool-output blocks and closing tags, in
    any spelling (`forged_spans`), are replaced by a marker, so forged evidence is visible as forged
    and can never be read as a tool result. Environment insertions are left as they are."""
    out, last = [], 0
    for a, b in forged_spans(text, env_spans):
        out.append(text[last:a])
        out.append("[forged tool output removed]")
        last = b
    out.append(text[last:])
    return "".join(out)


# ----------------------------------------------------------------------------------------------------
# Sampler interface (HF generate in toy mode; vLLM implements the same interface in full mode)


class Sampler(Protocol):
    """Continues a batch of token-id prompts. Token-in/token-out: the returned ids are exactly the
    sampled ids, up to and including the first stop (a stop token id, or the token that completes a
    stop string); never decoded and re-encoded.

    generate(prompts: list[list[int]], max_new_tokens: list[int], temperature: float)
        -> list[list[int]] (one list of new ids per prompt, len <= max_new_tokens[i])
    """

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int],
                 temperature: float) -> list[list[int]]: ...

    # What the training loop calls besides generate (HFSampler: no-ops; backends/scale/vllm_sampler.py's
    # VLLMSampler: a separate engine with its own weights and seeds).
    stats: dict  # counters for the metrics, e.g. {"syncs": ...}; empty when there is nothing to count

    def sync_weights(self, named_params, copy: bool = True) -> None: ...  # pi_theta's new weights
    def reseed(self, seed: int) -> None: ...  # per-step sampling seed (torch's global RNG otherwise)
    def close(self) -> None: ...


# ----------------------------------------------------------------------------------------------------
# The RL row schema (DR Tulu): a query with its initial rubrics, parsed from rows of the toy world and
# of real data alike (backends/run/data.py reads the rows)


@dataclass
class Query:
    """A parsed RL row: the question, its initial rubrics and (toy only) machine-checkable truth."""

    query: str
    rubrics: list[dict]
    toy: dict | None = None
    row_index: int = -1

    @property
    def facts(self) -> list[dict]:
        return (self.toy or {}).get("facts", [])


def parse_row(row: dict, index: int = -1) -> Query:
    """Parse one DR Tulu-schema row. Raises ValueError naming the field and row index when the row
    does not fit: `messages` must be a list of {role, content} dicts ending with the user turn
    (earlier system turns are allowed, as in some RL datasets), `ground_truth` must be a JSON string (or
    dict) with a non-empty `query` and a non-empty `rubrics` list of {title, description, weight}."""
    where = f"row {index}"
    msgs = row.get("messages") if isinstance(row, dict) else None
    if (not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs)
            or msgs[-1].get("role") != "user"):
        raise ValueError(f"{where}: `messages` must be a list ending with one user turn")
    gt = row.get("ground_truth")
    if isinstance(gt, str):
        try:
            gt = json.loads(gt)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: `ground_truth` is not valid JSON ({e})") from None
    if not isinstance(gt, dict):
        raise ValueError(f"{where}: `ground_truth` must be a JSON object")
    query = gt.get("query") or msgs[-1].get("content", "")
    if not isinstance(query, str) or not query.strip():
        raise ValueError(f"{where}: empty query")
    rubrics = gt.get("rubrics")
    if not isinstance(rubrics, list) or not rubrics:
        raise ValueError(f"{where}: `ground_truth.rubrics` must be a non-empty list")
    for j, r in enumerate(rubrics):
        if not isinstance(r, dict) or not str(r.get("description", "")).strip():
            raise ValueError(f"{where}: rubric {j} has no `description`")
        w = r.get("weight", 1.0)
        if not isinstance(w, (int, float)):
            raise ValueError(f"{where}: rubric {j} `weight` must be a number")
    return Query(query.strip(), rubrics, gt.get("toy"), index)


def load_rows(rows: Iterable[dict]) -> list[Query]:
    """Parse a dataset of rows; raises ValueError on an empty dataset or the first bad row."""
    out = [parse_row(r, i) for i, r in enumerate(rows)]
    if not out:
        raise ValueError("dataset is empty: no RL rows to train on")
    return out


# ----------------------------------------------------------------------------------------------------
# Rollouts


@dataclass
class ToolCall:
    """One tool call as the environment executed it. `handles` are the citation handles it issued."""

    name: str
    query: str
    results: list  # list[SearchResult]
    handles: list[int]
    error: str = ""
    refused: bool = False
    latency_s: float = 0.0
    timed_out: bool = False


@dataclass
class Rollout:
    """One trajectory tau (§3.1) with everything the judge and SS-GRPO need.

    prompt_ids: list[int] (P,); response_ids, loss_mask, stage_ids: list[int] (T,) aligned per token;
    loss_mask 1 = sampled by the policy, 0 = inserted by the environment; stage_ids in {0,1,2,3}.
    """

    query: object  # data.Query
    bank_items: list[str]
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    stage_ids: list[int] = field(default_factory=list)
    text: str = ""
    env_spans: list[tuple[int, int]] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    evidence: dict = field(default_factory=dict)  # handle -> SearchResult
    truncated: bool = False
    finished: bool = False
    turn_start: int = 0  # index in response_ids where the current policy turn began
    parsed: ParsedResponse | None = None

    @property
    def judge_text(self) -> str:
        """The response with forged tool outputs neutralised: what a judge may read."""
        return neutralise_forged(self.text, self.env_spans)

    @property
    def n_tool_calls(self) -> int:
        return sum(1 for c in self.tool_calls if not c.refused)

    @property
    def n_tool_errors(self) -> int:
        return sum(1 for c in self.tool_calls if c.error)

    @property
    def n_tool_timeouts(self) -> int:
        return sum(1 for c in self.tool_calls if c.timed_out)


class ToolTimeout(TimeoutError):
    """A tool call that did not answer within its time limit."""


def call_with_timeout(tool, query: str, timeout_s: float | None) -> list:
    """`list(tool(query))`, abandoned after timeout_s seconds (None: wait as long as it takes).

    The call runs in a daemon worker thread, so a hung tool can neither block the rollout nor keep
    the process alive at exit; an abandoned call's late result is discarded. Raises ToolTimeout
    after the limit, or whatever the tool raised.
    """
    if timeout_s is None:
        return list(tool(query))
    box: dict = {}

    def work():
        try:
            box["value"] = list(tool(query))
        except BaseException as e:  # handed to the caller below
            box["error"] = e

    th = threading.Thread(target=work, name="tool-call", daemon=True)
    th.start()
    th.join(max(0.0, timeout_s))
    if th.is_alive():
        raise ToolTimeout(f"no answer within {timeout_s:.3g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def token_char_starts(tokenizer, ids: Sequence[int]) -> tuple[str, list[int]]:
    """Decode ids to text and the char offset where each token starts.

    Each token is decoded on its own and the pieces concatenated; for byte-level BPE this equals the
    joint decode except where a multi-byte character is split across tokens (then both pieces decode
    to replacement characters and offsets stay consistent with the concatenated text, which is the
    text we parse). Returns (text, starts) with len(starts) == len(ids).
    """
    pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    starts, pos = [], 0
    for p in pieces:
        starts.append(pos)
        pos += len(p)
    return "".join(pieces), starts


def finalize(rollout: Rollout, tokenizer, scaffold: str = "structured") -> Rollout:
    """Decode, parse (with the scaffold's parser, PARSERS) and assign a stage id to every token of a
    finished rollout."""
    text, starts = token_char_starts(tokenizer, rollout.response_ids)
    rollout.text = text
    rollout.parsed = PARSERS[scaffold](text, rollout.env_spans)
    rollout.stage_ids = assign_stage_ids(starts, rollout.parsed)
    return rollout


class RolloutEngine:
    """Generates groups of rollouts with real multi-turn tool calls (§3.1-3.2).

    Each round, every unfinished rollout continues until a stop: `</call_tool>` -> the environment
    parses the call, runs the tool (or refuses an 11th call), appends "<tool_output>..." as fresh
    tokens with loss mask 0, and the rollout goes on; end of turn (<|im_end|>/eos) -> finished;
    the response token budget is spent -> truncated.

    Tool faults never end a rollout: an exception becomes "error: search failed", a call running
    past `tool_timeout_s` (s) becomes "error: search timed out", and once `deadline_s` (s, counted
    from the start of `run`) has passed every call is refused with an error. Counts accumulate in
    `stats` (tool_errors, tool_refusals, tool_timeouts, deadline_refusals).

    `scaffold` ("structured" | "unstructured") selects the parser of finished rollouts (PARSERS);
    generation, tool calls and loss masks are the same for both.
    """

    def __init__(self, sampler: Sampler, tokenizer, tools: dict, max_response_tokens: int = 512,
                 max_tool_calls: int = MAX_TOOL_CALLS, system_prompt: str = SYSTEM_PROMPT,
                 temperature: float = 1.0, max_rounds: int | None = None,
                 tool_timeout_s: float | None = None, deadline_s: float | None = None,
                 scaffold: str = "structured"):
        if scaffold not in PARSERS:
            raise ValueError(f"scaffold must be one of {SCAFFOLDS}, got {scaffold!r}")
        self.sampler, self.tok, self.tools = sampler, tokenizer, dict(tools)
        self.scaffold = scaffold
        # What a refused call tells the policy to do next (the unstructured scaffold has no review).
        self._finish = "the review and the answer" if scaffold == "structured" else "the answer"
        self.max_response_tokens = max_response_tokens
        self.max_tool_calls = max_tool_calls
        self.system_prompt = system_prompt
        self.temperature = temperature
        self.max_rounds = max_rounds if max_rounds is not None else max_tool_calls + 3
        # Fault tolerance (not in the paper): a tool call that runs longer than tool_timeout_s
        # seconds is abandoned; after deadline_s seconds of one `run`, tools are no longer called.
        # None or 0 switches either off. Both are wall-clock limits: a run that hits them is not
        # bit-reproducible, so their defaults are far above what a healthy call takes.
        self.tool_timeout_s = tool_timeout_s or None
        self.deadline_s = deadline_s or None
        self._deadline: float | None = None
        self.stats = {"tool_errors": 0, "tool_refusals": 0, "tool_timeouts": 0, "deadline_refusals": 0}

    def prompt_ids(self, query: str, bank_items: Sequence[str] = ()) -> list[int]:
        msgs = build_messages(query, bank_items, self.system_prompt)
        ids = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def run(self, queries: Sequence, n: int = 1, bank_items: Sequence[Sequence[str]] | None = None,
            temperature: float | None = None) -> list[Rollout]:
        """Sample n rollouts for each query (rollouts of query q are contiguous: a group).

        queries: list of data.Query; bank_items: per query, a list of strings for the prompt.
        Returns len(queries) * n Rollouts, finalised (parsed, stage ids assigned).
        """
        temp = self.temperature if temperature is None else temperature
        self._deadline = time.monotonic() + self.deadline_s if self.deadline_s else None
        rollouts: list[Rollout] = []
        for qi, q in enumerate(queries):
            items = list(bank_items[qi]) if bank_items else []
            p = self.prompt_ids(q.query, items)
            rollouts.extend(Rollout(q, items, p) for _ in range(n))
        active = list(rollouts)
        for _ in range(self.max_rounds):
            if not active:
                break
            budgets = [self.max_response_tokens - len(r.response_ids) for r in active]
            new = self.sampler.generate([r.prompt_ids + r.response_ids for r in active], budgets, temp)
            still = []
            for r, ids, b in zip(active, new, budgets):
                r.response_ids.extend(ids)
                r.loss_mask.extend([1] * len(ids))
                if self._ends_with_call(ids):
                    self._run_tool(r)
                    if len(r.response_ids) >= self.max_response_tokens:
                        r.truncated = True
                    else:
                        still.append(r)
                elif ids and ids[-1] in self._eos_ids():
                    r.finished = True
                else:
                    r.truncated = True
            active = still
        for r in active:
            r.truncated = True
        for r in rollouts:
            # Tool-output tokens may overshoot the budget by one block; trim to the budget.
            if len(r.response_ids) > self.max_response_tokens:
                del r.response_ids[self.max_response_tokens:]
                del r.loss_mask[self.max_response_tokens:]
                r.truncated = True
            finalize(r, self.tok, self.scaffold)
        return rollouts

    def _eos_ids(self) -> set:
        ids = {self.tok.eos_token_id, self.tok.convert_tokens_to_ids("<|im_end|>")}
        return {i for i in ids if isinstance(i, int)}

    def _ends_with_call(self, ids: list[int]) -> bool:
        if not ids:
            return False
        # 16 tokens: a tokenizer that spells the tag out may need one token per character (12)
        tail = self.tok.decode(ids[-16:], skip_special_tokens=False)
        return "</call_tool>" in tail

    def _run_tool(self, r: Rollout) -> None:
        """Parse the last call of the segment, execute it, append the tool output (mask 0)."""
        # Only this turn's text (since the last tool output) may hold the call: a malformed call
        # must become an error, never a re-run of an earlier turn's query.
        seg_text = self.tok.decode(r.response_ids[r.turn_start:], skip_special_tokens=False)
        calls = list(_CALL_RE.finditer(_strip_tool_outputs(seg_text)))
        name, query = (calls[-1].group(1), calls[-1].group(2).strip()) if calls else ("", "")
        n_done = r.n_tool_calls
        t0 = time.perf_counter()
        left = self._deadline - time.monotonic() if self._deadline is not None else None
        if n_done >= self.max_tool_calls:
            call = ToolCall(name, query, [], [], f"tool-call limit of {self.max_tool_calls} reached; "
                            f"write {self._finish}", refused=True)
            env = format_tool_error(call.error)
            self.stats["tool_refusals"] += 1
        elif left is not None and left <= 0:
            # Past the rollout deadline: no more tool calls; the rollout goes on within its budget.
            call = ToolCall(name, query, [], [], f"rollout deadline reached; write {self._finish}",
                            refused=True)
            env = format_tool_error(call.error)
            self.stats["deadline_refusals"] += 1
        elif name not in self.tools:
            call = ToolCall(name, query, [], [], f"unknown tool {name!r}")
            env = format_tool_error(call.error)
        elif not query:
            call = ToolCall(name, query, [], [], "empty query")
            env = format_tool_error(call.error)
        else:
            timeout = min(x for x in (self.tool_timeout_s, left) if x is not None) \
                if (self.tool_timeout_s is not None or left is not None) else None
            try:
                results = call_with_timeout(self.tools[name], query, timeout)
                first = len(r.evidence) + 1
                handles = list(range(first, first + len(results)))
                for h, res in zip(handles, results):
                    r.evidence[h] = res
                call = ToolCall(name, query, results, handles)
                env = format_tool_output(results, first)
            except ToolTimeout as e:
                call = ToolCall(name, query, [], [], str(e), timed_out=True)
                env = format_tool_error("search timed out")
                self.stats["tool_timeouts"] += 1
            except Exception as e:  # a failing tool never ends the rollout...
                if getattr(e, "stops_run", False):  # ...but a 401/403/404 ends the run (backends/api/http.py)
                    raise
                call = ToolCall(name, query, [], [], f"{type(e).__name__}: {e}"[:200])
                env = format_tool_error("search failed")
        if call.error and not call.refused:
            self.stats["tool_errors"] += 1
        call.latency_s = time.perf_counter() - t0
        r.tool_calls.append(call)
        self._append_env(r, env)

    def _append_env(self, r: Rollout, env_text: str) -> None:
        # Offsets in the same per-token decoding that finalize() parses (see token_char_starts).
        start = len(token_char_starts(self.tok, r.response_ids)[0])
        env_ids = self.tok.encode(env_text, add_special_tokens=False)
        r.response_ids.extend(env_ids)
        r.loss_mask.extend([0] * len(env_ids))
        r.turn_start = len(r.response_ids)
        r.env_spans.append((start, start + len(env_text)))


# ----------------------------------------------------------------------------------------------------
# The search tool interface (the toy world's BM25 tool and backends/api/search_http.py implement it)


@dataclass(frozen=True)
class SearchResult:
    """What a search tool returns for one hit (the same shape for BM25 and for an HTTP search API)."""

    doc_id: str
    title: str
    text: str


class SearchTool(Protocol):
    """A tool the policy calls as `<call_tool name="{name}">query</call_tool>`.

    `__call__(query) -> list[SearchResult]` (possibly empty). It may raise any exception (timeouts,
    HTTP errors); the rollout engine turns an exception into an error message inside <tool_output>.
    """

    name: str

    def __call__(self, query: str) -> list[SearchResult]: ...

"""A loopback teacher for the SFT pipeline tests: tests/loopback.FakeServer speaking the Gemini or
OpenAI chat wire format of backends/sft/teacher.py (multi-turn, stop sequence "</call_tool>", no JSON
schema), replying in the four-stage scaffold.

The reply depends only on the query and on the number of tool outputs already in the conversation,
so it is deterministic under concurrency. Queries carrying a marker make a defective trajectory
(each caught by one of the paper's filters), or write DR Tulu's tool name:
    NOANSWER   the answer is never closed                       -> filter (1)
    BADTOOL    calls <call_tool name="web_browse"> (unknown)     -> filter (2)
    NOREVIEW   no <review> block                                -> filter (3)
    DRTULU     calls <call_tool name="snippet_search"> (normalised to google_search, kept)
    SCRATCH    reasons in <scratchpad> (converted to <think>, kept)
Like the real APIs, a reply that stops at "</call_tool>" does not contain the stop sequence.
"""
from __future__ import annotations

import re

from loopback import FakeServer


def teacher_text(query: str, n_outputs: int) -> str:
    """The teacher's next turn for `query` after `n_outputs` tool outputs."""
    name = "web_browse" if "BADTOOL" in query else "snippet_search" if "DRTULU" in query else "google_search"
    call = f'<call_tool name="{name}">{query.split("?")[0][:40]} facts'
    if n_outputs == 0:
        pre = "<scratchpad>Plan the search first.</scratchpad>" if "SCRATCH" in query else ""
        return (f"{pre}<structured_plan><analysis>What is asked: {query}</analysis><rubrics>need: the "
                "main fact; avoid: old records</rubrics><research_plan>search once or twice"
                f"</research_plan></structured_plan>\n{call}")
    if n_outputs == 1:
        return f"<state_evaluation>Found a first snippet [1].</state_evaluation>\n{call} more"
    review = "" if "NOREVIEW" in query else (
        "<review><rubrics_review>main fact: [1]</rubrics_review><writing_plan>one paragraph"
        "</writing_plan></review>\n")
    end = "" if "NOANSWER" in query else "</answer>"
    return (f"<state_evaluation>Enough evidence [2].</state_evaluation>\n{review}<answer>The answer "
            f"to the question, as the snippets say [1] [2].{end}")


class TeacherServer(FakeServer):
    """FakeServer("gemini" | "openai") for teacher requests; records requests like FakeServer."""

    def __init__(self, kind: str = "gemini", **kw):
        super().__init__(kind, **kw)
        self.rule = self._teacher_rule

    def _validate(self, req: dict) -> str:
        b = req["body"]
        bad = self._route_error(req)  # path and key, as the judge server checks them
        if bad:
            return bad
        if self.kind == "gemini":
            try:
                roles = [c["role"] for c in b["contents"]]
                assert roles[0] == "user" and all(r in ("user", "model") for r in roles)
                assert isinstance(b["systemInstruction"]["parts"][0]["text"], str)
                assert b["generationConfig"]["stopSequences"] == ["</call_tool>"]
            except (KeyError, IndexError, TypeError, AssertionError):
                return "bad body shape"
        else:
            try:
                roles = [m["role"] for m in b["messages"]]
                assert roles[:2] == ["system", "user"] and b["stop"] == ["</call_tool>"]
            except (KeyError, IndexError, TypeError, AssertionError):
                return "bad body shape"
        return ""

    @staticmethod
    def conversation(body: dict) -> tuple[str, str, list[str]]:
        """(system, query, later turns' texts) of a teacher request."""
        if "contents" in body:
            texts = [c["parts"][0]["text"] for c in body["contents"]]
            return body["systemInstruction"]["parts"][0]["text"], texts[0], texts[1:]
        ms = body["messages"]
        return ms[0]["content"], ms[1]["content"], [m["content"] for m in ms[2:]]

    def _teacher_rule(self, req: dict) -> dict:
        _, query, later = self.conversation(req["body"])
        n_out = sum(1 for t in later if t.startswith("<tool_output>"))
        text = teacher_text(query, n_out)
        return {"text": re.sub(r"</call_tool>$", "", text)}

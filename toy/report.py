"""The toy SFT warm start in words: the line that announces it (cached or not, where) and its filter
counts (toy/sft.py logs them; backends/run/report.py prints them in the run summary).
"""
from __future__ import annotations


# sft.sft_filter's reasons, in words.
FILTER_WORDS = {"no_closing_answer": "no closing </answer>",
                "non_final_turn_without_valid_call": "a turn before a tool output without a valid call",
                "missing_required_tag": "a required tag missing",
                "consecutive_tool_errors": "two tool errors in a row"}


def format_filter_counts(stats: dict) -> str:
    """sft.build_sft_data's counts ({"generated", "kept", <reason>: n}) as one sentence:
    "kept 40 of 42 teacher trajectories; dropped: 1 no closing </answer>, 1 ..." (unknown reasons
    are shown by name)."""
    gen, kept = int(stats.get("generated", 0)), int(stats.get("kept", 0))
    drops = [(k, int(v)) for k, v in stats.items() if k not in ("generated", "kept") and v]
    text = f"kept {kept} of {gen} teacher trajectories"
    if drops:
        text += "; dropped: " + ", ".join(f"{n} {FILTER_WORDS.get(k, k)}" for k, n in drops)
    return text


def warm_start_line(cached: bool, path: str, steps: int) -> str:
    """The one line that announces the warm start before its bar: loaded from the cache at `path`,
    or trained once (`steps` SFT steps, after the teacher data) and then cached there."""
    if cached:
        return f"SFT warm start: cached, loading {path}"
    return (f"SFT warm start: not cached yet; writing teacher data and training it once ({steps} SFT "
            f"steps, 0.15-0.3 s each on 2 CPU cores), then cached in {path} for every later run with "
            "the same settings")

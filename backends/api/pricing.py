"""Judge prices and the judge's bill: a dated price table, cost of a request, and the cost plan of a
training run that the full-mode dry run prints before anything is spent. Not in the paper.

Equations
- Cost of one request: usd = tokens_in / 1e6 * price_in + tokens_out / 1e6 * price_out, prices in
  USD per 1M tokens; output includes thinking tokens (Gemini bills them as output). For a model
  with a long-context tier (gemini-2.5-pro above 200k prompt tokens) the whole request is billed at
  that tier's prices (`request_cost`).
- Calls per step (`judge_cost_plan`), P = rollout.prompts_per_step, n = rollout.n:
    proposal calls   = P            (one per group, all n responses in the prompt)
    scoring calls    = P * n        (one per rollout, every rubric of every stage)
    reflection calls = P * reflection.trajectories_per_query   (arms with a reflection branch)
- Tokens per call are stated assumptions (`PLAN_ASSUMPTIONS`, each overridable), chiefly the mean
  response length as a share of rollout.max_response_tokens.
- Judge minutes per step: max(waves, rpm floor, tpm floor), where waves = latency * (ceil(P / c) +
  ceil(P n / c) + reflection calls) with c = judge_http.concurrency (proposals of all groups run
  together, then the scorings; reflection calls are made one after another), rpm floor = calls /
  judge_http.rpm and tpm floor = tokens / judge_http.tpm.

A model that is not in the table has an *unknown* cost unless its prices are given (judge_http.price_in
and judge_http.price_out in a training config; --price-in / --price-out in evaluate.py): it is never
billed at another model's price.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ss_grpo import ARMS

# Prices checked on 2026-12-03: list prices in USD per 1M tokens, standard (not batch) tier, text
# input. Sources: Google's Gemini API pricing page (ai.google.dev/gemini-api/docs/pricing) and
# OpenAI's API pricing page (platform.openai.com/docs/pricing), read through third-party copies
# dated January-March 2026 (deploybase.ai, morphllm.com), since neither page is reachable from the
# machine this table was written on. Prices change: check them before a large run.
PRICES_CHECKED = "2026-12-03"
PRICE_SOURCE = ("Google Gemini API pricing page and OpenAI API pricing page (standard tier), via "
                "copies dated Jan-Mar 2026; checked " + PRICES_CHECKED)
# model: (input, output[, (prompt-token threshold, input above it, output above it)])
PRICE_TABLE: dict[str, tuple] = {
    "gemini-2.5-flash": (0.30, 2.50),
    "gemini-2.5-flash-lite": (0.10, 0.40),
    "gemini-2.5-pro": (1.25, 10.00, (200_000, 2.50, 15.00)),
    "gpt-4.1": (2.00, 8.00),
    "gpt-4.1-mini": (0.40, 1.60),
    "gpt-4.1-nano": (0.10, 0.40),
}
_SNAPSHOT = re.compile(r"-\d{4}-\d{2}-\d{2}$")  # "gpt-4.1-2025-04-14" is priced as "gpt-4.1"


@dataclass(frozen=True)
class Prices:
    """USD per 1M tokens; `tier`: (prompt-token threshold, input, output) above it, or None."""

    price_in: float
    price_out: float
    source: str
    tier: tuple | None = None

    def request_cost(self, tokens_in: int, tokens_out: int) -> float:
        """USD of one request with these token counts (ints >= 0)."""
        pin, pout = self.price_in, self.price_out
        if self.tier is not None and tokens_in > self.tier[0]:
            pin, pout = self.tier[1], self.tier[2]
        # Eq.: usd = tokens_in / 1e6 * price_in + tokens_out / 1e6 * price_out
        return tokens_in / 1e6 * pin + tokens_out / 1e6 * pout


def table_prices(model: str) -> Prices | None:
    """The table's prices for `model` (exact id, a "models/" prefix and a -YYYY-MM-DD snapshot
    suffix ignored), or None. Never falls back to a similar name."""
    name = _SNAPSHOT.sub("", model.strip().lower().removeprefix("models/"))
    row = PRICE_TABLE.get(name)
    if row is None:
        return None
    return Prices(row[0], row[1], f"price table checked {PRICES_CHECKED}", row[2] if len(row) > 2 else None)


def resolve_prices(model: str, price_in: float = -1.0, price_out: float = -1.0) -> Prices | None:
    """Prices to bill `model` at: the given ones when both are >= 0, else the table's; None when
    the model is not in the table and none were given (its cost is unknown). Raises ValueError when
    only one of the two is given."""
    given = (price_in is not None and price_in >= 0, price_out is not None and price_out >= 0)
    if given[0] != given[1]:
        raise ValueError("give both prices (input and output, USD per 1M tokens) or neither")
    if all(given):
        return Prices(float(price_in), float(price_out), "given")
    return table_prices(model)


def unknown_price_message(model: str, flags: str = "judge_http.price_in / judge_http.price_out") -> str:
    return (f"no price for judge model {model!r} in backends/api/pricing.py (prices checked "
            f"{PRICES_CHECKED}); its cost is reported as unknown. Give {flags} in USD per 1M "
            "tokens (0 for a self-hosted server).")


# ----------------------------------------------------------------------------------------------------
# The cost plan of a training run (printed by the full-mode dry run)

PLAN_ASSUMPTIONS = {
    "response_share": 0.5,  # mean response length / rollout.max_response_tokens (tool outputs included)
    "chars_per_token": 4.0,  # for the system prompts' length
    "system_tokens": 450,  # each judge system prompt (judge_http.SYSTEM_*), about 1,800 characters
    "query_tokens": 150,  # the query
    "rubric_tokens": 45,  # one rubric line in a prompt
    "rubrics_scored": 14,  # rubrics per scoring call: buffers (caps 3+2+2+3) + proposals + data-row rubrics
    "proposal_out_tokens": 900,  # up to 10 new rubrics with title and description
    "score_out_tokens_per_rubric": 45,  # a one-sentence justification and a score
    "reflection_candidate_tokens": 120,  # one reflection candidate
    "reflection_out_tokens_per_candidate": 60,
    "thinking_tokens": 600,  # per call when thinking is on (Gemini 2.5 dynamic thinking); 0 when off
    "latency_s": 5.0,  # seconds per judge call (3-10 s seen for long prompts with thinking)
}


def judge_cost_plan(cfg, **assume) -> dict:
    """Judge calls, tokens and USD per step and per run for a training config (config.Config).

    assume: overrides of PLAN_ASSUMPTIONS. Returns {"model", "prices" (USD per 1M or None),
    "price_source", "assumptions", "per_step": {"calls": {proposal, scoring, reflection, total},
    "tokens_in", "tokens_out", "usd" (None when the price is unknown)}, "per_run": {same, x steps},
    "steps", "max_usd", "problems" (list of str)}. A toy judge makes no paid calls (all zeros).
    """
    a = {**PLAN_ASSUMPTIONS, **assume}
    jc, h, ro = cfg.judge, cfg.judge_http, cfg.rollout
    P, n, steps = ro.prompts_per_step, ro.n, cfg.steps
    problems: list[str] = []
    if jc.backend == "toy":
        zero = {"calls": {"proposal": 0, "scoring": 0, "reflection": 0, "total": 0},
                "tokens_in": 0, "tokens_out": 0, "usd": 0.0, "judge_minutes": 0.0}
        return {"model": "toy", "prices": None, "price_source": "toy judge (no API calls)",
                "assumptions": a, "per_step": zero, "per_run": dict(zero), "steps": steps,
                "max_usd": h.max_usd if h else 0.0, "problems": problems}
    think = 0 if h.thinking_budget == 0 or jc.backend != "gemini" else (
        a["thinking_tokens"] if h.thinking_budget < 0 else min(h.thinking_budget, a["thinking_tokens"]))
    resp = a["response_share"] * ro.max_response_tokens
    base = a["system_tokens"] + a["query_tokens"]
    R = a["rubrics_scored"]
    refl = P * cfg.reflection.trajectories_per_query if ARMS[cfg.arm].reflection else 0
    m = cfg.reflection.m
    calls = {"proposal": P, "scoring": P * n, "reflection": refl}
    calls["total"] = sum(calls.values())
    # tokens per call kind: (input, output)
    per = {"proposal": (base + n * resp + R * a["rubric_tokens"], a["proposal_out_tokens"] + think),
           "scoring": (base + resp + R * a["rubric_tokens"],
                       R * a["score_out_tokens_per_rubric"] + think),
           "reflection": (base + resp + R * (a["rubric_tokens"] + a["score_out_tokens_per_rubric"])
                          + m * a["reflection_candidate_tokens"],
                          m * a["reflection_out_tokens_per_candidate"] + think)}
    tin = sum(calls[k] * per[k][0] for k in per)
    tout = sum(calls[k] * per[k][1] for k in per)
    try:
        prices = resolve_prices(jc.model, h.price_in, h.price_out)
    except ValueError as e:
        prices, _ = None, problems.append(f"judge prices: {e}")
    if prices is None:
        problems.append(unknown_price_message(jc.model))
        usd = None
    else:
        usd = sum(calls[k] * prices.request_cost(int(per[k][0]), int(per[k][1])) for k in per)
    c, lat = max(1, h.concurrency), a["latency_s"]
    # Eq.: minutes = max(latency * (ceil(P/c) + ceil(P n/c) + reflection calls), calls/rpm, tokens/tpm)
    waves_min = lat * (math.ceil(P / c) + math.ceil(P * n / c) + refl) / 60
    minutes = max(waves_min, calls["total"] / h.rpm if h.rpm else 0.0,
                  (tin + tout) / h.tpm if h.tpm else 0.0)
    step = {"calls": calls, "tokens_in": int(tin), "tokens_out": int(tout), "usd": usd,
            "judge_minutes": minutes}
    run = {"calls": {k: v * steps for k, v in calls.items()}, "tokens_in": int(tin) * steps,
           "tokens_out": int(tout) * steps, "usd": None if usd is None else usd * steps,
           "judge_minutes": minutes * steps}
    if h.max_usd > 0 and usd is not None and usd * steps > h.max_usd:
        problems.append(f"the estimated bill ${usd * steps:,.0f} exceeds judge_http.max_usd = "
                        f"${h.max_usd:,.0f}: the run will stop after about {int(h.max_usd // usd)} "
                        "steps")
    if h.max_usd > 0 and prices is None:
        problems.append("judge_http.max_usd needs a known price")
    if h.tpm and (tin + tout) / h.tpm > 10:
        problems.append(f"judge_http.tpm = {h.tpm:,}: a step's ~{int(tin + tout):,} judge tokens need at "
                        f"least {(tin + tout) / h.tpm:.0f} min per step")
    return {"model": jc.model, "prices": None if prices is None else
            {"in": prices.price_in, "out": prices.price_out}, "price_source":
            "unknown" if prices is None else prices.source, "assumptions": a, "per_step": step,
            "per_run": run, "steps": steps, "max_usd": h.max_usd, "thinking_tokens_per_call": think,
            "problems": problems}


def format_cost_plan(plan: dict) -> str:
    """The plan as a few printable lines (the dry run's "judge cost" section)."""
    s, r = plan["per_step"], plan["per_run"]
    usd = lambda v: "unknown" if v is None else f"${v:,.2f}"  # noqa: E731
    p = plan["prices"]
    lines = [f"judge cost plan ({plan['model']}; "
             + (f"${p['in']:g} in / ${p['out']:g} out per 1M tokens, {plan['price_source']})"
                if p else f"price {plan['price_source']})"),
             f"  per step: {s['calls']['total']} calls ({s['calls']['proposal']} proposal, "
             f"{s['calls']['scoring']} scoring, {s['calls']['reflection']} reflection), "
             f"{s['tokens_in'] / 1e6:.2f}M input + {s['tokens_out'] / 1e6:.2f}M output tokens, "
             f"{usd(s['usd'])}, ~{s['judge_minutes']:.1f} min of judge time",
             f"  per run ({plan['steps']} steps): {r['calls']['total']:,} calls, "
             f"{r['tokens_in'] / 1e9:.2f}B input + {r['tokens_out'] / 1e9:.3f}B output tokens, "
             f"{usd(r['usd'])}, ~{r['judge_minutes'] / 60:.0f} h of judge time"
             + (f"; budget judge_http.max_usd = ${plan['max_usd']:,.0f}" if plan.get("max_usd") else
                "; no budget cap (judge_http.max_usd = 0)"),
             "  assumptions: mean response = {:.0%} of rollout.max_response_tokens, {} rubrics per "
             "scoring call, {} thinking tokens per call, {:g} s per call (estimates; the run logs "
             "judge/usd_total)".format(plan["assumptions"]["response_share"],
                                       plan["assumptions"]["rubrics_scored"],
                                       plan.get("thinking_tokens_per_call", 0),
                                       plan["assumptions"]["latency_s"])]
    lines += [f"  problem: {x}" for x in plan["problems"]]
    return "\n".join(lines)

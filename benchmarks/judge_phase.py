"""Wall time of one training step's judge phase with the HTTP judge, against a loopback judge server
that answers every call after a fixed latency L.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Step 4 of Algorithm 1 (§3.4): for each of the step's P query groups of n rollouts, one rubric-proposal
call over the group, then one scoring call per rollout (judge_http.HTTPJudge; scoring calls of one
group run in parallel, at most judge_http.concurrency at a time). Judged one group after another, with
n <= concurrency a step's judge phase takes about

    sequential groups:  P * (L + ceil(n / C) * L)            (2 P L for n <= C)

while groups judged concurrently (same concurrency bound C on requests in flight) would need about

    concurrent groups:  ceil(P / C) * L + ceil(P * n / C) * L

This script measures both against tests/loopback.py's fake Gemini server, through the training
loop's own function (judge.judge_all, which train.judge_groups calls): "concurrent" is what the loop
does with the HTTP judge (HTTPJudge.concurrent_groups: the groups' judge_group calls in threads, the
C-request bound still holding), "sequential" the same call with concurrent_groups switched off (one
group after another). Local HTTP overhead is a few ms per call; the rest is the server's sleep.

Run (seconds; no model, no CPU-heavy work):
    python benchmarks/judge_phase.py                          # P 8, n 8, C 8, L 0.05 0.1 0.2 0.4
    python benchmarks/judge_phase.py --latency 1.0 --groups 32 --concurrency 16
Last line:
    JUDGE_PHASE L=<s> sequential_s=<s> concurrent_s=<s>   (one per latency, the largest last)
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from backends.api.judge_http import HTTPJudge  # noqa: E402
from backends.api.settings import judge_configs  # noqa: E402
from judge import judge_all  # noqa: E402
from loopback import TEST_KEY, FakeServer  # noqa: E402
from scaffold import Query, Rollout, parse_response  # noqa: E402

TEXT = ("<structured_plan><analysis>Asked: habitat.</analysis><rubrics>need: habitat</rubrics>"
        "<research_plan>search</research_plan></structured_plan>\n<review><rubrics_review>habitat: "
        "[1]</rubrics_review><writing_plan>habitat</writing_plan></review>\n<answer>It lives in the "
        "north marshes [1].</answer>")


def groups(P: int, n: int):
    """P queries (two initial rubrics each) with n finished rollouts per query."""
    out = []
    for g in range(P):
        q = Query(f"Write a short report on entity {g}: its habitat.",
                  [{"title": f"fact {j}", "description": f"States fact {j} with a citation.",
                    "weight": 1.0} for j in range(2)])
        ros = []
        for i in range(n):
            ro = Rollout(q, [], [], text=TEXT + " " * i, finished=True)
            ro.parsed = parse_response(ro.text)
            ros.append(ro)
        out.append((q, ros))
    return out


def phase(server, latency: float, P: int, n: int, C: int, concurrent: bool) -> tuple[float, int]:
    """(seconds, requests) of one judge phase over P fresh groups."""
    server.rule = lambda req: {"sleep": latency}
    before = len(server.requests)
    with tempfile.TemporaryDirectory() as d:
        cfg = judge_configs(backend="gemini", model=server.model, base_url=server.url,
                              timeout_s=max(30.0, 10 * latency), max_retries=0, concurrency=C,
                              cache_dir=os.path.join(d, "cache"))
        with HTTPJudge(*cfg) as judge:
            gs = groups(P, n)
            judge.concurrent_groups = concurrent
            t0 = time.perf_counter()
            judge_all(judge, [q for q, _ in gs], [ros for _, ros in gs], 0)
            dt = time.perf_counter() - t0
    return dt, len(server.requests) - before


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latency", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.4],
                    help="server latency per call, seconds")
    ap.add_argument("--groups", type=int, default=8, help="P: query groups per step (toy: 8)")
    ap.add_argument("--n", type=int, default=8, help="rollouts per group (PAPER: 8)")
    ap.add_argument("--concurrency", type=int, default=8, help="C: judge_http.concurrency")
    a = ap.parse_args(argv)
    os.environ["GEMINI_API_KEY"] = TEST_KEY  # the loopback server's made-up key
    P, n, C = a.groups, a.n, a.concurrency
    print(f"judge phase: P={P} groups x n={n} rollouts, concurrency C={C}; {P * (1 + n)} calls per step")
    rows = []
    with FakeServer("gemini") as server:
        # The stdlib server listens with a backlog of 5: more simultaneous connects than that wait
        # for a SYN retry (1 s). A real endpoint accepts them; so does this one after a re-listen.
        server._httpd.socket.listen(256)
        phase(server, 0.0, 1, 2, C, False)  # warm-up: imports, connection pool
        for L in a.latency:
            seq, r1 = phase(server, L, P, n, C, False)
            con, r2 = phase(server, L, P, n, C, True)
            pred_seq = P * (L + math.ceil(n / C) * L)
            pred_con = math.ceil(P / C) * L + math.ceil(P * n / C) * L
            rows.append((L, seq, con))
            print(f"L={L:.3f}s  sequential={seq:.3f}s (model {pred_seq:.3f}s, {seq / L:.1f} L)  "
                  f"concurrent={con:.3f}s (model {pred_con:.3f}s, {con / L:.1f} L)  "
                  f"requests={r1}/{r2}  speed-up={seq / con:.2f}x", flush=True)
            if server.errors:
                print(f"server errors: {server.errors[:3]}", file=sys.stderr)
                return 1
    for L, seq, con in rows:
        print(f"JUDGE_PHASE L={L:g} sequential_s={seq:.3f} concurrent_s={con:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

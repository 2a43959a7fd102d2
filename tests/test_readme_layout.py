"""README.md reads in two minutes: at most 150 lines above "## More", in the order a newcomer needs
(what it is, the two commands, what the toy run shows with a verdict and a glossary next to its
first table, a table of contents into docs/, full mode with its starting checkpoint and cost), no
development history, an install line per kind of machine."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
TOP = TEXT.split("\n## More\n", 1)[0]


def _section(title: str) -> str:
    return TOP.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_at_most_150_lines_above_more_in_the_newcomers_order():
    assert "\n## More\n" in TEXT
    assert len(TOP.splitlines()) <= 150, len(TOP.splitlines())
    heads = re.findall(r"^## (.+)$", TOP, re.M)
    assert heads[:3] == ["Quick start", "What the toy run shows", "Documentation"], heads
    assert "Full mode" in heads
    intro = TOP.split("\n## ", 1)[0].strip().splitlines()
    assert intro[0] == "# rubricem" and len([line for line in intro[1:] if line.strip()]) <= 3


def test_two_commands_first_and_an_install_line_per_machine():
    quick = _section("Quick start")
    assert quick.count("python train.py --toy\n") == 2 and "python -m pytest -q" in quick
    linux = [line for line in quick.splitlines() if "--index-url https://download.pytorch.org/whl/cpu" in line
             and line.startswith("python3 -m venv")]
    plain = [line for line in quick.splitlines() if line.startswith("python3 -m venv")
             and "pip install torch==2.13.0 &&" in line]
    assert linux and plain
    comments = " ".join(line for line in quick.splitlines() if line.startswith("# "))
    for machine in ("Linux without a GPU", "macOS", "GPU node", "CI"):
        assert machine in comments, machine


def test_verdict_and_glossary_next_to_the_first_table():
    shows = _section("What the toy run shows")
    assert re.search(r"\*\*Verdict: [^*]+\*\*", shows)
    first_table = shows.index("\n| seed |")
    glossary = shows[:first_table]
    for term in ("static rubrics", "evolving rubrics", "score", "answer score", "fact recall",
                 "answer gain", "well_formed"):
        assert f"**{term}**" in glossary, term
    assert shows.index("<!-- reproduce-readme:begin -->") < first_table < shows.index(
        "<!-- reproduce-readme:end -->")


@pytest.mark.parametrize("doc", ["results.md", "ablations.md", "full_mode.md", "evaluation.md",
                                 "paper_code.md", "metrics.md"])
def test_table_of_contents_points_into_docs(doc):
    assert f"](docs/{doc})" in _section("Documentation")
    assert os.path.isfile(os.path.join(ROOT, "docs", doc))


def test_every_docs_path_the_readme_names_exists():
    for path in set(re.findall(r"\bdocs/[A-Za-z0-9_]+\.(?:md|png)", TEXT)):
        assert os.path.isfile(os.path.join(ROOT, path)), path


def test_no_development_history():
    assert not re.search(r"\bcommits?\b [0-9a-f]{7,40}\b", TEXT, re.I)
    assert not re.search(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", TEXT)
    for phrase in ("we aim", "this round", "rounds", "at commit"):
        assert phrase not in TEXT.lower(), phrase


def test_full_mode_says_where_the_checkpoint_comes_from_and_what_it_costs():
    full = _section("Full mode")
    assert "--model" in full and "Qwen3-8B after SFT" in full and "not shipped" in full
    flat = " ".join(full.split())
    assert "--dry-run" in flat and re.search(r"\$[0-9.,]+ per step", flat)
    assert re.search(r"\$[0-9.,]+ per run", flat) and re.search(r"[0-9]+ minutes per RL step", flat)
    assert re.search(r"[0-9.]+ GiB on GPU 0", flat)


def test_metrics_glossary_names_the_judge_cost_keys_and_exit_codes():
    m = open(os.path.join(ROOT, "docs", "metrics.md"), encoding="utf-8").read()
    assert "`judge/usd_total`" in m and "throttled" in m
    codes = re.findall(r"^\| ([0-9]) \|", m.split("## Exit codes", 1)[1], re.M)
    assert codes == ["0", "2", "3", "4", "5", "6"]
    import train

    doc = " ".join(train.main.__doc__.split())
    for code in ("2 bad configuration", "3 judge failures", "4 an API answered", "5 judge_http.max_usd",
                 "6 max_nonfinite_updates"):
        assert code in doc, code  # the table documents what main() returns

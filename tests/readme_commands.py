"""The shell commands README.md shows, as data: extraction from its ```bash blocks, one class per
command (run it, check it statically, or skip it for a stated reason) and the static checks.

A command is one `&&`-separated part of a line of a ```bash block, with backslash continuations
joined, its trailing `# comment` split off and whitespace collapsed; its `text` (without the comment)
is the key of SKIPPED. tests/test_readme_commands.py runs the runnable ones from a scratch copy of the
checkout and fails on any command that falls in none of the classes.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex

# Commands the test does not run, keyed by their exact text, each with the reason. A README command
# that is neither runnable on CPU, nor statically checkable, nor listed here fails the test; an entry
# that no longer matches a README command fails it too.
SKIPPED = {
    "python -m pytest -q":
        "the whole suite (this test included): minutes on CPU; CI runs it",
    "deepspeed --num_gpus 8 train.py --full --model /ckpt/qwen3-8b-sft":
        "full-mode launch: 8 GPUs, a Qwen3-8B checkpoint, Gemini and Serper keys",
    "deepspeed --hostfile hostfile --num_nodes 2 --num_gpus 8 --master_addr node0 --master_port 29500 "
    "train.py --full --model /ckpt/qwen3-8b-sft":
        "full-mode launch on two nodes of 8 GPUs",
    "python evaluate.py researchqa --data researchqa.json --model /ckpt/rubricem-8b --preset full "
    "--sampler vllm":
        "generates with vLLM (a GPU) from an 8B checkpoint and searches the web (Serper)",
}

# Placeholders of runnable commands -> what the scratch checkout holds in their place (made by the
# test just before the first command that names them).
PLACEHOLDERS = {
    "path/to/hf-model": "a copy of runs/toy/final, the base run's trained policy (Hugging Face format)",
    "healthbench.jsonl": "one hand-written HealthBench row (prompt, prompt_id, rubrics with points, tags)",
    "answers.jsonl": "that row's answer, {prompt_id, response}",
}

# What the test adds to runnable commands (the same for every command of one script).
ADDITIONS = {
    "train.py": "the tiny settings of tests/test_smoke.py tiny_args + tests/runfix.py FAST (without "
                "--toy and --run-dir), inserted right after `train.py`, so the command's own flags and "
                "--set values come later and win",
    "evaluate.py": "--judge-base-url of a loopback judge (tests/loopback.py) speaking the command's "
                   "judge API and model; its key is a test key in the environment",
}

RUN_SCRIPTS = ("train.py", "bank.py", "evaluate.py")
# Markers of a command that needs a GPU, several processes, a real model or the network.
NEEDS_MACHINE = ("deepspeed", "torchrun", "--sampler vllm", "--preset full", "--search serper")
# Packages a README pip line may name besides the project itself.
KNOWN_PACKAGES = {"torch", "vllm"}
ENV_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclasses.dataclass
class Command:
    text: str          # the command, whitespace collapsed, without comment
    comment: str       # the trailing comment of its line ("" if none)
    chain: tuple       # texts of every part of its `&&` chain, in order
    index: int         # its position in the chain
    line: int          # 1-based README line where its (first) line starts

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)


def _split_comment(line: str) -> tuple[str, str]:
    """(code, comment): a `#` outside quotes at the start or after whitespace begins a comment."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i + 1:].strip()
    return line, ""


def _split_chain(code: str) -> list[str]:
    """Parts of `a && b && c`, `&&` outside quotes only."""
    parts, quote, cur, i = [], None, [], 0
    while i < len(code):
        ch = code[i]
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif code.startswith("&&", i):
            parts.append("".join(cur))
            cur, i = [], i + 2
            continue
        cur.append(ch)
        i += 1
    parts.append("".join(cur))
    return [" ".join(p.split()) for p in parts if p.strip()]


def extract_commands(markdown: str) -> list[Command]:
    """Every command of every ```bash block of `markdown`, in order."""
    out, in_bash, pending, start = [], False, "", 0
    for n, raw in enumerate(markdown.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("```"):
            if in_bash and pending:
                raise ValueError(f"README line {n}: a bash block ends inside a continued line")
            in_bash = stripped[3:].strip() in ("bash", "sh", "shell", "console")
            continue
        if not in_bash:
            continue
        code, comment = _split_comment(raw)
        if not pending:
            start = n
        if code.rstrip().endswith("\\"):
            pending += code.rstrip()[:-1] + " "
            continue
        code, pending = pending + code, ""
        chain = tuple(_split_chain(code))
        for i, part in enumerate(chain):
            out.append(Command(part, comment, chain, i, start))
    return out


def _program(argv: list[str]) -> list[str]:
    """argv without leading NAME=VALUE environment assignments."""
    i = 0
    while i < len(argv) and ENV_ASSIGN.match(argv[i]):
        i += 1
    return argv[i:]


def classify(cmd: Command) -> tuple[str, str]:
    """(kind, detail): kind "skip" (in SKIPPED; detail: the reason), "dry-run" (a --dry-run of
    train.py: run, may exit 1 with its report), "run" (run, must exit 0; detail: the script),
    "static" (checked by static_problems; detail: what it is) or "unhandled" (detail: why)."""
    if cmd.text in SKIPPED:
        return "skip", SKIPPED[cmd.text]
    argv = _program(cmd.argv)
    if not argv:
        return "unhandled", "no program"
    prog = argv[0]
    if prog in ("python", "python3") and len(argv) >= 2 and argv[1] == "-m" and argv[2:3] == ["venv"]:
        return "static", "venv"
    if prog in (".", "source"):
        return "static", "activate"
    if prog == "pip" or (prog in ("python", "python3") and argv[1:4] == ["-m", "pip", "install"]):
        return "static", "pip"
    if prog == "export":
        return "static", "export"
    if prog == "python" and len(argv) >= 2:
        script = argv[1]
        runnable = script in RUN_SCRIPTS or re.fullmatch(r"scripts/[A-Za-z0-9_]+\.py", script)
        if runnable:
            if script == "train.py" and "--dry-run" in argv:
                return "dry-run", script
            needs = [m for m in NEEDS_MACHINE if m in cmd.text]
            if script == "train.py" and "--full" in argv:
                needs.append("--full without --dry-run")
            if needs:
                return "unhandled", ("needs a GPU, a real model or the network (" + ", ".join(needs)
                                     + "): add it to SKIPPED with the reason")
            return "run", script
    return "unhandled", "not a runnable script, a static set-up line or a SKIPPED command"


def _pyproject_extras(repo: str) -> set:
    import tomllib

    with open(os.path.join(repo, "pyproject.toml"), "rb") as fh:
        return set(tomllib.load(fh)["project"].get("optional-dependencies", {}))


def secret_env_vars(repo: str) -> tuple:
    """settings.SECRET_ENV_VARS, read from the checkout's backends/run/config.py without importing it."""
    import ast

    with open(os.path.join(repo, "backends", "run", "config.py")) as fh:
        for node in ast.parse(fh.read()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "SECRET_ENV_VARS"
                                                    for t in node.targets):
                return tuple(ast.literal_eval(node.value))
    raise ValueError("backends/run/config.py defines no SECRET_ENV_VARS")


def ci_torch_pin(repo: str) -> str:
    """The torch version .ci/run installs (`torch==X`)."""
    with open(os.path.join(repo, ".ci", "run")) as fh:
        m = re.search(r"\btorch==([0-9][0-9A-Za-z.+]*)", fh.read())
    if not m:
        raise ValueError(".ci/run pins no torch version")
    return m.group(1)


def static_problems(cmd: Command, repo: str) -> list[str]:
    """What is wrong with a static command (venv, activate, pip, export), as messages."""
    argv, before = _program(cmd.argv), [_program(shlex.split(t)) for t in cmd.chain[:cmd.index]]
    kind = classify(cmd)[1]
    probs = []
    if kind == "activate":
        m = re.fullmatch(r"(.+)/bin/activate", argv[1]) if len(argv) == 2 else None
        venvs = [a[3] for a in before if a[1:3] == ["-m", "venv"] and len(a) == 4]
        if not m or m.group(1) not in venvs:
            probs.append(f"activates {argv[1:]} without creating that venv earlier in the chain")
    elif kind == "venv":
        if len(argv) != 4:
            probs.append("expected `python3 -m venv DIR`")
    elif kind == "export":
        SECRET_ENV_VARS = secret_env_vars(repo)
        for a in argv[1:]:
            name = a.split("=", 1)[0]
            if not ENV_ASSIGN.match(a) or name not in SECRET_ENV_VARS:
                probs.append(f"exports {a!r}: not NAME=VALUE of a variable the code reads "
                             f"({', '.join(SECRET_ENV_VARS)})")
    elif kind == "pip":
        args = argv[argv.index("install") + 1:] if "install" in argv else []
        if not args:
            probs.append("pip without `install PACKAGES`")
        torch_before = [r for a in before if "install" in a for r in a[a.index("install") + 1:]
                        if re.match(r"torch\b", r)]
        i = 0
        while i < len(args):
            a = args[i]
            if a == "-e":
                spec = args[i + 1] if i + 1 < len(args) else ""
                m = re.fullmatch(r"\.(?:\[([A-Za-z0-9_,-]+)\])?", spec)
                if not m:
                    probs.append(f"`-e {spec}`: expected . or .[extras]")
                    i += 2
                    continue
                extras = set(m.group(1).split(",")) if m.group(1) else set()
                missing = extras - _pyproject_extras(repo)
                if missing:
                    probs.append(f"extras {sorted(missing)} are not in pyproject.toml")
                if not torch_before:
                    probs.append("`pip install -e` before any `pip install torch...` in its chain")
                elif "full" not in extras:  # a CPU install: the torch CI tests with
                    pin = f"torch=={ci_torch_pin(repo)}"
                    if torch_before[-1] != pin:
                        probs.append(f"CPU install with {torch_before[-1]!r} first, expected {pin!r}")
                i += 2
                continue
            if a == "--index-url":  # only PyTorch's own wheel index, for its CPU build
                url = args[i + 1] if i + 1 < len(args) else ""
                if not re.fullmatch(r"https://download\.pytorch\.org/whl/(cpu|cu[0-9]+)", url):
                    probs.append(f"--index-url {url!r}: expected PyTorch's wheel index "
                                 "(https://download.pytorch.org/whl/cpu or /cuNNN)")
                if not any(re.match(r"torch\b", x) for x in args):
                    probs.append("--index-url on a line that installs no torch")
                i += 2
                continue
            if a.startswith("-"):
                probs.append(f"pip option {a!r} the check does not know")
            elif re.split(r"[=<>!~\[ ]", a, maxsplit=1)[0] not in KNOWN_PACKAGES:
                probs.append(f"installs {a!r}, not one of {sorted(KNOWN_PACKAGES)}")
            i += 1
    return probs


def readme_path(repo: str) -> str:
    return os.path.join(repo, "README.md")

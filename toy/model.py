"""The toy policy's model and tokenizer: a small Qwen3 with a locally trained byte-level BPE tokenizer
(ChatML template), and the loader of any local Hugging Face causal-LM directory.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
The paper's policy is Qwen3-8B (appendix). Toy mode builds a `Qwen3ForCausalLM` from a `Qwen3Config`
of well under a million parameters, and a tokenizer trained with `tokenizers` on toy-world text; both
are saved with `save_pretrained` so that plain `transformers` (and vLLM) load them (deviation 1 of
policy.py: nothing may be downloaded here).

- `train_tokenizer(texts, names)`: byte-level BPE, digits split, scaffold tags as added tokens; the
  entity names in the training text are replaced by fresh random syllable strings first, so that
  names become shared syllable pieces (a measured prerequisite for copying unseen names).
- `build_tiny_qwen3(tokenizer, size)`: a randomly initialised Qwen3 of a named size.
- `load_policy(path)`: model + tokenizer from a local directory (never downloads in toy mode).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from scaffold import SCAFFOLD_TAGS

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


# Named toy sizes. "S" matches the measured de-risk model (0.5 M parameters at vocab ~1k).
SIZES = {
    "XS": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
               head_dim=32, intermediate_size=192),
    "S": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, intermediate_size=384),
    "M": dict(hidden_size=192, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
              head_dim=32, intermediate_size=576),
}


@dataclass
class ToyModelConfig:
    """The toy policy (the run config's `toy_model` section; not in the paper, whose policy is
    Qwen3-8B): its size and its tokenizer's vocabulary."""

    size: str = "S"
    """"XS" | "S" | "M" (SIZES); "S" = 0.5 M parameters"""
    vocab_size: int = 1024
    """byte-level BPE vocabulary size (the tokenizer is trained on the toy world)"""


def _scramble_names(text: str, names_re: re.Pattern | None, rng: random.Random,
                    syllables: Sequence[str]) -> str:
    if names_re is None:
        return text
    return names_re.sub(lambda m: "".join(rng.choice(syllables)
                                          for _ in range(rng.choice((2, 2, 3)))).capitalize(), text)


def train_tokenizer(texts: Iterable[str], names: Sequence[str] = (), vocab_size: int = 1024,
                    syllables: Sequence[str] = (), seed: int = 0, tags: Sequence[str] = SCAFFOLD_TAGS):
    """Train a byte-level BPE tokenizer and wrap it as a `PreTrainedTokenizerFast` with ChatML.

    texts: training text; names: entity names scrambled into `syllables` strings before training;
    tags: one added token each (a scaffold's tags). vocab_size: BPE merges + byte alphabet, tags on top.
    Returns a tokenizer whose eos is <|im_end|> and pad is <|endoftext|>. Deterministic per seed.
    """
    # lazy: tokenizers / transformers load when a model is built, not at `import train` or --help
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    names_re = None
    if names and syllables:
        names_re = re.compile(r"\b(" + "|".join(sorted(map(re.escape, names), key=len, reverse=True))
                              + r")\b")
    corpus = [_scramble_names(t, names_re, rng, syllables) for t in texts]
    for tag in tags:  # tags become added tokens: keep them out of BPE statistics
        corpus = [c.replace(tag, " ") for c in corpus]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tk.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token=None)
    tok.add_tokens(list(tags))  # non-special: decode keeps them, the parser sees them
    tok.chat_template = CHATML_TEMPLATE
    return tok


def build_tiny_qwen3(tokenizer, size: str = "S", seed: int = 0):
    """A randomly initialised `Qwen3ForCausalLM` of a named size (see SIZES), tied embeddings.

    Raises KeyError for an unknown size. Deterministic per seed (torch.manual_seed).
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM  # lazy: transformers only when a model is built

    if size not in SIZES:
        raise KeyError(f"unknown toy model size {size!r}; choose one of {sorted(SIZES)}")
    cfg = Qwen3Config(vocab_size=len(tokenizer), max_position_embeddings=2048, rope_theta=10000.0,
                      tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **SIZES[size])
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def load_tokenizer(path: str):
    """The tokenizer of a local model directory, its pad token the EOS token when it has none.
    Raises OSError if the path is not a local model directory (toy mode never downloads)."""
    from transformers import AutoTokenizer  # lazy: transformers only when a model loads

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_policy(path: str, dtype: torch.dtype = torch.float32):
    """Load (model, tokenizer) from a local directory saved with `save_pretrained`.

    Works for any Hugging Face causal LM directory (e.g. a local copy of Qwen/Qwen3-0.6B). Raises
    OSError if the path is not a local model directory (toy mode never downloads).
    """
    from transformers import AutoModelForCausalLM  # lazy: transformers only when a model loads

    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model, tok

"""The policy pi_theta: a small Qwen3 with a locally trained tokenizer, or any Hugging Face causal LM.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
The paper's policy is Qwen3-8B (appendix). Toy mode builds a `Qwen3ForCausalLM` from a `Qwen3Config`
of well under a million parameters, and a byte-level BPE tokenizer trained with `tokenizers` on
toy-world text, with a ChatML chat template; both are saved with `save_pretrained` so that plain
`transformers` (and vLLM) load them. Any local Hugging Face causal LM directory works as `--model`.

Functions
- `train_tokenizer(texts, names)`: byte-level BPE, digits split, scaffold tags as added tokens; the
  entity names in the training text are replaced by fresh random syllable strings first, so that
  names become shared syllable pieces (a measured prerequisite for copying unseen names).
- `build_tiny_qwen3(tokenizer, size)`: a randomly initialised Qwen3 of a named size.
- `load_policy(path)`: model + tokenizer from a local directory (never downloads in toy mode).
- `token_logprobs(model, input_ids, attention_mask)`: log pi(a_t | h_t) of every next token, computed
  in chunks of the sequence so the (tokens x vocab) fp32 logits are never materialised at once.
- `disable_dropout(model)`: every dropout probability to 0, so the old (eval-mode) and new
  (train-mode) log-probs of the SS-GRPO update come from the same function.

Deviations from the paper
1. Toy mode trains a tiny model from scratch (SFT warm start, sft.py) instead of starting from a
   pretrained Qwen3-8B: nothing may be downloaded here.
"""
from __future__ import annotations

import random
import re
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


def _scramble_names(text: str, names_re: re.Pattern | None, rng: random.Random,
                    syllables: Sequence[str]) -> str:
    if names_re is None:
        return text
    return names_re.sub(lambda m: "".join(rng.choice(syllables)
                                          for _ in range(rng.choice((2, 2, 3)))).capitalize(), text)


def train_tokenizer(texts: Iterable[str], names: Sequence[str] = (), vocab_size: int = 1024,
                    syllables: Sequence[str] = (), seed: int = 0):
    """Train a byte-level BPE tokenizer and wrap it as a `PreTrainedTokenizerFast` with ChatML.

    texts: training text; names: entity names to scramble into random syllable strings (drawn from
    `syllables`) before training. vocab_size counts BPE merges + byte alphabet (tags come on top).
    Returns a tokenizer whose eos is <|im_end|> and pad is <|endoftext|>. Deterministic per seed.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    names_re = None
    if names and syllables:
        names_re = re.compile(r"\b(" + "|".join(sorted(map(re.escape, names), key=len, reverse=True))
                              + r")\b")
    corpus = [_scramble_names(t, names_re, rng, syllables) for t in texts]
    for tag in SCAFFOLD_TAGS:  # tags become added tokens: keep them out of BPE statistics
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
    tok.add_tokens(list(SCAFFOLD_TAGS))  # non-special: decode keeps them, the parser sees them
    tok.chat_template = CHATML_TEMPLATE
    return tok


def build_tiny_qwen3(tokenizer, size: str = "S", seed: int = 0):
    """A randomly initialised `Qwen3ForCausalLM` of a named size (see SIZES), tied embeddings.

    Raises KeyError for an unknown size. Deterministic per seed (torch.manual_seed).
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

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


def load_policy(path: str, dtype: torch.dtype = torch.float32):
    """Load (model, tokenizer) from a local directory saved with `save_pretrained`.

    Works for any Hugging Face causal LM directory (e.g. a local copy of Qwen/Qwen3-0.6B). Raises
    OSError if the path is not a local model directory (toy mode never downloads).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model, tok


def disable_dropout(model) -> int:
    """Set every dropout probability of `model` to 0, in place; returns how many were > 0.

    Covers torch dropout modules (p), float module attributes whose name contains "dropout" (e.g.
    the `attention_dropout` a Hugging Face attention layer passes to its attention kernel in train
    mode) and such fields of `model.config` (so saved checkpoints say how the model was trained).
    Not in the paper; we do it for RL because the old log-probs are computed in eval mode and the
    new ones in train mode (gradient checkpointing needs it): with dropout p > 0 the ratio
    rho = exp(log pi_new - log pi_old) departs from 1 on the very first, on-policy minibatch
    (|log rho| up to ~0.1 at p = 0.1) and PPO clipping acts on noise. Idempotent.
    """
    changed = 0
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            m.p = 0.0
            changed += 1
        for name, v in list(vars(m).items()):
            if "dropout" in name and isinstance(v, float) and v > 0:
                setattr(m, name, 0.0)
                changed += 1
    cfg = getattr(model, "config", None)
    for name, v in (list(vars(cfg).items()) if cfg is not None else []):
        if "dropout" in name and isinstance(v, float) and v > 0:
            setattr(cfg, name, 0.0)
            changed += 1
    return changed


def _chunk_logprobs(head, h: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    """(B, c) float32 log-probs of the next tokens `nxt` (B, c) from hidden states h (B, c, H)."""
    # log pi(x_{t+1} | x_{<=t}) = log_softmax(logits_t)[x_{t+1}]
    lp = torch.log_softmax(head(h).float(), dim=-1)  # (B, c, V)
    return lp.gather(-1, nxt[..., None]).squeeze(-1)


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   chunk_size: int = 1024, recompute: bool | None = None) -> torch.Tensor:
    """log pi_theta(x_{t+1} | x_{<=t}) for every position, memory-bounded.

    input_ids, attention_mask: (B, L) int64. Returns (B, L) float32 where column t holds the
    log-prob of token t given tokens < t (column 0 is 0: the first token has no prediction).
    The final hidden states (B, L, H) are computed once; the vocabulary projection and log-softmax
    run on `chunk_size` positions at a time, so the forward holds at most B * chunk_size * V floats
    of logits instead of B * L * V. Gradients flow through (use under torch.no_grad() for old/ref
    log-probs).

    recompute: with gradient, autograd would keep every chunk's (B, c, V) log-softmax for the
    backward, i.e. the full B * L * V again; recompute=True (the default whenever gradients are
    recorded) keeps only each chunk's inputs and recomputes its projection in the backward
    (torch.utils.checkpoint), for one extra vocabulary projection per chunk.
    benchmarks/logprob_memory.py measures both.
    """
    from torch.utils.checkpoint import checkpoint

    B, L = input_ids.shape
    # Left-padded batches: positions must count from each row's first real token.
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    hidden = base(input_ids=input_ids, attention_mask=attention_mask,
                  position_ids=position_ids).last_hidden_state  # (B, L, H)
    head = model.get_output_embeddings()
    if recompute is None:
        recompute = torch.is_grad_enabled() and hidden.requires_grad
    pieces = [torch.zeros(B, 1, dtype=torch.float32, device=input_ids.device)]
    for s in range(0, L - 1, chunk_size):
        e = min(s + chunk_size, L - 1)
        h, nxt = hidden[:, s:e], input_ids[:, s + 1 : e + 1]
        if recompute:  # SCALE: the backward rebuilds this chunk's logits instead of storing them
            pieces.append(checkpoint(_chunk_logprobs, head, h, nxt, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(head, h, nxt))  # (B, c); its logits are freed here
    return torch.cat(pieces, dim=1)  # (B, L)

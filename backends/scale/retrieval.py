"""Dense retrieval for the rubric bank's "cross-episode similar" mode (§3.5).

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements the appendix's "rubric bank embeddings Qwen3-Embedding-0.6B, top-k 2": `DenseRetriever`
embeds the bank's stored queries and ranks them by cosine similarity to the new query. It implements
bank.Retriever (`fit(queries)`, `topk(query, k) -> [(index, score)]`) and plugs in as
`bank.RubricBank(retriever=DenseRetriever(...))`; BM25 stays the toy default (bank.py, deviation 1).

Equations
    e(x) = pool(h(x)) / ||pool(h(x))||_2           DenseRetriever.embed (pooling from the model folder)
    score(q, j) = e(q) . e(q_j)  (cosine, in [-1, 1]) DenseRetriever.topk

Backends (chosen at construction; the library is imported there, so a toy run never loads it)
    "sentence-transformers": SentenceTransformer(model).encode(..., normalize_embeddings=True); the
        model's own modules (pooling, normalisation, prompts) apply. Used when installed ("auto").
    "transformers": AutoModel + the pooling named in the folder's 1_Pooling/config.json ("mean" for
        all-MiniLM-L6-v2, "lasttoken" for Qwen3-Embedding; when the file is absent: "lasttoken" for
        Qwen3-Embedding models, else "mean"), then L2 normalisation.

Deviations from the paper
    1. The paper gives only the model. Both sides of a comparison are queries, so we embed them the
       same way: one optional `prompt` prefix for both (default none), not Qwen3-Embedding's
       asymmetric query-instruction / document pair.
    2. Pairs scoring below `min_score` (default 0.0, cosine) are dropped; the bank also drops scores
       <= 0. Dense scores are rarely exactly unrelated, so a bank of >= k entries nearly always fills
       its k slots, unlike BM25, which returns nothing without a shared token.
    3. Embeddings are cached per text, so a refit after an upsert embeds only the new query.

Launch: no entry point. Full mode: RubricBank(retriever=DenseRetriever(FullConfig.embed_model)).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from typing import TYPE_CHECKING, Sequence

from backends.scale.zero3_scope import zero3_suspended
from bank import PAPER_EMBED_MODEL  # PAPER: Qwen3-Embedding-0.6B

if TYPE_CHECKING:
    import torch

log = logging.getLogger("rubricem.retrieval")

POOLING_MODES = ("mean", "lasttoken", "cls")


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Pool token states into one vector per text.

    hidden: (B, L, H) float; attention_mask: (B, L) {0,1}, left or right padded. mode "mean" (mean
    over real tokens), "lasttoken" (the last real token, wherever padding sits) or "cls" (position 0
    of each row's real tokens). Returns (B, H) float32. Raises ValueError for an unknown mode.
    """
    import torch  # lazy: importing this module loads no model library

    m = attention_mask.to(hidden.dtype)
    if mode == "mean":
        # Eq.: pool = sum_t m_t h_t / sum_t m_t
        return ((hidden * m[..., None]).sum(1) / m.sum(1, keepdim=True).clamp(min=1)).float()
    L = hidden.shape[1]
    pos = torch.arange(L, device=hidden.device).expand_as(attention_mask)
    if mode == "lasttoken":
        idx = torch.where(attention_mask.bool(), pos, -1).max(1).values.clamp(min=0)  # (B,)
    elif mode == "cls":
        idx = torch.where(attention_mask.bool(), pos, L).min(1).values.clamp(max=L - 1)
    else:
        raise ValueError(f"unknown pooling mode {mode!r}; expected one of {POOLING_MODES}")
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), idx].float()


def pooling_mode(model: str, local_files_only: bool = False) -> str:
    """The pooling a sentence-transformers folder declares in 1_Pooling/config.json (local folder or
    hub cache); without it, "lasttoken" for Qwen3-Embedding models and "mean" otherwise."""
    path = os.path.join(model, "1_Pooling", "config.json")
    if not os.path.isfile(path):
        try:
            # lazy: huggingface_hub only for a model named on the Hub
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(model, "1_Pooling/config.json", local_files_only=local_files_only)
        except Exception:  # no such file, offline, or not a hub id: fall back to the name
            path = None
    if path:
        with open(path) as fh:
            cfg = json.load(fh)
        for key, mode in (("pooling_mode_lasttoken", "lasttoken"), ("pooling_mode_cls_token", "cls"),
                          ("pooling_mode_mean_tokens", "mean")):
            if cfg.get(key):
                return mode
    return "lasttoken" if "qwen3-embedding" in model.lower() else "mean"


class DenseRetriever:
    """bank.Retriever over sentence embeddings: cosine top-k among the fitted queries.

    model: a local folder or hub id (default: the paper's Qwen/Qwen3-Embedding-0.6B). backend: "auto"
    (sentence-transformers when importable, else transformers), "sentence-transformers" or
    "transformers". device: "auto" (cuda when available), "cpu", "cuda", ... prompt: prefix for every
    text (deviation 1). min_score: drop pairs below this cosine (deviation 2). local_files_only: never
    download. Raises ImportError naming the package for a missing backend, OSError when the model
    cannot be found, ValueError for an unknown backend.
    """

    def __init__(self, model: str | os.PathLike = PAPER_EMBED_MODEL, *, backend: str = "auto", device: str = "auto",
                 batch_size: int = 32, max_length: int = 512, prompt: str = "", min_score: float = 0.0,
                 local_files_only: bool = False):
        import torch  # lazy: as above

        if backend not in ("auto", "sentence-transformers", "transformers"):
            raise ValueError(f"unknown backend {backend!r}")
        if backend == "auto":
            have_st = importlib.util.find_spec("sentence_transformers") is not None
            backend = "sentence-transformers" if have_st else "transformers"
        model = os.fspath(model)
        self.model_name, self.backend = model, backend
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        self.batch_size, self.max_length = int(batch_size), int(max_length)
        self.prompt, self.min_score = prompt, float(min_score)
        self._cache: dict[str, "torch.Tensor"] = {}
        self._emb: "torch.Tensor | None" = None  # (N, D) fitted, L2-normalised
        # SCALE: in full mode only rank 0 builds the retriever. Were transformers' ZeRO-3 switch on
        # here, from_pretrained would partition the embedding model with collectives that the other
        # ranks never join (a gloo size mismatch, an NCCL hang): it is off for the load.
        with zero3_suspended() as was_on:
            if was_on:
                log.warning("DenseRetriever: transformers' ZeRO-3 loading was on; the embedding model "
                            "loads as a plain model on this rank")
            self._load(model, local_files_only)

    def _load(self, model: str, local_files_only: bool) -> None:
        if self.backend == "sentence-transformers":
            try:
                # lazy: sentence_transformers only when the model loads
                from sentence_transformers import SentenceTransformer
            except ImportError:
                raise ImportError("backend 'sentence-transformers' needs pip install "
                                  "sentence-transformers") from None
            self._st = SentenceTransformer(model, device=self.device, local_files_only=local_files_only)
            self._st.max_seq_length = self.max_length
        else:
            from transformers import AutoModel, AutoTokenizer  # lazy: transformers only when the model loads

            self._tok = AutoTokenizer.from_pretrained(model, local_files_only=local_files_only)
            self._model = AutoModel.from_pretrained(model, local_files_only=local_files_only)
            self._model.to(self.device).eval()
            self.pooling = pooling_mode(model, local_files_only)

    def _embed_new(self, texts: list[str]) -> "torch.Tensor":
        import torch  # lazy: as above

        if self.backend == "sentence-transformers":
            e = self._st.encode([self.prompt + t for t in texts], batch_size=self.batch_size,
                                convert_to_tensor=True, normalize_embeddings=True,
                                show_progress_bar=False)
            return e.float().cpu()
        out = []
        for s in range(0, len(texts), self.batch_size):
            enc = self._tok([self.prompt + t for t in texts[s : s + self.batch_size]], padding=True,
                            truncation=True, max_length=self.max_length, return_tensors="pt")
            enc = {k: v.to(self.device) for k, v in enc.items()}
            with torch.no_grad():
                h = self._model(**enc).last_hidden_state  # (B, L, H)
            out.append(pool(h, enc["attention_mask"], self.pooling).cpu())
        # Eq.: e(x) = pool(h(x)) / ||pool(h(x))||_2
        return torch.nn.functional.normalize(torch.cat(out), dim=-1)

    def embed(self, texts: Sequence[str]) -> "torch.Tensor":
        """(N, D) float32 CPU, unit L2 norm, one row per text (cached per text; deviation 3)."""
        import torch  # lazy: as above

        new = list(dict.fromkeys(t for t in texts if t not in self._cache))
        if new:
            for t, e in zip(new, self._embed_new(new)):
                self._cache[t] = e
        if not texts:
            return torch.zeros(0, 0)
        return torch.stack([self._cache[t] for t in texts])

    def fit(self, queries: list[str]) -> None:
        """Index the bank's stored queries (in the bank's order)."""
        self._emb = self.embed(list(queries)) if queries else None

    def topk(self, query: str, k: int) -> list[tuple[int, float]]:
        """At most k (index, cosine) pairs, best first, ties by lower index; pairs below min_score are
        dropped. [] when k <= 0 or nothing is fitted."""
        if k <= 0 or self._emb is None or not len(self._emb):
            return []
        import torch  # lazy: as above

        q = self.embed([query])[0]
        # Eq.: score(q, j) = e(q) . e(q_j)
        scores = self._emb @ q  # (N,)
        order = torch.sort(-scores, stable=True).indices[:k]
        return [(int(i), float(scores[i])) for i in order if scores[i] >= self.min_score]

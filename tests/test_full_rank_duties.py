"""Which rank or node does what in full mode, without launching processes (faked launcher
environments, stand-ins for models, DeepSpeed and process groups):
  * node-local duties follow LOCAL_RANK: the CUDA device of the trainer (dist.init_distributed);
  * global duties follow RANK: only rank 0 reads the RL rows (ranks > 0 build their search tool and
    get their queries from rank 0), and the dry run asks `datasets` of rank 0 alone;
  * rank 0's receiving threads each read from their own 2-member side group, and a failed receive
    stops the run naming the rank (engine.ZeRO3Engine.sample_shards);
  * no plain HF copy on rank 0 when ZeRO-3 samples with vLLM: the reference is fingerprinted from
    the weight files (resume.reference_record), a resume compares it in the checkpoint's own kind,
    and ZeRO3Engine.load restores no copy.
The processes themselves (4 ranks, 2 nodes): tests/test_full_ranks.py."""
import importlib.util
import json
import os
import sys
import threading
import types

import pytest
import torch

import train
from backends.run import build, checkpoint as ckpt_mod, presets, resume
from backends.run.data import PAPER_RL_DATA
from toyfix import tiny_tokenizer, tiny_world

HAVE_DS = importlib.util.find_spec("deepspeed") is not None


def _full_cfg(tmp_path, **set_):
    """The full preset pointed at a model folder under tmp_path, with `set_` applied (dotted keys)."""
    cfg = presets.full_preset()
    cfg.model, cfg.run_dir, cfg.cache_dir = str(tmp_path / "model"), str(tmp_path / "run"), str(tmp_path / "cache")
    for key, value in set_.items():
        *path, name = key.split("__")
        setattr(cfg if not path else getattr(cfg, path[0]), name, value)
    return cfg


def _rows_file(path) -> str:
    """The tiny world's training questions as DR Tulu-schema rows in a local JSONL file."""
    with open(path, "w") as fh:
        for r in tiny_world().train_rows:
            fh.write(json.dumps({k: v for k, v in r.items() if k != "toy"}) + "\n")
    return str(path)


def _model_dir(path, seed: int = 0) -> str:
    """A tiny Qwen3 saved as a Hugging Face folder (safetensors + config + tokenizer)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from toy import model as toy_model

    torch.manual_seed(seed)
    tok = tiny_tokenizer()
    m = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), max_position_embeddings=256,
                                     tie_word_embeddings=True, **toy_model.SIZES["XS"]))
    m.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


# ----------------------------------------------------------------------------------------------------
# Node-local duties: LOCAL_RANK


@pytest.mark.skipif(not HAVE_DS, reason="deepspeed is not installed")
def test_the_trainer_takes_the_gpu_numbered_local_rank_not_rank(monkeypatch):
    import deepspeed

    from backends.distributed import dist

    devices = []
    threads_mod = sys.modules.get("backends.scale.cuda_threads")  # where the device is recorded
    if threads_mod is not None and hasattr(threads_mod, "_device"):
        monkeypatch.setattr(threads_mod, "_device", threads_mod._device)  # restored after the test
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: None)
    # global rank 3 of 4 is the second rank of the second node
    env = dist.init_distributed(dist.dist_env({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
                                               "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}))
    assert devices == [1] and env.rank == 3


# ----------------------------------------------------------------------------------------------------
# Global duties: RANK (the rows are read on rank 0 only)


def test_a_rank_above_0_builds_its_rollouts_without_reading_rows(tmp_path, monkeypatch):
    """Ranks > 0 never use rows (their queries come with each "sample" command): they build the
    search tool only, so the data set is read once per run, and an offline node or one without
    `datasets` hosts them (the hub id below would need both)."""
    cfg = _full_cfg(tmp_path, sampler="hf", data__source=PAPER_RL_DATA)

    def rows(*a, **k):
        raise AssertionError("a rank > 0 read the RL rows")

    monkeypatch.setattr(build, "load_rl_rows", rows)
    monkeypatch.setattr(build, "load_policy", lambda path, dtype: (torch.nn.Linear(2, 2), tiny_tokenizer()))
    copy, ce = build.rank_rollouts(cfg)
    assert isinstance(copy, torch.nn.Linear)
    assert type(ce.engine.tools["google_search"]).__name__ == "SerperSearchTool"
    # rank 0 does read them (build_environment), and says which setting when it cannot
    with pytest.raises(AssertionError, match="read the RL rows"):
        build.build_environment(cfg)


def test_the_dry_run_asks_datasets_of_rank_0_only_and_names_the_offline_way(tmp_path, monkeypatch):
    from backends.distributed import dry_run

    cfg = _full_cfg(tmp_path, data__source=PAPER_RL_DATA)
    monkeypatch.setattr(dry_run, "_version", lambda dist: None if dist == "datasets" else "9.9")
    launched = {"WORLD_SIZE": "4", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    _, p0 = dry_run.dry_run(cfg, {**launched, "RANK": "0", "LOCAL_RANK": "0"})
    _, p2 = dry_run.dry_run(cfg, {**launched, "RANK": "2", "LOCAL_RANK": "0"})
    need = [p for p in p0 if p.startswith("datasets is not installed")]
    assert len(need) == 1 and 'data.source="rows.jsonl"' in need[0], p0
    assert not any(p.startswith("datasets") for p in p2), p2


# ----------------------------------------------------------------------------------------------------
# Rank 0's receiving threads


class _Sampler:
    stats: dict = {}


class _Rollouts:
    """A rollout_engine.ConcurrentRolloutEngine stand-in: rank 0's share, one rollout per query."""

    def __init__(self):
        self.engine = types.SimpleNamespace(sampler=_Sampler(), stats={})
        self.stats = {}

    def run(self, queries, n, items, seed, temperature, on_group_done=None, sink=None):
        sink[:] = [f"own {q}" for q in queries for _ in range(n)]
        return sink


def _engine(world: int):
    """A ZeRO3Engine of rank 0 in a `world` without processes: every rank samples, side groups are
    named stand-ins, commands go nowhere."""
    from backends.distributed import engine

    e = engine.ZeRO3Engine.__new__(engine.ZeRO3Engine)
    e.world_size, e.rollout_metrics = world, {}
    e.side = {r: f"group-0-{r}" for r in range(1, world)}
    e._send = lambda kind, payloads=None: None
    return e


@pytest.mark.skipif(not HAVE_DS, reason="deepspeed is not installed")
def test_each_receiving_thread_reads_its_own_side_group(monkeypatch):
    e, seen, lock = _engine(4), [], threading.Lock()

    def recv(box, src, group):
        with lock:
            seen.append((src, group, threading.current_thread()))
            first = sum(s == src for s, _, _ in seen) == 1
        box[:] = [src, [f"from {src}"]] if first else \
            [None, {"seconds": 1.0, "cpu_seconds": 1.0, "stats": {}, "error": None}]

    monkeypatch.setattr(torch.distributed, "recv_object_list", recv)
    out = e.sample_shards(_Rollouts(), ["q0", "q1", "q2", "q3"], 1, None, seed=0)
    assert out == ["own q0", "from 1", "from 2", "from 3"]
    assert sorted({(s, g) for s, g, _ in seen}) == [(1, "group-0-1"), (2, "group-0-2"), (3, "group-0-3")]
    threads = {t for _, _, t in seen}  # one thread per sending rank, none of them this one
    assert len(threads) == 3 and threading.current_thread() not in threads
    assert e.rollout_metrics["rollout/sampling_ranks"] == 4


@pytest.mark.skipif(not HAVE_DS, reason="deepspeed is not installed")
def test_a_failed_receive_stops_the_step_naming_the_rank(monkeypatch):
    e = _engine(3)

    def recv(box, src, group):
        if src == 2:
            raise RuntimeError("Connection closed by peer")
        box[:] = [None, {"seconds": 1.0, "cpu_seconds": 1.0, "stats": {}, "error": None}]

    monkeypatch.setattr(torch.distributed, "recv_object_list", recv)
    with pytest.raises(RuntimeError, match=r"rank 2: receiving its rollouts failed: RuntimeError: "
                                           r"Connection closed by peer"):
        e.sample_shards(_Rollouts(), ["q0", "q1", "q2"], 1, None, seed=0)


# ----------------------------------------------------------------------------------------------------
# No plain copy on rank 0 with vLLM; the reference fingerprinted from its files


def test_rank_0_keeps_a_plain_copy_unless_zero3_samples_with_vllm(tmp_path, monkeypatch):
    assert not build.rank0_plain_copy(_full_cfg(tmp_path))  # the full preset: zero3 + vllm
    assert build.rank0_plain_copy(_full_cfg(tmp_path, sampler="hf"))
    assert build.rank0_plain_copy(_full_cfg(tmp_path, engine="torch"))  # vLLM beside the torch engine
    cfg = _full_cfg(tmp_path)
    cfg.model = _model_dir(tmp_path / "model")

    def no_copy(*a, **k):
        raise AssertionError("the plain copy was loaded")

    monkeypatch.setattr(build, "load_policy", no_copy)
    model, tok, info = build.setup_policy(cfg, None, None, weights=False)
    assert model is None and len(tok) == len(tiny_tokenizer()) and info == {"source": cfg.model}


class _Stop(Exception):
    pass


@pytest.mark.skipif(not HAVE_DS, reason="deepspeed is not installed")
def test_train_with_vllm_builds_the_zero3_engine_without_a_plain_copy(tmp_path, monkeypatch):
    """train.train on rank 0 up to the ZeRO-3 engine, with the full preset's vLLM sampler: no plain
    HF copy is loaded, and the reference record is the weight files' fingerprint."""
    from backends.distributed import dist, engine

    cfg = _full_cfg(tmp_path, data__source=_rows_file(tmp_path / "rows.jsonl"), rollout__prompts_per_step=2)
    cfg.model = _model_dir(tmp_path / "model")
    built = {}

    class Engine:
        def __init__(self, cfg, model):
            built["model"] = model
            raise _Stop

    monkeypatch.setattr(dist, "init_distributed", lambda timeout_min=None: dist.DistEnv(launched=True))
    monkeypatch.setattr(engine, "ZeRO3Engine", Engine)
    monkeypatch.setattr(build, "load_policy", lambda *a, **k: pytest.fail("the plain copy was loaded"))
    refs = []
    monkeypatch.setattr(train, "reference_record", lambda *a: refs.append(a) or resume.reference_record(*a))
    with pytest.raises(_Stop):
        train.train(cfg)
    assert built == {"model": None}
    assert len(refs) == 1 and refs[0][1] is None and refs[0][2] == cfg.model


def test_files_fingerprint_follows_the_weight_files_only(tmp_path):
    d = _model_dir(tmp_path / "m")
    fp = ckpt_mod.files_fingerprint(d)
    assert fp == ckpt_mod.files_fingerprint(d) and len(fp) == 64
    with open(os.path.join(d, "config.json"), "a") as fh:  # not a weight file
        fh.write("\n")
    assert ckpt_mod.files_fingerprint(d) == fp
    path = os.path.join(d, "model.safetensors")
    raw = bytearray(open(path, "rb").read())
    raw[-1] ^= 1  # one bit of one weight
    open(path, "wb").write(bytes(raw))
    assert ckpt_mod.files_fingerprint(d) != fp
    os.remove(path)
    with pytest.raises(ckpt_mod.CheckpointError, match="no \\*.safetensors or \\*.bin weight files"):
        ckpt_mod.files_fingerprint(d)


def test_reference_records_compare_in_kind_and_name_both_sources(tmp_path, monkeypatch):
    d = _model_dir(tmp_path / "m")
    model = torch.nn.Linear(2, 2)
    weights = resume.reference_record("sft", model)
    files = resume.reference_record("sft", None, d)
    assert (weights["kind"], files["kind"]) == ("weights", "files")
    assert weights["sha256"] == ckpt_mod.weights_fingerprint(model)
    assert files["sha256"] == ckpt_mod.files_fingerprint(d)
    resume.check_reference(dict(files), files, "ckpt")
    # a record written before kinds is a weights record
    resume.check_reference({k: v for k, v in weights.items() if k != "kind"}, weights, "ckpt")
    for saved in (dict(files, sha256="0" * 64), weights):
        with pytest.raises(ckpt_mod.CheckpointError, match=r"cannot resume from ckpt: .*rebuilt from sft"):
            resume.check_reference(saved, files, "ckpt")
    with pytest.raises(ValueError, match="the loaded model or its folder"):
        resume.reference_record("sft")


def test_a_resume_compares_an_old_checkpoints_reference_in_its_own_kind(tmp_path, monkeypatch):
    """A vLLM run's checkpoint written before file fingerprints holds the loaded copy's: train loads
    the copy once for it; a new one (kind "files") needs none."""
    cfg = _full_cfg(tmp_path)
    cfg.model = _model_dir(tmp_path / "model")
    loads = []
    real = build.load_policy
    monkeypatch.setattr(build, "load_policy", lambda *a, **k: loads.append(a) or real(*a, **k))
    info = {"source": cfg.model}
    new = train.reference_of(cfg, None, info, {"reference": {"source": cfg.model, "kind": "files"}})
    assert new["kind"] == "files" and not loads
    old = train.reference_of(cfg, None, info, {"reference": {"source": cfg.model, "sha256": "x"}})
    assert old["kind"] == "weights" and len(loads) == 1
    assert old["sha256"] == ckpt_mod.weights_fingerprint(real(cfg.model)[0])


@pytest.mark.skipif(not HAVE_DS, reason="deepspeed is not installed")
def test_zero3_engine_load_restores_no_plain_copy_when_there_is_none(tmp_path):
    from backends.distributed import engine

    e = engine.ZeRO3Engine.__new__(engine.ZeRO3Engine)
    loaded = []
    e.world_size, e.model = 1, None
    e.policy = types.SimpleNamespace(engine=types.SimpleNamespace(
        load_checkpoint=lambda d, **kw: loaded.append(os.path.basename(d))))
    os.makedirs(tmp_path / "ck" / "zero")  # a checkpoint without model/: only DeepSpeed's state
    e.load(str(tmp_path / "ck"), {})
    assert loaded == ["zero"]

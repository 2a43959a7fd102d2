#!/usr/bin/env bash
# GPU smoke run of the full-mode pieces that exist today (RubricEM, arXiv 2605.10899, appendix setup):
#   1. a tiny Qwen3 + tokenizer written to a scratch folder;
#   2. the ZeRO-3 policy engine (-m backends.full selftest: ZeRO-3, optimizer offloaded to CPU, gradient
#      checkpointing, bf16) on one GPU via torchrun, a few SS-GRPO update steps, update tokens/s;
#   3. benchmarks/logprob_memory.py on the GPU at the paper's pack length (26,624 tokens, vocab 151,936);
#   4. generation tokens/s with HF generate, and with vLLM when `import vllm` works;
#   5. the full RL loop: `train.py --full` under torchrun on 1 rank (ZeRO-3 engine, vLLM sampler
#      with weight sync when vllm imports, else HF generate), with the Gemini judge and Serper search
#      on loopback servers; per-step times and sampling tokens/s.
#
# Installs nothing. On a fresh GPU machine first run, from the repository root:
#   pip install torch && pip install -e ".[full,test]"   # DeepSpeed, accelerate, requests, ...
#   pip install vllm                                      # optional; pins its own torch/transformers
# Usage:  bash scripts/gpu_smoke.sh [OUT_DIR]       (about 3-5 minutes on one GPU)
# Env:    SMOKE_SIZE=S|M (toy model size), SMOKE_UPDATES=5, SMOKE_SEQ=26624 (log-prob benchmark length),
#         SMOKE_STEPS=3 (RL steps in section 5),
#         SMOKE_DS_OPT=1 (DeepSpeed's CPU Adam instead of torch AdamW: JIT-compiles cpu_adam first),
#         SMOKE_ALLOW_CPU=1 (run the plumbing on CPU with small sizes; for checking this script only).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_smoke}
PY=${PYTHON:-python}
SIZE=${SMOKE_SIZE:-S}
UPDATES=${SMOKE_UPDATES:-5}
SEQ=${SMOKE_SEQ:-26624}
SMOKE_STEPS=${SMOKE_STEPS:-3}
mkdir -p "$OUT"
export TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  if [ "${SMOKE_ALLOW_CPU:-0}" != "1" ]; then
    echo "no GPU visible (torch.cuda.is_available() is False); set SMOKE_ALLOW_CPU=1 to check the plumbing on CPU"
    exit 2
  fi
  echo "NOTE: running on CPU (SMOKE_ALLOW_CPU=1) with small sizes: figures are not GPU figures"
  DEV=cpu; SEQ=${SMOKE_SEQ_CPU:-1024}; NSEQ=16; MICRO=2; MINLEN=24; MAXLEN=48; GEN=32; BCHUNK=128
  RL_PROMPTS=2; RL_TOKENS=96
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
else
  DEV=cuda; NSEQ=64; MICRO=8; MINLEN=256; MAXLEN=512; GEN=256; BCHUNK=1024
  RL_PROMPTS=8; RL_TOKENS=512
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
RAN=(); FAILED=()
section() { echo; echo "=== $1"; }
ok() { RAN+=("$1"); }
bad() { FAILED+=("$1"); echo "FAILED: $1"; }

section "versions"
$PY - <<'PYEOF'
import importlib.metadata as md
for d in ("torch", "transformers", "deepspeed", "accelerate", "vllm"):
    try:
        print(f"{d} {md.version(d)}")
    except md.PackageNotFoundError:
        print(f"{d} not installed")
PYEOF

section "1. tiny Qwen3 (size $SIZE) -> $OUT/tiny"
if $PY - "$OUT/tiny" "$SIZE" <<'PYEOF'
import sys
from toy import model as policy
from scaffold import SYSTEM_PROMPT
texts = [SYSTEM_PROMPT, "The quick brown fox jumps over the lazy dog. " * 50,
         "Research plan, rubrics, evidence, review and a cited answer. " * 50]
tok = policy.train_tokenizer(texts, vocab_size=1024)
m = policy.build_tiny_qwen3(tok, sys.argv[2])
m.save_pretrained(sys.argv[1]); tok.save_pretrained(sys.argv[1])
print(f"{sum(p.numel() for p in m.parameters()):,} parameters, vocab {len(tok)}")
PYEOF
then ok "tiny model"; else bad "tiny model"; fi

section "2. ZeRO-3 policy engine on 1 $DEV rank: $UPDATES updates x 2 optimizer steps, $NSEQ sequences of $MINLEN-$MAXLEN tokens"
OPT=torch; [ "${SMOKE_DS_OPT:-0}" = "1" ] && OPT=deepspeed
if $PY -m torch.distributed.run --nproc_per_node 1 --master_port "$($PY -c 'from backends import full; print(full.free_port())')" \
     -m backends.full selftest --model "$OUT/tiny" --out "$OUT/zero3" --updates "$UPDATES" --n-seq "$NSEQ" \
     --group 8 --minibatches 2 --micro "$MICRO" --min-len "$MINLEN" --max-len "$MAXLEN" --optimizer "$OPT" \
     2>"$OUT/zero3.log"; then
  ok "ZeRO-3 engine ($OPT AdamW, optimizer offloaded to CPU, gradient checkpointing)"
  $PY -c "import json; s=json.load(open('$OUT/zero3/stats.json')); print('update tokens/s', round(s['update_tokens_per_s']), '| peak GPU GiB', s['peak_gpu_mem_gb'])"
else bad "ZeRO-3 engine (see $OUT/zero3.log)"; tail -n 20 "$OUT/zero3.log"; fi

section "3. log-prob pass memory/time, $SEQ tokens, vocab 151,936"
if $PY benchmarks/logprob_memory.py --device "$DEV" --seq-len "$SEQ" --chunk "$BCHUNK" --json "$OUT/logprob.json"; then
  ok "log-prob benchmark"; else bad "log-prob benchmark"; fi

section "4. generation throughput ($GEN new tokens per sequence, batch 1 and 32)"
cat > "$OUT/gen_speed.py" <<'PYEOF'
import sys, time, importlib.util
import torch

path, n_new, dev = sys.argv[1], int(sys.argv[2]), sys.argv[3]
prompts = ["Write a short cited report on the habitat of the Kuvebro."] * 32

def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
    for b in (1, 32):
        enc = tok(prompts[:b], return_tensors="pt", padding=True).to(dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = m.generate(**enc, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=True)
        if dev == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        n = (out.shape[1] - enc["input_ids"].shape[1]) * b
        print(f"HF generate   batch {b:2d}: {n / dt:9.0f} tokens/s ({n} tokens, {dt:.2f} s)")

def vllm_speed():
    from vllm import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(model=path, dtype="bfloat16", gpu_memory_utilization=0.3, enforce_eager=True, seed=0)
    print(f"vLLM engine init {time.perf_counter() - t0:.1f} s")
    sp = SamplingParams(max_tokens=n_new, min_tokens=n_new, ignore_eos=True, temperature=1.0)
    for b in (1, 32):
        t0 = time.perf_counter()
        outs = llm.generate(prompts[:b], sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"vLLM generate batch {b:2d}: {n / dt:9.0f} tokens/s ({n} tokens, {dt:.2f} s)")

if __name__ == "__main__":
    hf()
    if dev == "cuda" and importlib.util.find_spec("vllm") is not None:
        vllm_speed()
    else:
        print("vLLM: not run (" + ("not installed" if dev == "cuda" else "CPU run") + ")")
PYEOF
if $PY "$OUT/gen_speed.py" "$OUT/tiny" "$GEN" "$DEV" 2>"$OUT/gen.log"; then ok "generation timing"
else bad "generation timing (see $OUT/gen.log)"; tail -n 20 "$OUT/gen.log"; fi

section "5. the full RL loop on 1 $DEV rank: train.py --full, $SMOKE_STEPS steps, judge + search on loopback servers"
# The GPU machine may have no internet: the Gemini judge and Serper search are loopback servers that
# speak their wire formats (tests/loopback.py), so this measures our side of the loop, not an API.
SAMPLER=hf
if [ "$DEV" = cuda ] && $PY -c "import vllm" 2>/dev/null; then SAMPLER=vllm; fi
rm -f "$OUT/loopback.json"
$PY tests/loopback.py "$OUT/loopback.json" >"$OUT/loopback.log" 2>&1 &
LB=$!
for _ in $(seq 50); do [ -f "$OUT/loopback.json" ] && break; sleep 0.2; done
$PY - "$OUT" <<'PYEOF'
import json, sys
sys.path.insert(0, "tests")
from toyfix import tiny_world
with open(f"{sys.argv[1]}/rows.jsonl", "w") as fh:  # DR Tulu-schema RL rows from the toy world
    for r in tiny_world().train_rows:
        fh.write(json.dumps({k: v for k, v in r.items() if k != "toy"}) + "\n")
PYEOF
GURL=$($PY -c "import json; print(json.load(open('$OUT/loopback.json'))['gemini'])")
SURL=$($PY -c "import json; print(json.load(open('$OUT/loopback.json'))['serper'])")
rm -rf "$OUT/rl"
if GEMINI_API_KEY=sk-TESTKEY-1234567890 SERPER_API_KEY=sk-TESTKEY-1234567890 PYTHONPATH="$PWD/tests:$PYTHONPATH" \
   $PY -m torch.distributed.run --nproc_per_node 1 --master_port "$($PY -c 'from backends import full; print(full.free_port())')" \
     train.py --full --model "$OUT/tiny" --steps "$SMOKE_STEPS" --run-dir "$OUT/rl" --no-progress \
     --set data.source="\"$OUT/rows.jsonl\"" --set judge.base_url="\"$GURL\"" --set judge.model='"gemini-test"' \
     --set search.base_url="\"$SURL\"" --set sampler="\"$SAMPLER\"" --set bank.retriever='"bm25"' \
     --set rollout.prompts_per_step="$RL_PROMPTS" --set rollout.n=8 --set rollout.max_response_tokens="$RL_TOKENS" \
     --set reflection.max_new_tokens=64 --set ss_grpo.micro_batch="$MICRO" --set ss_grpo.lr=1e-5 \
     --set cache_dir="\"$OUT/rl-cache\"" --set checkpoint.every=0 >"$OUT/rl.log" 2>&1; then
  ok "full RL loop (ZeRO-3, sampler $SAMPLER, HTTP judge + search on loopback)"
  $PY - "$OUT/rl/metrics.jsonl" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows:
    print(f"step {r['step']}: {r['time/step_s']:.1f} s (rollout {r['time/rollout_s']:.1f}, judge "
          f"{r['time/judge_s']:.1f}, update {r['time/update_s']:.1f}, sync {r['time/sync_s']:.2f}, "
          f"reflection {r['time/reflection_s']:.1f}); {r['tokens/total']} response tokens, "
          f"{r['tokens/total'] / max(r['time/rollout_s'], 1e-9):.0f} tokens/s sampled; loss {r['loss/total']:.4f}")
PYEOF
else bad "full RL loop (see $OUT/rl.log)"; tail -n 30 "$OUT/rl.log"; fi
kill "$LB" 2>/dev/null; wait "$LB" 2>/dev/null; cat "$OUT/loopback.log"

section "summary"
for r in "${RAN[@]}"; do echo "ran:    $r"; done
for f in ${FAILED[@]+"${FAILED[@]}"}; do echo "failed: $f"; done
echo "not run here: more than one GPU, a real Gemini / Serper endpoint"
[ ${#FAILED[@]} -eq 0 ]

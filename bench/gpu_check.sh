#!/usr/bin/env bash
# postrl's CUDA paths on one GPU, in under 10 minutes (docs/scaling.md, "GPU"):
#   preflight   torch sees a GPU; the SmolLM2 tokenizer is found
#   pytest      the CUDA tests, and the Ray actors' bodies driven directly, without Ray:
#               tests/train/test_cuda.py, tests/distributed/test_cuda_workers.py, ... (below)
#   tiny-*      `device=cuda` local training on the tiny model, fp32 / bf16 / bf16-master,
#               and PPO (a critic) in bf16-master
#   smollm2-*   the same on a randomly initialised SmolLM2-135M-shaped model, 64 and 256 tokens
#   ray-*       only where Ray imports: launcher=ray with 1+1 actors sharing the GPU
#               (DDP, FSDP2, and multi-turn episodes)
# Every stage runs under its own `timeout`, and none starts past the whole check's budget
# ($GPU_CHECK_BUDGET seconds, default 540); each training stage asserts its models ran on
# CUDA and prints one JSON line (step time, tokens/s, peak memory: bench/gpu_train.py, run
# as `python3 -m bench.gpu_train` from the repo root).
# Needs: python3 with a CUDA torch, transformers, peft, pytest, hypothesis; postrl's code at the
# repo root; no network. The tokenizer (and SmolLM2's config.json) come from postrl's cache
# ($POSTRL_CACHE or ~/.cache/postrl/models/smollm2-135m-instruct), or from
# .gpu_check_tokenizer/ at the repo root, which bench/gpu_check_prepare.sh fills.
# Logs go to a temporary folder, packed into gpu_check.tar.gz in $OUT (if set) or beside it.
# Usage: bash bench/gpu_check.sh        exit status 0 iff every stage passed
#        GPU_CHECK_DEVICE=cpu bash bench/gpu_check.sh   the same stages on the CPU (a dry run)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
LOGS="$(mktemp -d /tmp/postrl-gpu-check.XXXXXX)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
BUDGET="${GPU_CHECK_BUDGET:-540}"
export POSTRL_TEST_DEVICE="$DEVICE"
SUMMARY=()
FAILED=0

result() {  # name, status (0 = pass), seconds
    local word=PASS
    [ "$2" -eq 0 ] || { word=FAIL; FAILED=1; }
    [ "$2" -eq 124 ] && word="FAIL (timed out)"
    SUMMARY+=("$word $1 (${3}s)")
    echo "== ${SUMMARY[-1]}"
}

finish() {
    echo; echo "== summary (logs in $LOGS)"
    printf '%s\n' "${SUMMARY[@]}" | tee "$LOGS/summary.txt"
    local archive="${OUT:-$(dirname "$LOGS")}/gpu_check.tar.gz"
    tar czf "$archive" -C "$LOGS" --exclude='*.safetensors' . && echo "logs packed in $archive"
    exit "$FAILED"
}

stage() {  # name, seconds allowed, command...: runs it under timeout, logs to LOGS/name.log
    local name=$1 limit=$2; shift 2
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt 20 ]; then SUMMARY+=("SKIP $name (the check's budget is spent)"); return; fi
    [ "$limit" -le "$left" ] || limit=$left
    echo "== $name: $*"
    local start=$SECONDS
    timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
    local status=$?
    tail -n 4 "$LOGS/$name.log"
    result "$name" $status $((SECONDS - start))
}

# packages the GPU machine lacks (Ray) may come as wheels in .whl/ (gpu_check_prepare.sh --ray)
if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/postrl-gpu-site "$ROOT"/.whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/postrl-gpu-site"
fi

echo "== nvidia-smi"
nvidia-smi 2>&1 | tee "$LOGS/nvidia-smi.txt"
python3 - <<'PY' 2>&1 | tee "$LOGS/preflight.txt"
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("transformers", transformers.__version__)
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0), "count", torch.cuda.device_count())
PY
if [ "$DEVICE" = cuda ]; then
    timeout 60 python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    result "preflight: torch sees a CUDA GPU" $? 0
fi
[ "$FAILED" -eq 0 ] || finish

CACHED="${POSTRL_CACHE:-$HOME/.cache/postrl}/models/smollm2-135m-instruct"
if [ ! -f "$CACHED/config.json" ] && [ -f "$ROOT/.gpu_check_tokenizer/tokenizer.json" ]; then
    export POSTRL_CACHE="$LOGS/cache"  # a cache holding only the tokenizer and config
    mkdir -p "$POSTRL_CACHE/models/smollm2-135m-instruct"
    cp "$ROOT"/.gpu_check_tokenizer/* "$POSTRL_CACHE/models/smollm2-135m-instruct/"
fi
stage "preflight-tokenizer" 120 python3 -c "from postrl.models import load_policy; load_policy('tiny')"
[ "$FAILED" -eq 0 ] || finish

for precision in fp32 bf16 bf16-master; do
    stage "tiny-$precision" 90 python3 -m bench.gpu_train --model tiny --precision "$precision" \
        --device "$DEVICE" --steps 4 --out "$LOGS/tiny-$precision"
done

stage "tiny-ppo-bf16-master" 90 python3 -m bench.gpu_train --model tiny --recipe ppo \
    --precision bf16-master --device "$DEVICE" --steps 4 --out "$LOGS/tiny-ppo-bf16-master"

stage pytest 240 python3 -m pytest -q -rs -p no:cacheprovider \
    tests/train/test_cuda.py tests/distributed/test_cuda_workers.py \
    tests/distributed/test_weights.py tests/distributed/test_weight_push.py \
    tests/distributed/test_fsdp_single_worker.py tests/rollout/test_hf_engine.py

for tokens in 64 256; do
    for precision in fp32 bf16; do
        stage "smollm2-$precision-$tokens" 90 python3 -m bench.gpu_train --model smollm2-shape \
            --precision "$precision" --device "$DEVICE" --steps 3 --max-new-tokens "$tokens" \
            --out "$LOGS/smollm2-$precision-$tokens"
    done
done

if python3 -c "import ray" 2>/dev/null; then
    RUN=(model=tiny task=arithmetic steps=3 prompts_per_step=2 group_size=4 max_new_tokens=8
         lr=1e-3 quiet=true overwrite=true launcher=ray rollout_workers=1 train_workers=1
         worker_gpus=0.5 "rewards=[$ROOT/tests/train/rewards_for_tests.py:length_parity]")
    for parallel in ddp fsdp2; do
        stage "ray-$parallel" 120 python3 -m postrl.cli train "${RUN[@]}" \
            "out=$LOGS/ray-$parallel" "train_parallel=$parallel"
    done
    # multi-turn episodes: later turns reach the actor that keeps their context (CUDA forward)
    stage "ray-episodes" 120 python3 -m postrl.cli train "${RUN[@]}" "out=$LOGS/ray-episodes" \
        task=guess_number max_turns=3 "stop=[e]" max_new_tokens=12 \
        "rewards=[environment, $ROOT/tests/train/rewards_for_tests.py:length_parity]"
else
    SUMMARY+=("SKIP ray-* (Ray is not installed here)")
fi
finish

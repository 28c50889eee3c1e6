#!/usr/bin/env bash
# The CUDA paths of launcher=ray on a 1-GPU Linux machine (docs/scaling.md), in < 6 minutes:
#   1. pytest tests/distributed tests/rollout (the CUDA-only tests run here, not in CI)
#   2. train_parallel=ddp    on 1 rollout + 1 trainer actor sharing the GPU (worker_gpus=0.5)
#   3. train_parallel=fsdp2  the same with FSDP2
#   4. weight_sync=broadcast must be refused: both actors on one GPU, NCCL cannot broadcast
# Needs: python3 with torch (CUDA), transformers and ray importable (ray may also come as
# wheels in .whl/ at the repo root); postrl's code at the repo root; no network. model=tiny
# needs only the SmolLM2 *tokenizer*: found in postrl's cache ($POSTRL_CACHE or
# ~/.cache/postrl/models/smollm2-135m-instruct), or give a directory with
# its files (tokenizer.json, tokenizer_config.json, config.json, chat_template.jinja, copied
# from that cache directory on a machine where postrl has run) as $POSTRL_TOKENIZER (default:
# .gpu_check_tokenizer/ at the repo root).
# bench/gpu_check_prepare.sh makes both (.whl/ and .gpu_check_tokenizer/) where pip works.
# Logs go to $OUT/gpu_check when $OUT is set, else to a temporary directory (printed).
# Usage: bash bench/gpu_check.sh        exit status 0 iff every check passed
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
LOGS="${OUT:+$OUT/gpu_check}"
LOGS="${LOGS:-$(mktemp -d /tmp/postrl-gpu-check.XXXXXX)}"
mkdir -p "$LOGS"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY=()
FAILED=0

result() {  # name, status (0 = pass), seconds
    if [ "$2" -eq 0 ]; then SUMMARY+=("PASS $1 (${3}s)"); else SUMMARY+=("FAIL $1 (${3}s)"); FAILED=1; fi
    echo "== ${SUMMARY[-1]}"
}

finish() {
    echo; echo "== summary (logs in $LOGS)"
    printf '%s\n' "${SUMMARY[@]}" | tee "$LOGS/summary.txt"
    exit "$FAILED"
}

echo "== nvidia-smi"
nvidia-smi 2>&1 | tee "$LOGS/nvidia-smi.txt"

# a missing package (ray) may come as wheels in .whl/ at the repo root: install them aside
if ! python3 -c "import ray" 2>/dev/null && ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/postrl-gpu-site "$ROOT"/.whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/postrl-gpu-site"
fi

# preflight: without CUDA or the tokenizer nothing below means anything, so stop here
python3 - <<'EOF' 2>&1 | tee "$LOGS/preflight.txt"
import torch, transformers, ray
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("transformers", transformers.__version__, "ray", ray.__version__)
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0), torch.cuda.device_count())
EOF
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
result "preflight: torch sees a CUDA GPU" $? 0
[ "$FAILED" -eq 0 ] || finish

CACHED="${POSTRL_CACHE:-$HOME/.cache/postrl}/models/smollm2-135m-instruct"
TOKENIZER="${POSTRL_TOKENIZER:-$ROOT/.gpu_check_tokenizer}"
if [ ! -f "$CACHED/config.json" ]; then
    if [ -f "$TOKENIZER/tokenizer.json" ]; then  # a cache holding only the tokenizer
        export POSTRL_CACHE="$LOGS/cache"
        mkdir -p "$POSTRL_CACHE/models/smollm2-135m-instruct"
        cp "$TOKENIZER"/* "$POSTRL_CACHE/models/smollm2-135m-instruct/"
    fi
fi
python3 -c "from postrl.models import load_policy; load_policy('tiny')" > "$LOGS/tokenizer.txt" 2>&1
status=$?
[ $status -eq 0 ] || tail -n 3 "$LOGS/tokenizer.txt"
result "preflight: model=tiny loads (SmolLM2 tokenizer found)" $status 0
[ "$FAILED" -eq 0 ] || finish

echo "== pytest tests/distributed tests/rollout"
start=$SECONDS
python3 -m pytest -q -x -rs tests/distributed tests/rollout 2>&1 | tee "$LOGS/pytest.txt"
result "pytest tests/distributed tests/rollout" "${PIPESTATUS[0]}" $((SECONDS - start))

# a reward that varies within each group (the tiny model never answers right): real updates
RUN=(model=tiny task=arithmetic steps=3 prompts_per_step=2 group_size=4 max_new_tokens=8
     lr=1e-3 quiet=true overwrite=true launcher=ray rollout_workers=1 train_workers=1
     worker_gpus=0.5 "rewards=[$ROOT/tests/train/rewards_for_tests.py:length_parity]")

train() {  # name, extra options...
    local name=$1; shift
    python3 -m postrl.cli train "${RUN[@]}" "out=$LOGS/$name" "$@" > "$LOGS/$name.log" 2>&1
}

for parallel in ddp fsdp2; do
    name="train-$parallel"
    echo "== $name: ${RUN[*]} train_parallel=$parallel"
    start=$SECONDS
    train "$name" "train_parallel=$parallel"
    status=$?
    if [ $status -eq 0 ] && [ -s "$LOGS/$name/metrics.jsonl" ]; then
        echo "final metrics: $(tail -n 1 "$LOGS/$name/metrics.jsonl")"
    else
        status=1; tail -n 20 "$LOGS/$name.log"
    fi
    result "$name (launcher=ray, 1+1 actors on one GPU)" $status $((SECONDS - start))
done

name="train-broadcast-refused"
echo "== $name: ${RUN[*]} weight_sync=broadcast (must fail: one GPU for both actors)"
start=$SECONDS
train "$name" weight_sync=broadcast
code=$?
error=$(grep "postrl: error:" "$LOGS/$name.log")
echo "exit $code: $error"
[ $code -eq 2 ] && grep -q "weight_sync=broadcast: .* share one GPU" <<<"$error"
result "$name (exit 2, the error names weight_sync)" $? $((SECONDS - start))

finish

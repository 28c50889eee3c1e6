#!/usr/bin/env bash
# postrl's CPU backend (postrl/accel/) on a CPU where its native kernels build (AVX-512, or AVX2):
# the CPU's features, then the backend's tests and the tests of what it serves (the training
# forward, the sampler, the update reading the sampler's record), each against PyTorch's path.
# Where they cannot build they skip; on AVX2 the kernels run as AVX-512's intrinsics emulated by
# pairs of AVX2 registers (csrc/avx2.h), so run it on an AVX-512 CPU (a GPU host's, say) too.
# Needs: python3 with torch, transformers, peft, pytest, hypothesis; no network; the tokenizer
# as bench/gpu_check.sh finds it (.gpu_check_tokenizer/, from bench/gpu_check_prepare.sh).
# Usage: bash bench/accel_check.sh [pytest args]    the log goes to $OUT (if set)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 POSTRL_TEST_DEVICE=cpu
CACHED="${POSTRL_CACHE:-$HOME/.cache/postrl}/models/smollm2-135m-instruct"
if [ ! -f "$CACHED/config.json" ] && [ -f "$ROOT/.gpu_check_tokenizer/tokenizer.json" ]; then
    export POSTRL_CACHE="$(mktemp -d /tmp/postrl-accel-check.XXXXXX)"
    mkdir -p "$POSTRL_CACHE/models/smollm2-135m-instruct"
    cp "$ROOT"/.gpu_check_tokenizer/* "$POSTRL_CACHE/models/smollm2-135m-instruct/"
fi
LOG="${OUT:-/tmp}/accel_check.log"
{
    grep -m1 "model name" /proc/cpuinfo
    echo "features: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' \
        | grep -E '^(avx512f|avx512bw|avx512_bf16|amx_tile|amx_bf16)$' | tr '\n' ' ')"
    python3 -c "from postrl.accel import library; print('native kernels:',
        'loaded' if library.library() else library.unavailable_reason())"
    python3 -m pytest -q -p no:cacheprovider -m "not slow" -r s \
        tests/accel tests/models tests/rollout "$@"
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"

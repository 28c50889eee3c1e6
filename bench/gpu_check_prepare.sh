#!/usr/bin/env bash
# Prepares, on a machine with pip's registry and a converted SmolLM2 (any postrl checkout
# where `make test` has run), what bench/gpu_check.sh needs on a GPU machine that has neither:
#   .gpu_check_tokenizer/  SmolLM2's tokenizer files and config (model=tiny uses its
#                          tokenizer; the SmolLM2-shaped model its config)
#   .whl/                  with --ray only: Ray and the packages it needs beyond a CUDA
#                          PyTorch image, as Python 3.12 x86-64 wheels; Ray's wheel without
#                          its Java jar and dashboard client (neither is used; 76 -> 44 MB)
# Both are ignored by git. Usage: bash bench/gpu_check_prepare.sh [--ray] [python-version]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WITH_RAY=0
if [ "${1:-}" = "--ray" ]; then WITH_RAY=1; shift; fi
PYTHON_VERSION="${1:-3.12}"
CACHED="${POSTRL_CACHE:-$HOME/.cache/postrl}/models/smollm2-135m-instruct"

mkdir -p .gpu_check_tokenizer
for name in chat_template.jinja config.json generation_config.json tokenizer.json \
            tokenizer_config.json; do
    cp "$CACHED/$name" .gpu_check_tokenizer/
done
if [ "$WITH_RAY" -eq 0 ]; then
    du -sh .gpu_check_tokenizer
    echo "carry .gpu_check_tokenizer to the GPU machine, then: bash bench/gpu_check.sh"
    exit 0
fi

mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    ray==2.60.0 jsonschema jsonschema-specifications referencing rpds-py

python3 - <<'EOF'
"""Rewrite Ray's wheel without the parts postrl never loads (and their RECORD lines)."""
import glob
import os
import zipfile

def unused(name: str) -> bool:
    return name.startswith(("ray/jars/", "ray/dashboard/client/build/"))

[wheel] = glob.glob(".whl/ray-*.whl")
trimmed = wheel + ".trimmed"
with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(trimmed, "w") as target:
    for info in source.infolist():
        if unused(info.filename):
            continue
        data = source.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = [line for line in data.decode().splitlines()
                     if not unused(line.split(",")[0])]
            data = ("\n".join(lines) + "\n").encode()
        target.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
os.replace(trimmed, wheel)
EOF
du -sh .whl .gpu_check_tokenizer
echo "carry .whl and .gpu_check_tokenizer to the GPU machine, then: bash bench/gpu_check.sh"

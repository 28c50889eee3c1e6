#!/usr/bin/env bash
# postrl without its optional backend: a copy of the tree with postrl/accel/ (and its tests)
# deleted runs the core tests and a 2-step training of SmolLM2-135M-Instruct, so that the
# speed-ups stay deletable. Usage: .ci/without_accel.sh [python] (default: .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # absolute, the venv's own link
COPY=$(mktemp -d "${TMPDIR:-/tmp}/postrl-without-accel.XXXXXX")
trap 'rm -rf "$COPY"' EXIT
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$COPY"
rm -rf "$COPY/postrl/accel" "$COPY/tests/accel"
cd "$COPY"
# the copy's postrl, not the editable install's (which has the backend): drop the editable
# install's finder, which would find postrl/accel in the checkout for an import the copy lacks
mkdir -p .without-accel
cat > .without-accel/sitecustomize.py <<'PYEOF'
import sys
sys.meta_path[:] = [f for f in sys.meta_path
                    if not getattr(f, "__module__", "").startswith("__editable__")]
PYEOF
export PYTHONPATH="$COPY/.without-accel:$COPY"
"$PY" -c 'import importlib.util, pathlib, postrl, sys
assert pathlib.Path(postrl.__file__).is_relative_to(pathlib.Path.cwd()), postrl.__file__
assert importlib.util.find_spec("postrl.accel") is None
from postrl.models import backend
assert backend.active().name == "torch", backend.active().name
print("postrl without its backend:", postrl.__file__)'
"$PY" -m pytest -q -p no:cacheprovider -m "not slow" \
    tests/test_import_graph.py tests/objectives tests/reference tests/models tests/rollout \
    tests/test_recipes.py tests/train/test_update.py tests/train/test_precision.py
"$PY" -m postrl.cli train --recipe grpo --steps 2 --out "$COPY/runs/without-accel" \
    prompts_per_step=2 group_size=4 max_new_tokens=32 eval_every=0
"$PY" - "$COPY/runs/without-accel" <<'PYEOF'
import json, math, pathlib, sys
rows = [json.loads(line) for line in (pathlib.Path(sys.argv[1]) / "metrics.jsonl").open()]
steps = [r for r in rows if "loss/policy" in r]
assert len(steps) == 2 and all(math.isfinite(r["loss/policy"]) for r in steps), rows
print("2 training steps without the backend:", [(r["step"], r["reward/mean"]) for r in steps])
PYEOF

"""bench/samplers.py and bench/sampler_mismatch.py: the sampler comparison runs each engine in
a child of its own and reports real tokens and memory; the mismatch arms are one component
apart from their reference."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import sampler_mismatch, samplers

REPO = Path(__file__).resolve().parents[1]


def test_the_kv_cache_is_what_the_cell_needs():
    smollm2 = SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3, hidden_size=576,
                              num_attention_heads=9, head_dim=None)
    per_token = 30 * 2 * 3 * 64 * 4  # layers x (k, v) x heads x head size x float32
    assert samplers.kv_cache_gb(smollm2, 32, 1200, "fp32") == pytest.approx(
        1.1 * 32 * 1200 * per_token / 2**30)
    assert samplers.kv_cache_gb(smollm2, 32, 1200, "bf16") == pytest.approx(
        1.1 * 32 * 1200 * per_token / 2 / 2**30)
    assert samplers.kv_cache_gb(smollm2, 1, 10, "fp32") == 0.5


def test_each_engine_runs_in_its_own_child_and_the_table_reads_its_results(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} + {a}?"}) + "\n"
                            for a in range(3)))
    out = tmp_path / "samplers.jsonl"
    command = [sys.executable, "-m", "bench.samplers", "--engines",
               "lean,torch-loop,generate", "--lengths", "8", "--precisions", "fp32",
               "--prompts", "2", "--group", "2", "--model", "tiny", "--gsm8k", str(data),
               "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["engine"] for r in rows] == ["lean", "torch-loop", "generate"]
    for row in rows:
        assert 0 < row["tokens"] <= 2 * 2 * 8  # prompts x group x new tokens
        assert row["peak_mb"] > 100 and row["tokens_per_s"] > 0
    assert "| 8 | fp32 | postrl lean |" in proc.stdout
    again = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert "+ lean" not in again.stdout  # finished cells are kept
    assert len(out.read_text().splitlines()) == 3


def test_every_mismatch_arm_is_one_component_from_its_reference():
    options = {name: set(arm[3]) for name, arm in sampler_mismatch.ARMS.items()}
    references = {"B": "A", "C": "A", "D": "A", "E": "D", "F": "D", "G": "D", "H": "G"}
    assert set(references) | {"A"} == set(options)
    for name, reference in references.items():
        assert len(options[name] ^ options[reference]) == 1, (name, reference)
    with pytest.raises(SystemExit, match="unknown Z"):
        sampler_mismatch.main(["--arms", "A,Z"])

"""bench/attention_ab.py runs one batch's update both ways, from one state: matmul-softmax
everywhere, and SDPA from ``FUSED_ATTENTION_SCORES`` on (made small here, so the tiny model's
batch crosses it)."""

from postrl.models import ops
from tests.bench_scripts import load_bench_script


def test_both_ways_run_and_the_threshold_is_restored(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ops, "FUSED_ATTENTION_SCORES", 64)
    calls = []
    real = ops.sdpa_attention
    monkeypatch.setattr(ops, "sdpa_attention", lambda *a: calls.append(1) or real(*a))
    load_bench_script("attention_ab").main(["--regime", "short", "--reps", "1", "--model",
                                            "tiny", "--micro-batch-size", "8"])
    printed = capsys.readouterr().out
    assert "matmul-softmax: update" in printed and "SDPA: update" in printed
    assert "SDPA / matmul-softmax:" in printed
    assert calls  # the SDPA runs attended by SDPA
    assert ops.FUSED_ATTENTION_SCORES == 64

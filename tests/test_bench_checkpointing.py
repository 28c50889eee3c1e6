"""bench/checkpointing_ab.py runs one batch's update with each decoder layer's activations kept
and recomputed, from one state, or one way alone."""

import re

import pytest

from postrl.models import layers
from tests.bench_scripts import load_bench_script, varying_reward


@pytest.fixture
def ab(monkeypatch, tmp_path):
    """The script on the tiny model, with a reward that varies within its groups (so the
    update trains them); the number of checkpointed layer calls so far."""
    monkeypatch.chdir(tmp_path)
    varying_reward(monkeypatch, tmp_path)
    calls = []
    checkpoint = layers.checkpoint
    monkeypatch.setattr(layers, "checkpoint",
                        lambda *a, **k: calls.append(1) or checkpoint(*a, **k))
    script = load_bench_script("checkpointing_ab")

    def main(*options):
        script.main(["--regime", "short", "--reps", "1", "--model", "tiny",
                     "--micro-batch-size", "8", *options])
        return len(calls)

    return main


def test_both_ways_run_and_only_one_checkpoints(ab, capsys):
    assert ab() > 0
    printed = capsys.readouterr().out
    assert re.findall(r"^\s*(\w+): update", printed, re.M) == ["plain", "checkpointed"]
    assert "checkpointed / plain:" in printed


@pytest.mark.parametrize("way, checkpoints", [("plain", False), ("checkpointed", True)])
def test_one_way_alone(ab, capsys, way, checkpoints):
    assert (ab("--only", way) > 0) == checkpoints
    printed = capsys.readouterr().out
    ways = re.findall(r"^\s*(\w+): update", printed, re.M)
    assert ways == [way] and "/ plain" not in printed

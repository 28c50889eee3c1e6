"""`make demo`, `make demo-env` and `make demo-tools` (examples/demo.py) run end to end, on the
tiny model."""

import importlib.util
import json
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_demo():
    spec = importlib.util.spec_from_file_location("demo", EXAMPLES / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("config", ["demo.yaml", "guess_number.yaml", "calculator.yaml"])
def test_the_demo_evaluates_trains_and_evaluates_again(tmp_path, capsys, config):
    out = tmp_path / "run"
    code = load_demo().main(["--config", str(EXAMPLES / config), "--steps", "1", "--samples",
                             "2", "model=tiny", "max_new_tokens=8", "threads=1", "quiet=true",
                             f"out={out}"])
    assert code == 0
    summary = json.loads((out / "demo.json").read_text())
    assert summary["steps"] == 1 and summary["tokens_generated"] > 0
    for side in ("before", "after"):
        scores = summary[side]
        assert scores["problems"] > 0
        assert 0 <= scores["sampled pass@1"] <= scores["pass@2"] <= 1
    printed = capsys.readouterr().out
    assert "held-out accuracy" in printed and "pass@2" in printed
    tools = config == "calculator.yaml"  # the one task with tools, and a teacher
    assert ("greedy call" in printed) == tools
    assert all(("sampled call" in summary[side]) == tools for side in ("before", "after"))
    assert ("held-out reverse KL to the teacher" in printed) == tools
    assert (summary["distill_reverse_kl"] is not None) == tools


def test_the_demo_refuses_one_sample(capsys):
    with pytest.raises(SystemExit):
        load_demo().main(["--samples", "1"])
    assert "--samples must be >= 2" in capsys.readouterr().err

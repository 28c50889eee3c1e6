"""JsonlSink, MultiSink and metric checking: the always-on record of a run."""

import json
import math
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from postrl.telemetry import JsonlSink, MultiSink, Sink, check_metrics, read_metrics
from postrl.telemetry import jsonl as jsonl_module


def test_one_line_per_step_step_first(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with JsonlSink(path) as sink:
        sink.log(1, {"reward/mean": 0.5, "loss/total": 1.25})
        sink.log(2, {"reward/mean": 0.75, "rollout/tokens_generated": 96})
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    assert list(json.loads(lines[0])) == ["step", "reward/mean", "loss/total"]
    assert read_metrics(path) == [
        {"step": 1, "reward/mean": 0.5, "loss/total": 1.25},
        {"step": 2, "reward/mean": 0.75, "rollout/tokens_generated": 96},
    ]


def test_integers_stay_integers_and_scalars_are_converted(tmp_path):
    path = tmp_path / "m.jsonl"
    with JsonlSink(path) as sink:
        sink.log(
            1,
            {
                "rollout/tokens_generated": np.int64(1234),
                "batch/groups_kept": torch.tensor(3),
                "reward/mean": np.float32(0.5),
                "loss/total": torch.tensor(0.25),
                "length/truncated_frac": True,
            },
        )
    (record,) = read_metrics(path)
    assert record["rollout/tokens_generated"] == 1234
    assert isinstance(record["rollout/tokens_generated"], int)
    assert isinstance(record["batch/groups_kept"], int)
    assert record["batch/groups_kept"] == 3 and record["length/truncated_frac"] == 1
    assert record["reward/mean"] == 0.5 and record["loss/total"] == 0.25


def test_non_finite_values_become_null_without_warnings(tmp_path):
    path = tmp_path / "m.jsonl"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with JsonlSink(path) as sink:
            sink.log(
                1,
                {
                    "length/correct_mean": math.nan,
                    "ratio/max": math.inf,
                    "ratio/min": -math.inf,
                    "kl/mean": torch.tensor(float("nan")),
                    "reward/mean": 0.0,
                },
            )
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    (record,) = read_metrics(path)
    assert record == {
        "step": 1,
        "length/correct_mean": None,
        "ratio/max": None,
        "ratio/min": None,
        "kl/mean": None,
        "reward/mean": 0.0,
    }


def test_undeclared_name_is_refused_by_name_and_nothing_is_written(tmp_path):
    path = tmp_path / "m.jsonl"
    with JsonlSink(path) as sink:
        with pytest.raises(ValueError, match=r"'reward/avg'.*names\.py"):
            sink.log(1, {"reward/mean": 0.5, "reward/avg": 0.5})
    assert path.read_text() == ""


def test_reward_function_pattern_is_accepted(tmp_path):
    with JsonlSink(tmp_path / "m.jsonl") as sink:
        sink.log(1, {"reward/math_answer/mean": 0.5, "reward/format/mean": 1.0})
    with pytest.raises(ValueError, match="reward/math_answer/max"):
        check_metrics({"reward/math_answer/max": 1.0})


def test_non_numbers_are_refused_by_name():
    with pytest.raises(TypeError, match="'lr'.*str"):
        check_metrics({"lr": "fast"})
    with pytest.raises(TypeError, match="'lr'.*str"):
        check_metrics({"lr": "0.5"})
    with pytest.raises(TypeError, match="'grad/norm'.*Tensor"):
        check_metrics({"grad/norm": torch.tensor([1.0, 2.0])})


def test_step_metric_must_agree_with_the_step(tmp_path):
    with JsonlSink(tmp_path / "m.jsonl") as sink:
        sink.log(3, {"step": 3, "lr": 1e-6})
        with pytest.raises(ValueError, match="step"):
            sink.log(4, {"step": 5})
    assert read_metrics(tmp_path / "m.jsonl") == [{"step": 3, "lr": 1e-6}]


def test_each_line_is_fsynced_and_readable_before_close(tmp_path, monkeypatch):
    fsynced = []
    real_fsync = os.fsync
    monkeypatch.setattr(jsonl_module.os, "fsync", lambda fd: (fsynced.append(fd), real_fsync(fd)))
    path = tmp_path / "m.jsonl"
    sink = JsonlSink(path)
    sink.log(1, {"lr": 1e-6})
    sink.log(2, {"lr": 2e-6})
    assert len(fsynced) == 2
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    sink.close()
    sink.close()  # idempotent


KILLED_RUN = """
import os, signal, sys
from postrl.telemetry.sinks import JsonlSink
sink = JsonlSink(sys.argv[1])
for step in (1, 2, 3):
    sink.log(step, {"reward/mean": step / 10})
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_run_keeps_every_logged_step(tmp_path):
    path = tmp_path / "m.jsonl"
    result = subprocess.run([sys.executable, "-c", KILLED_RUN, str(path)], timeout=60)
    assert result.returncode == -signal.SIGKILL
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]


def test_reopening_appends(tmp_path):
    path = tmp_path / "sub" / "m.jsonl"
    for step in (1, 2):
        with JsonlSink(path) as sink:
            sink.log(step, {"lr": 0.1})
    assert [r["step"] for r in read_metrics(path)] == [1, 2]


def test_reader_ignores_a_cut_off_last_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step":1,"lr":0.1}\n{"step":2,"l')
    assert read_metrics(path) == [{"step": 1, "lr": 0.1}]


class RecordingSink:
    def __init__(self, fail_on_close=False):
        self.logged, self.closed, self.fail_on_close = [], False, fail_on_close

    def log(self, step, metrics):
        self.logged.append((step, metrics))

    def close(self):
        self.closed = True
        if self.fail_on_close:
            raise RuntimeError("close failed")


def test_multisink_fans_out_and_closes_every_sink(tmp_path):
    first, second = RecordingSink(fail_on_close=True), RecordingSink()
    jsonl = JsonlSink(tmp_path / "m.jsonl")
    multi = MultiSink([jsonl, first, second])
    multi.log(1, {"lr": 0.5})
    assert first.logged == second.logged == [(1, {"lr": 0.5})]
    with pytest.raises(RuntimeError, match="close failed"):
        multi.close()
    assert first.closed and second.closed and jsonl._stream.closed


def test_sinks_satisfy_the_protocol(tmp_path):
    with JsonlSink(tmp_path / "m.jsonl") as sink:
        assert isinstance(sink, Sink)
    assert isinstance(MultiSink([]), Sink) and isinstance(RecordingSink(), Sink)


def test_jsonable_handles_nested_samples():
    value = {"a": (1, np.float64("nan")), "b": torch.tensor([1.5, 2.0]), "c": Path("x")}
    assert jsonl_module.jsonable(value) == {"a": [1, None], "b": [1.5, 2.0], "c": "x"}

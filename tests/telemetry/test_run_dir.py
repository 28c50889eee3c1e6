"""RunDir: the files of runs/NAME/ and the refusal to mix two runs."""

import math
from pathlib import Path

import pytest

from postrl.errors import ConfigError
from postrl.telemetry import JsonlSink, RunDir


def test_plain_rundir_names_files_without_touching_the_disk(tmp_path):
    run = RunDir(tmp_path / "runs" / "x")
    assert not run.path.exists()
    assert run.name == "x"
    assert run.metrics_path == tmp_path / "runs" / "x" / "metrics.jsonl"
    assert run.samples_path.name == "samples.jsonl"
    assert run.config_path.name == "config.yaml"
    assert run.final_dir == run.path / "final"


def test_create_makes_the_directory(tmp_path):
    run = RunDir.create(tmp_path / "runs" / "x")
    assert run.path.is_dir()


def test_config_round_trips_in_the_given_order(tmp_path):
    run = RunDir.create(tmp_path / "x")
    resolved = {
        "recipe": "dapo",
        "model": {"name": "tiny", "lora": {"target_modules": ("q_proj", "v_proj")}},
        "steps": 3,
        "out": Path("runs/x"),
        "aggregation": "token_mean",
    }
    run.write_config(resolved)
    text = run.config_path.read_text()
    assert text.index("recipe") < text.index("model") < text.index("steps")
    assert run.read_config() == {
        "recipe": "dapo",
        "model": {"name": "tiny", "lora": {"target_modules": ["q_proj", "v_proj"]}},
        "steps": 3,
        "out": "runs/x",
        "aggregation": "token_mean",
    }


def test_samples_are_appended_with_their_step(tmp_path):
    run = RunDir.create(tmp_path / "x")
    rows = [
        {
            "prompt": "What is 6 + 3?",
            "completion": "9",
            "reward": 1.0,
            "rewards": {"math_answer": 1.0, "format": None},
            "correct": True,
            "length": 2,
            "finish_reason": "eos",
        },
        {
            "prompt": "What is 1 + 1?",
            "completion": "",
            "reward": math.nan,
            "correct": False,
            "length": 0,
            "finish_reason": "length",
        },
    ]
    run.append_samples(1, rows)
    run.append_samples(2, rows[:1])
    samples = run.read_samples()
    assert [s["step"] for s in samples] == [1, 1, 2]
    assert samples[0]["rewards"] == {"math_answer": 1.0, "format": None}
    assert samples[1]["reward"] is None and samples[1]["finish_reason"] == "length"


def test_an_unserialisable_row_writes_nothing(tmp_path):
    run = RunDir.create(tmp_path / "x")
    with pytest.raises(TypeError):
        run.append_samples(1, [{"prompt": "ok"}, {"prompt": object()}])
    assert not run.samples_path.exists() or run.samples_path.read_text() == ""


def finished_run(path: Path) -> RunDir:
    run = RunDir.create(path)
    run.write_config({"steps": 1})
    with JsonlSink(run.metrics_path) as sink:
        sink.log(1, {"lr": 0.1})
    run.append_samples(1, [{"prompt": "p"}])
    (run.final_dir).mkdir()
    (run.final_dir / "model.safetensors").write_bytes(b"weights")
    (run.path / "tensorboard").mkdir()
    (run.path / "notes.md").write_text("my notes")
    return run


def test_an_earlier_run_is_not_reused_silently(tmp_path):
    run = finished_run(tmp_path / "x")
    with pytest.raises(ConfigError) as error:
        RunDir.create(run.path)
    message = str(error.value)
    assert str(run.path) in message and "overwrite" in message
    assert run.read_metrics() == [{"step": 1, "lr": 0.1}]


def listing(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


def test_overwrite_replaces_only_what_postrl_wrote_once_the_new_run_has_started(tmp_path):
    run = finished_run(tmp_path / "x")
    new = RunDir.create(run.path, overwrite=True)
    assert sorted(p.name for p in run.path.iterdir()) == [".postrl-replaced", "notes.md"]
    new.write_config({"steps": 2})
    with JsonlSink(new.metrics_path) as sink:
        sink.log(1, {"lr": 0.5})
    new.commit_replacement()
    assert sorted(p.name for p in run.path.iterdir()) == ["config.yaml", "metrics.jsonl",
                                                          "notes.md"]
    assert new.read_metrics() == [{"step": 1, "lr": 0.5}]
    assert (run.path / "notes.md").read_text() == "my notes"


def test_an_overwrite_that_fails_before_its_first_step_puts_the_earlier_run_back(tmp_path):
    run = finished_run(tmp_path / "x")
    before = listing(run.path)
    new = RunDir.create(run.path, overwrite=True)
    new.write_config({"steps": 2})
    new.metrics_path.touch()  # a sink was opened, no step was logged
    assert new.restore_replaced()
    assert listing(run.path) == before


def test_an_overwrite_killed_before_its_first_step_is_undone_by_the_next_create(tmp_path):
    run = finished_run(tmp_path / "x")
    before = listing(run.path)
    RunDir.create(run.path, overwrite=True).write_config({"steps": 2})  # then SIGKILL
    with pytest.raises(ConfigError, match="already holds"):
        RunDir.create(run.path)
    assert listing(run.path) == before


def test_an_overwrite_killed_after_its_first_step_keeps_the_new_run(tmp_path):
    run = finished_run(tmp_path / "x")
    new = RunDir.create(run.path, overwrite=True)
    with JsonlSink(new.metrics_path) as sink:
        sink.log(1, {"lr": 0.5})  # then SIGKILL before commit_replacement
    resumed = RunDir.create(run.path, resume=True)
    assert not (run.path / ".postrl-replaced").exists()
    assert resumed.read_metrics() == [{"step": 1, "lr": 0.5}]


def test_an_out_that_is_a_file_is_refused_by_name(tmp_path):
    (tmp_path / "taken").write_text("mine")
    for out in (tmp_path / "taken", tmp_path / "taken" / "run"):
        with pytest.raises(ConfigError, match=f"{tmp_path / 'taken'} is a file"):
            RunDir.create(out)
    assert (tmp_path / "taken").read_text() == "mine"


def test_logs_of_an_attempt_that_cannot_continue_are_kept_in_earlier(tmp_path):
    run = finished_run(tmp_path / "x")
    first = run.keep_as_earlier()
    assert first == run.path / "earlier" / "attempt-1"
    assert sorted(p.name for p in first.iterdir()) == ["config.yaml", "metrics.jsonl",
                                                       "samples.jsonl"]
    assert not run.metrics_path.exists() and run.final_dir.is_dir()
    run.write_config({"steps": 3})
    assert run.keep_as_earlier() == run.path / "earlier" / "attempt-2"
    assert run.keep_as_earlier() is None


def test_resume_keeps_the_earlier_steps(tmp_path):
    run = finished_run(tmp_path / "x")
    resumed = RunDir.create(run.path, resume=True)
    with JsonlSink(resumed.metrics_path) as sink:
        sink.log(2, {"lr": 0.2})
    assert [r["step"] for r in resumed.read_metrics()] == [1, 2]
    with pytest.raises(ConfigError, match="overwrite and resume"):
        RunDir.create(run.path, overwrite=True, resume=True)


def test_a_directory_with_user_files_but_no_run_is_fine(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.md").write_text("plan")
    run = RunDir.create(tmp_path / "x")
    assert (run.path / "notes.md").read_text() == "plan"

"""make_sinks and the tracker adapters (real TensorBoard when installed, fakes for the rest)."""

import sys
import types
from pathlib import Path

import pytest

from postrl.errors import ConfigError
from postrl.telemetry import make_sinks, valid_report_to
from postrl.telemetry.trackers import MlflowSink, TrackioSink, WandbSink


def test_nothing_requested_means_no_sinks(tmp_path):
    assert make_sinks([], tmp_path) == []
    assert make_sinks(["none"], tmp_path) == []


def test_unknown_name_lists_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError) as error:
        make_sinks(["tensorbored"], tmp_path)
    message = str(error.value)
    assert "report_to" in message and "'tensorbored'" in message
    for name in ("tensorboard", "wandb", "mlflow", "trackio"):
        assert name in message
    assert valid_report_to() == ["none", "tensorboard", "wandb", "mlflow", "trackio"]


@pytest.mark.parametrize(
    ("name", "module", "pip_package"),
    [
        ("tensorboard", "torch.utils.tensorboard", "tensorboard"),
        ("wandb", "wandb", "wandb"),
        ("mlflow", "mlflow", "mlflow"),
        ("trackio", "trackio", "trackio"),
    ],
)
def test_missing_package_names_the_option_and_the_pip_command(
    tmp_path, monkeypatch, name, module, pip_package
):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    with pytest.raises(ConfigError) as error:
        make_sinks([name], tmp_path)
    message = str(error.value)
    assert "report_to" in message and f"pip install {pip_package}" in message


def test_a_missing_package_is_found_before_any_sink_is_created(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    created = []
    monkeypatch.setattr(
        "postrl.telemetry.trackers.TRACKERS",
        {"tensorboard": lambda run_dir: created.append(run_dir), "wandb": WandbSink},
    )
    monkeypatch.setattr(
        "postrl.telemetry.trackers.PACKAGES",
        {"tensorboard": ("json", "json"), "wandb": ("wandb", "wandb")},
    )
    with pytest.raises(ConfigError, match="pip install wandb"):
        make_sinks(["tensorboard", "wandb"], tmp_path)
    assert created == []


def test_tensorboard_writes_scalars_readable_by_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (sink,) = make_sinks(["tensorboard", "none"], tmp_path)
    sink.log(1, {"reward/mean": 0.25, "loss/per_token": 1.5})
    sink.log(2, {"reward/mean": 0.5})
    with pytest.raises(ValueError, match="not_a/metric"):
        sink.log(3, {"not_a/metric": 1.0})
    sink.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    rewards = events.Scalars("reward/mean")
    assert [(e.step, e.value) for e in rewards] == [(1, 0.25), (2, 0.5)]
    assert [e.step for e in events.Scalars("loss/per_token")] == [1]


class FakeRun:
    def __init__(self, **kwargs):
        self.init_kwargs, self.logged, self.finished = kwargs, [], False

    def log(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))

    def finish(self):
        self.finished = True


def test_wandb_runs_offline_inside_the_run_directory(tmp_path, monkeypatch):
    runs = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: runs.append(FakeRun(**kwargs)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run_dir = tmp_path / "runs" / "demo"
    (sink,) = make_sinks(["wandb"], run_dir)
    assert isinstance(sink, WandbSink)
    sink.log(4, {"kl/mean": 0.01})
    sink.close()
    (run,) = runs
    assert run.init_kwargs["mode"] == "offline"
    assert Path(run.init_kwargs["dir"]) == run_dir and run.init_kwargs["name"] == "demo"
    assert run.logged == [(4, {"kl/mean": 0.01})] and run.finished


def test_mlflow_uses_a_local_file_store_under_the_run(tmp_path, monkeypatch):
    calls = []

    class FakeClient:
        def __init__(self, tracking_uri):
            calls.append(("client", tracking_uri))

        def get_experiment_by_name(self, name):
            return None

        def create_experiment(self, name):
            calls.append(("experiment", name))
            return "7"

        def create_run(self, experiment_id, run_name):
            calls.append(("run", experiment_id, run_name))
            return types.SimpleNamespace(info=types.SimpleNamespace(run_id="r1"))

        def log_batch(self, run_id, metrics):
            calls.append(("batch", run_id, [(m[0], m[1], m[3]) for m in metrics]))

        def set_terminated(self, run_id):
            calls.append(("end", run_id))

    tracking = types.ModuleType("mlflow.tracking")
    tracking.MlflowClient = FakeClient
    entities = types.ModuleType("mlflow.entities")
    entities.Metric = lambda key, value, timestamp, step: (key, value, timestamp, step)
    for name, module in [
        ("mlflow", types.ModuleType("mlflow")),
        ("mlflow.tracking", tracking),
        ("mlflow.entities", entities),
    ]:
        monkeypatch.setitem(sys.modules, name, module)
    (sink,) = make_sinks(["mlflow"], tmp_path / "demo")
    assert isinstance(sink, MlflowSink)
    sink.log(2, {"grad/norm": 3, "lr": 1e-6})
    sink.close()
    assert calls[0] == ("client", (tmp_path / "demo" / "mlruns").resolve().as_uri())
    assert calls[1:] == [
        ("experiment", "postrl"),
        ("run", "7", "demo"),
        ("batch", "r1", [("grad/norm", 3.0, 2), ("lr", 1e-6, 2)]),
        ("end", "r1"),
    ]


def test_trackio_logs_locally_with_steps(tmp_path, monkeypatch):
    run = FakeRun()
    fake = types.ModuleType("trackio")
    fake.init = lambda **kwargs: run.init_kwargs.update(kwargs)
    fake.log = run.log
    fake.finish = run.finish
    monkeypatch.setitem(sys.modules, "trackio", fake)
    (sink,) = make_sinks(["trackio"], tmp_path / "demo")
    assert isinstance(sink, TrackioSink)
    sink.log(1, {"accuracy/mean": 0.3})
    sink.close()
    assert run.init_kwargs == {"project": "postrl", "name": "demo"}
    assert run.logged == [(1, {"accuracy/mean": 0.3})] and run.finished

"""Thin adapters from the metric stream to experiment trackers, chosen with ``report_to``.

Each adapter imports its package only when it is created, writes under the run directory
where the tracker allows it, and never talks to a server:

- ``tensorboard``: ``torch.utils.tensorboard.SummaryWriter`` in ``RUN/tensorboard/``
  (``pip install tensorboard``; view with ``tensorboard --logdir RUN/tensorboard``).
- ``wandb``: Weights & Biases in offline mode (``mode="offline"``, whatever ``WANDB_MODE``
  says), files in ``RUN/wandb/``; upload later with ``wandb sync`` if you wish.
- ``mlflow``: a local file store in ``RUN/mlruns/``, experiment ``postrl``
  (view with ``mlflow ui --backend-store-uri RUN/mlruns``).
- ``trackio``: trackio's local store, project ``postrl`` (``TRACKIO_DIR`` chooses the
  folder; view with ``trackio show --project postrl``).

Names reach every tracker unchanged (``loss/per_token``), so their dashboards group them
by area. Non-finite values are passed on as float NaN/inf; all four trackers store them.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

from postrl.errors import ConfigError
from postrl.telemetry.sinks import Sink, check_metrics

PROJECT = "postrl"

# report_to name -> (module imported, pip package that provides it)
PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("torch.utils.tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"),
}


def require(name: str) -> ModuleType:
    """Import the package behind ``report_to`` entry ``name``, or raise ConfigError saying
    which option asked for it and how to install it."""
    if name not in PACKAGES:
        valid = ", ".join(["none", *PACKAGES])
        raise ConfigError(f"report_to: unknown sink {name!r}; valid names are: {valid}")
    module, pip_package = PACKAGES[name]
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ConfigError(
            f"report_to: {name!r} needs the {pip_package!r} package, which is not installed; "
            f"install it with `pip install {pip_package}` or remove {name!r} from report_to"
        ) from error


class TensorBoardSink:
    """Scalars to TensorBoard event files in ``run_dir/tensorboard``, flushed every step."""

    def __init__(self, run_dir: Path) -> None:
        tensorboard = require("tensorboard")
        self.log_dir = Path(run_dir) / "tensorboard"
        self._writer = tensorboard.SummaryWriter(log_dir=str(self.log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One scalar per metric at ``global_step=step``."""
        for name, value in check_metrics(metrics).items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


class WandbSink:
    """An offline Weights & Biases run named after the run directory, files in it."""

    def __init__(self, run_dir: Path) -> None:
        wandb = require("wandb")
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=PROJECT, name=run_dir.name, dir=str(run_dir), mode="offline")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """All metrics of the step in one ``run.log`` call."""
        self._run.log(check_metrics(metrics), step=step)

    def close(self) -> None:
        """Finish the run (writes its summary)."""
        self._run.finish()


class MlflowSink:
    """An MLflow run in a local file store at ``run_dir/mlruns`` (no tracking server)."""

    def __init__(self, run_dir: Path) -> None:
        require("mlflow")
        tracking = importlib.import_module("mlflow.tracking")
        self._entities = importlib.import_module("mlflow.entities")
        store = (Path(run_dir) / "mlruns").resolve()
        self._client = tracking.MlflowClient(tracking_uri=store.as_uri())
        experiment = self._client.get_experiment_by_name(PROJECT)
        if experiment is None:
            experiment_id = self._client.create_experiment(PROJECT)
        else:
            experiment_id = experiment.experiment_id
        run = self._client.create_run(experiment_id, run_name=Path(run_dir).name)
        self._run_id = run.info.run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """All metrics of the step in one ``log_batch`` call."""
        timestamp_ms = int(time.time() * 1000)
        batch = [
            self._entities.Metric(name, float(value), timestamp_ms, step)
            for name, value in check_metrics(metrics).items()
        ]
        self._client.log_batch(self._run_id, metrics=batch)

    def close(self) -> None:
        """Mark the run finished."""
        self._client.set_terminated(self._run_id)


class TrackioSink:
    """A local trackio run in project ``postrl``, named after the run directory."""

    def __init__(self, run_dir: Path) -> None:
        self._trackio = require("trackio")
        self._trackio.init(project=PROJECT, name=Path(run_dir).name)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """All metrics of the step in one ``trackio.log`` call."""
        self._trackio.log(check_metrics(metrics), step=step)

    def close(self) -> None:
        """Finish the run."""
        self._trackio.finish()


TRACKERS: dict[str, type] = {
    "tensorboard": TensorBoardSink,
    "wandb": WandbSink,
    "mlflow": MlflowSink,
    "trackio": TrackioSink,
}


def make_sinks(report_to: Iterable[str], run_dir: Path | str) -> list[Sink]:
    """The optional tracker sinks named in ``report_to``, writing under ``run_dir``.

    Valid names: ``tensorboard``, ``wandb`` (offline), ``mlflow`` (local file store),
    ``trackio`` (local); ``none`` is accepted and adds nothing. The JSONL sink is not
    among them: it is always on. Every package is checked before any sink is created,
    so a missing one raises :class:`~postrl.errors.ConfigError` (naming ``report_to``
    and the pip command) without leaving half-opened trackers behind.
    """
    names = list(dict.fromkeys(name for name in report_to if name != "none"))
    for name in names:
        require(name)
    return [TRACKERS[name](Path(run_dir)) for name in names]


def check_sinks(report_to: Iterable[str]) -> None:
    """ConfigError for an unknown name in ``report_to`` or a tracker package that is missing
    (what :func:`make_sinks` would raise), creating nothing."""
    for name in dict.fromkeys(report_to):
        if name != "none":
            require(name)


def valid_report_to() -> list[str]:
    """Every name ``report_to`` accepts."""
    return ["none", *TRACKERS]

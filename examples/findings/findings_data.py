"""Reading one experiment's directory: ``comparison.json``, each run's config, metrics and
samples, and the driver's ``findings.json`` (command and wall time).

Runs are grouped by the label ``postrl compare`` gave them, in the order of
``comparison.json``; the seeds of a label are its runs. Anything missing or unreadable is a
``DataError`` that names the file and says how to produce it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from postrl.errors import DataError
from postrl.experiments.report import Run, load_run
from postrl.telemetry import RunDir
from postrl.telemetry.jsonl import read_records

MANIFEST = "comparison.json"  # written by postrl compare / ladder
RUN_RECORD = "findings.json"  # written by findings_plan.py


@dataclass
class RunData:
    """One run: its directory, config and metrics (as ``postrl report`` reads them) and the
    completions it logged."""

    run: Run
    label: str
    seed: int
    samples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def path(self) -> Path:
        return self.run.path

    @property
    def records(self) -> list[dict[str, Any]]:
        """One record per optimizer step; the evaluation before training (step 0) left out."""
        return [record for record in self.run.records if record.get("step", 0) > 0]


@dataclass
class ExperimentData:
    """Every run of one experiment, grouped by recipe label, and how it was produced."""

    name: str
    path: Path
    manifest: dict[str, Any]
    groups: dict[str, list[RunData]]
    command: str | None = None  # from findings.json; None when run by hand
    wall_seconds: float | None = None

    @property
    def runs(self) -> list[RunData]:
        return [run for runs in self.groups.values() for run in runs]


def _read_json(path: Path, hint: str) -> dict[str, Any]:
    if not path.is_file():
        raise DataError(f"{path}: missing; {hint}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object")
    return data


def load_run_data(path: Path, label: str, seed: int) -> RunData:
    """One run directory; DataError naming it when it holds no metrics."""
    if not (path / "metrics.jsonl").is_file():
        raise DataError(f"{path}/metrics.jsonl: missing (the run listed in {MANIFEST} did not "
                        "log a step; rerun `make findings`)")
    samples_path = RunDir(path).samples_path
    samples = read_records(samples_path) if samples_path.is_file() else []
    return RunData(load_run(path), label, seed, samples)


def load_experiment(root: Path, name: str) -> ExperimentData:
    """``root/name``: the runs its ``comparison.json`` lists, at ``root/name/<label>/s<seed>``."""
    path = Path(root) / name
    manifest = _read_json(path / MANIFEST, f"run `make findings` (or findings_plan.py --only "
                                            f"{name}) to produce experiment {name!r}")
    groups: dict[str, list[RunData]] = {}
    for entry in manifest.get("runs", []):
        label, seed = str(entry["label"]), int(entry["seed"])
        run = load_run_data(path / label / f"s{seed}", label, seed)
        groups.setdefault(label, []).append(run)
    if not groups:
        raise DataError(f"{path / MANIFEST}: lists no runs")
    data = ExperimentData(name, path, manifest, groups)
    record_path = path / RUN_RECORD
    if record_path.is_file():
        record = _read_json(record_path, "")
        data.command = record.get("command")
        data.wall_seconds = record.get("wall_seconds")
    return data

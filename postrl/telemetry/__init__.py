"""Telemetry: one declared set of metric names, the run directory, sinks and progress.

- :mod:`~postrl.telemetry.names`: every metric, declared once (``docs/metrics.md``).
- :class:`RunDir`: ``runs/NAME/`` with ``config.yaml``, ``metrics.jsonl``,
  ``samples.jsonl`` and ``final/``.
- :class:`JsonlSink` (always on) and :func:`make_sinks` for the trackers in ``report_to``.
- :class:`TrainProgress`: the progress bar, or plain lines when not on a terminal.
"""

from postrl.telemetry.names import BY_NAME, METRICS, Metric, is_declared
from postrl.telemetry.progress import TrainProgress
from postrl.telemetry.run_dir import RunDir
from postrl.telemetry.sinks import (
    JsonlSink,
    MultiSink,
    Sink,
    check_metrics,
    read_metrics,
)
from postrl.telemetry.trackers import make_sinks, valid_report_to

__all__ = [
    "BY_NAME",
    "METRICS",
    "JsonlSink",
    "Metric",
    "MultiSink",
    "RunDir",
    "Sink",
    "TrainProgress",
    "check_metrics",
    "is_declared",
    "make_sinks",
    "read_metrics",
    "render_markdown",
    "valid_report_to",
]


def __getattr__(name: str):
    """``render_markdown`` is loaded on first use, so that ``python -m
    postrl.telemetry.docs`` does not find its module already imported."""
    if name == "render_markdown":
        from postrl.telemetry.docs import render_markdown

        return render_markdown
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

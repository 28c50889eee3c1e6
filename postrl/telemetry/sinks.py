"""Where the metric stream goes: the always-on JSONL file, plus optional trackers.

Every sink receives the same stream, ``log(step, {name: value})`` once per step, and checks
it the same way (:func:`check_metrics`): names must be declared in
:mod:`postrl.telemetry.names`, values must be numbers. The trainer writes
``metrics.jsonl`` with :class:`JsonlSink` and adds the trackers named in ``report_to``
with :func:`make_sinks`; :class:`MultiSink` fans one call out to all of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from numbers import Integral
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from postrl.telemetry.jsonl import dumps_line, read_records, write_durably
from postrl.telemetry.names import is_declared

Number = int | float


@runtime_checkable
class Sink(Protocol):
    """Receives one dict of declared metrics per optimizer step."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record ``metrics`` for optimizer step ``step``."""

    def close(self) -> None:
        """Flush and release whatever the sink holds; later calls to ``log`` are errors."""


def as_number(name: str, value: Any) -> Number:
    """``value`` as a Python int or float (numpy and 0-d torch scalars included).

    Raises TypeError naming the metric when the value is not a number.
    """
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        if hasattr(value, "item"):  # numpy scalar, 0-d tensor or one-element array
            value = value.item()
        if isinstance(value, Integral):  # bool included
            return int(value)
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"metric {name!r}: value must be a number, got {type(value).__name__} {value!r}"
        ) from None


def check_metrics(metrics: Mapping[str, Any]) -> dict[str, Number]:
    """Validate names and convert values; the dict every sink actually logs.

    Raises ValueError naming the first metric that is not declared in
    :mod:`postrl.telemetry.names` (declare it there and regenerate ``docs/metrics.md``).
    Non-finite values are kept as float NaN/inf here; each sink decides how to store them.
    """
    checked: dict[str, Number] = {}
    for name, value in metrics.items():
        if not is_declared(name):
            raise ValueError(
                f"metric {name!r} is not declared in postrl/telemetry/names.py; "
                "declare it there (name, unit, meaning) and regenerate docs/metrics.md"
            )
        checked[name] = as_number(name, value)
    return checked


def finite_or_none(value: Number) -> Number | None:
    """``value``, or None when it is NaN or infinite."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class JsonlSink:
    """Appends ``{"step": k, ...metrics}`` as one line per call to a JSON Lines file.

    Each line is flushed and fsync-ed before ``log`` returns, so a killed run keeps every
    step it logged. Non-finite values (NaN, inf) are written as ``null`` without a warning:
    strict JSON has no NaN, and a reader sees ``None`` for "no finite value this step"
    (e.g. ``length/correct_mean`` when no response was correct). Integers stay integers.
    The file is opened in append mode: deciding whether an old file may be reused is
    :class:`postrl.telemetry.run_dir.RunDir`'s job.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._stream = open(self.path, "a", encoding="utf-8")  # closed in close()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Validate ``metrics`` and append one durable line for ``step``."""
        checked = check_metrics(metrics)
        if "step" in checked and checked["step"] != step:
            raise ValueError(f"metric 'step' is {checked['step']!r} but log() got step={step}")
        record = {"step": int(step)}
        record.update({name: finite_or_none(value) for name, value in checked.items()})
        write_durably(self._stream, dumps_line(record))

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._stream.close()

    def __enter__(self) -> JsonlSink:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file, one dict per logged step, in order."""
    return read_records(Path(path))


class MultiSink:
    """Fans each ``log``/``close`` call out to several sinks, in order."""

    def __init__(self, sinks: Iterable[Sink]) -> None:
        self.sinks = list(sinks)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Log to every sink (the first one to reject the metrics stops the call)."""
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        """Close every sink, even if one of them fails; re-raise the first failure."""
        first_error: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as error:  # re-raised once all are closed
                first_error = first_error or error
        if first_error is not None:
            raise first_error

    def __enter__(self) -> MultiSink:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


__all__ = [
    "JsonlSink",
    "MultiSink",
    "Sink",
    "check_metrics",
    "read_metrics",
]

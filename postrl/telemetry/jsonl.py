"""JSON Lines files that survive a killed run: one object per line, flushed and fsync-ed.

``metrics.jsonl`` and ``samples.jsonl`` are both written through :func:`write_durably`.
Values are made JSON-safe by :func:`jsonable`: non-finite floats become ``null`` (strict
JSON has no NaN or Infinity), numpy and torch scalars become Python numbers.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any


def jsonable(value: Any) -> Any:
    """``value`` with every part turned into something strict JSON can hold.

    Dicts, lists and tuples are walked; floats that are NaN or infinite become ``None``;
    objects with ``.item()`` (numpy scalars, 0-d tensors) or ``.tolist()`` (arrays, tensors)
    are converted; paths become strings. Anything else is returned unchanged, so
    ``json.dumps`` still rejects what it cannot write.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "tolist"):
        return jsonable(value.tolist())
    if hasattr(value, "item"):
        return jsonable(value.item())
    return value


def dumps_line(record: Mapping[str, Any]) -> str:
    """One compact, strict JSON line (with its newline) for ``record``."""
    return json.dumps(jsonable(record), allow_nan=False, separators=(",", ":")) + "\n"


def write_durably(stream: IO[str], text: str) -> None:
    """Write ``text``, flush Python's buffer and fsync, so a killed process loses nothing."""
    stream.write(text)
    stream.flush()
    os.fsync(stream.fileno())


def append_records(path: Path, records: Iterable[Mapping[str, Any]]) -> None:
    """Append each record as one line to the file at ``path`` (created if missing).

    Every record is converted before the file is opened, so one that cannot be written
    leaves the file as it was; then all lines go out with a single fsync.
    """
    text = "".join(dumps_line(record) for record in records)
    if not text:
        return
    with open(path, "a", encoding="utf-8") as stream:
        write_durably(stream, text)


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a JSONL file as a dict.

    A last line without its newline (a write cut off by a kill) is ignored; any other
    malformed line raises ``json.JSONDecodeError``.
    """
    text = Path(path).read_text(encoding="utf-8")
    lines = text.split("\n")
    complete = lines[:-1]  # the part after the final newline is empty or cut off
    return [json.loads(line) for line in complete if line.strip()]

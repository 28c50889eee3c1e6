"""Tasks read from files: GSM8K-format JSONL, generic JSONL / Parquet, saved ``datasets`` dirs.

Every record becomes an :class:`Example` whose ``question`` is the prompt field (``question``,
else ``prompt``, unless ``prompt_field`` names another) and whose ``answer`` column is the answer
field as a string; every other field becomes a column too. The example id is where the record
came from (``data/train.jsonl:12``, ``data/train.parquet:row 3``), and errors name it.

The test split comes from ``test_path``, else from a sibling file whose name has ``test`` where
the training file's has ``train`` (``train.jsonl`` → ``test.jsonl``), else from a fraction of the
records held out by a stable hash of the question. ``train()`` is shuffled by ``seed``;
``test()`` keeps file order.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from postrl.errors import DataError
from postrl.tasks.base import Example
from postrl.tasks.splits import (
    check_both_splits,
    check_test_fraction,
    in_test_split,
    seeded_shuffle,
)

DEFAULT_PROMPT_FIELDS = ("question", "prompt")
Record = tuple[str, dict[str, Any]]  # (location, fields)
AnswerParser = Callable[[Any, str], str]


class FileTask:
    """A task whose examples were read from files; ``test=None`` holds a fraction out of train,
    chosen by a stable hash of the question (so duplicates land together), in file order."""

    def __init__(
        self, name: str, train: Sequence[Example], test: Sequence[Example] | None,
        default_rewards: tuple[str, ...], seed: int = 0, test_fraction: float = 0.1,
    ) -> None:
        test_fraction = check_test_fraction(test_fraction)
        if test is None:
            test = [ex for ex in train if in_test_split(ex.question, test_fraction)]
            train = [ex for ex in train if not in_test_split(ex.question, test_fraction)]
        check_both_splits(name, train, test)
        self.name = name
        self.default_rewards = default_rewards
        self._train = tuple(seeded_shuffle(train, seed))
        self._test = tuple(test)

    def train(self) -> Sequence[Example]:
        """Training examples, shuffled by ``seed``."""
        return self._train

    def test(self) -> Sequence[Example]:
        """Held-out examples, in file order."""
        return self._test


def answer_text(value: Any, location: str) -> str:
    """A gold answer as the string reward functions expect (``42`` → ``"42"``)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{location}: the answer must be a string or a number, got {value!r}")
    return str(value)


@dataclass(frozen=True)
class Fields:
    """Which record fields hold the prompt and the answer, and how to read the answer."""

    prompt_field: str | None = None  # None: "question", else "prompt"
    answer_field: str | None = "answer"  # None: the records have no gold answer
    parse_answer: AnswerParser = answer_text
    raw_answer_column: str | None = None  # where to keep the unparsed answer, if anywhere

    def to_example(self, location: str, record: dict[str, Any]) -> Example:
        """Turn one record into an Example, or raise a DataError naming ``location``."""
        prompt_field = self.prompt_field or _default_prompt_field(record)
        question = _require(record, prompt_field, location)
        if not isinstance(question, str) or not question.strip():
            raise DataError(f"{location}: field '{prompt_field}' must be a non-empty string")
        columns = {k: v for k, v in record.items() if k not in (prompt_field, self.answer_field)}
        if self.answer_field is not None:
            raw = _require(record, self.answer_field, location)
            columns["answer"] = self.parse_answer(raw, location)
            if self.raw_answer_column is not None:
                columns[self.raw_answer_column] = raw
        return Example(id=location, question=question, columns=columns)


def parse_gsm8k_answer(value: Any, location: str) -> str:
    """The number after the last ``####`` of a GSM8K solution, without thousands commas."""
    if not isinstance(value, str) or "####" not in value:
        raise DataError(f"{location}: field 'answer' must end with '#### <number>'")
    number = value.rsplit("####", 1)[1].strip().replace(",", "")
    if not number:
        raise DataError(f"{location}: nothing after '####' in field 'answer'")
    return number


def read_jsonl(path: Path) -> Iterator[Record]:
    """Records of a JSON Lines file; blank lines are skipped, and so is a UTF-8 byte-order
    mark at the start (Windows tools write one)."""
    _check_file(path)
    with path.open("rb") as lines:
        for line_number, raw in enumerate(lines, start=1):
            location = f"{path}:{line_number}"
            try:
                line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise DataError(f"{location}: not valid UTF-8 text (byte {error.start} of the "
                                "line); re-encode the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                message = f"{location}: invalid JSON ({error.msg}, column {error.colno})"
                raise DataError(message) from None
            if not isinstance(record, dict):
                raise DataError(f"{location}: expected a JSON object, got {type(record).__name__}")
            yield location, record


def read_parquet(path: Path) -> Iterator[Record]:
    """Rows of a Parquet file (read with pyarrow, which ``datasets`` depends on)."""
    _check_file(path)
    try:
        import pyarrow.parquet as parquet
    except ImportError as error:
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install datasets)") from error
    try:
        rows = parquet.read_table(path).to_pylist()
    except Exception as error:  # pyarrow raises several types for unreadable files
        raise DataError(f"{path}: not a readable Parquet file ({error})") from error
    for row_number, row in enumerate(rows, start=1):
        yield f"{path}:row {row_number}", row


def to_examples(records: Iterable[Record], fields: Fields, source: str) -> list[Example]:
    """Convert records; an empty source is a DataError."""
    examples = [fields.to_example(location, record) for location, record in records]
    if not examples:
        raise DataError(f"{source}: no examples (it is empty)")
    return examples


def sibling_test_file(path: Path) -> Path | None:
    """``.../train.jsonl`` → ``.../test.jsonl`` (any name containing ``train``), if it exists."""
    if "train" not in path.name:
        return None
    sibling = path.with_name(path.name.replace("train", "test"))
    return sibling if sibling.is_file() else None


def load_file_task(
    kind: str, path: str | Path, fields: Fields, reader: Callable[[Path], Iterable[Record]],
    test_path: str | Path | None = None, seed: int = 0, test_fraction: float = 0.1,
) -> FileTask:
    """Read a training file and its test split (explicit, sibling or held out) into a task."""
    path = Path(path)
    test_file = Path(test_path) if test_path is not None else sibling_test_file(path)
    train = to_examples(reader(path), fields, str(path))
    test = None if test_file is None else to_examples(reader(test_file), fields, str(test_file))
    return FileTask(kind, train, test, _rewards(fields), seed, test_fraction)


def load_gsm8k(path: str | Path, **options: Any) -> FileTask:
    """GSM8K-format JSONL (``question``, ``answer`` ending in ``#### N``); a folder means its
    ``train.jsonl`` (and ``test.jsonl``). The worked answer is kept as the ``solution`` column."""
    path = Path(path)
    if path.is_dir():
        path = path / "train.jsonl"
    fields = Fields("question", "answer", parse_gsm8k_answer, raw_answer_column="solution")
    return load_file_task("gsm8k", path, fields, read_jsonl, **options)


def load_table(
    kind: str, path: str | Path, prompt_field: str | None = None,
    answer_field: str | None = "answer", **options: Any,
) -> FileTask:
    """Generic ``jsonl`` or ``parquet`` data; the answer field becomes the ``answer`` column as
    a string (``answer_field=None``: no gold answer, no default reward)."""
    reader = {"jsonl": read_jsonl, "parquet": read_parquet}[kind]
    fields = _generic_fields(prompt_field, answer_field)
    return load_file_task(kind, path, fields, reader, **options)


def load_saved_dataset(
    path: str | Path, prompt_field: str | None = None, answer_field: str | None = "answer",
    seed: int = 0, test_fraction: float = 0.1,
) -> FileTask:
    """A directory written by ``datasets``' ``save_to_disk``: a ``DatasetDict`` gives its
    ``train`` and ``test`` (or ``validation``) splits, a single ``Dataset`` is held out from."""
    fields, path = _generic_fields(prompt_field, answer_field), Path(path)
    splits = _load_from_disk(path)
    if "train" not in splits:
        raise DataError(f"{path}: no 'train' split (splits: {', '.join(splits)})")
    train = _split_examples(splits, "train", fields, path)
    test_name = next((name for name in ("test", "validation") if name in splits), None)
    test = None if test_name is None else _split_examples(splits, test_name, fields, path)
    return FileTask("dataset", train, test, _rewards(fields), seed, test_fraction)


def _load_from_disk(path: Path) -> dict[str, Any]:
    """The splits of a saved dataset by name; a lone ``Dataset`` is called ``train``."""
    if not path.is_dir():
        raise DataError(f"{path}: no such directory")
    try:
        import datasets
    except ImportError as error:
        raise DataError(f"{path}: reading a saved dataset needs `pip install datasets`") from error
    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as error:
        raise DataError(f"{path}: not a dataset saved with save_to_disk ({error})") from error
    if isinstance(loaded, datasets.DatasetDict):
        return dict(loaded)
    return {"train": loaded}


def _split_examples(splits: dict[str, Any], name: str, fields: Fields, path: Path) -> list:
    """Examples of one split of a saved dataset, located as ``DIR[split]:row N``."""
    source = f"{path}[{name}]"
    rows = ((f"{source}:row {n}", dict(row)) for n, row in enumerate(splits[name], start=1))
    return to_examples(rows, fields, source)


def _generic_fields(prompt_field: str | None, answer_field: str | None) -> Fields:
    """Fields for user data: a renamed answer field also stays a column under its own name."""
    keep_raw = answer_field if answer_field not in (None, "answer") else None
    return Fields(prompt_field, answer_field, raw_answer_column=keep_raw)


def _rewards(fields: Fields) -> tuple[str, ...]:
    """Check gold answers by default when there are any."""
    return ("math_answer",) if fields.answer_field is not None else ()


def _check_file(path: Path) -> None:
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if not path.is_file():
        raise DataError(f"{path}: not a file")


def _default_prompt_field(record: dict[str, Any]) -> str:
    return next((f for f in DEFAULT_PROMPT_FIELDS if f in record), DEFAULT_PROMPT_FIELDS[0])


def _require(record: dict[str, Any], field: str, location: str) -> Any:
    if field not in record:
        present = ", ".join(sorted(record)) or "none"
        raise DataError(f"{location}: missing field '{field}' (fields present: {present})")
    return record[field]


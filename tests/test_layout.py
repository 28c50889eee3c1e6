"""The house rules a reader relies on, checked so they stay true: no source file longer than
fits a few screens (400 lines), no function in ``train/`` with more than six parameters
(a small dataclass carries what belongs together), and a README that stays the product's page
(at most 220 lines, no table cell over 120 characters: the detail lives in docs/)."""

import ast
import re
from pathlib import Path

import postrl

ROOT = Path(postrl.__file__).parent
README = ROOT.parent / "README.md"
MAX_LINES = 400
MAX_TRAIN_PARAMETERS = 6
SOURCES = ("*.py", "*.c", "*.h")
MAX_README_LINES = 220
MAX_README_CELL = 120


def long_files(root: Path, limit: int) -> list[str]:
    """Source files under ``root`` with more than ``limit`` lines, with their lengths."""
    found = []
    for pattern in SOURCES:
        for path in sorted(root.rglob(pattern)):
            lines = len(path.read_text().splitlines())
            if lines > limit:
                found.append(f"{path.relative_to(root)}: {lines} lines")
    return found


def wide_functions(root: Path, limit: int) -> list[str]:
    """Functions under ``root`` taking more than ``limit`` parameters (``self`` and ``cls`` of a
    method not counted; ``*args`` and ``**kwargs`` count one each)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = node.args
            named = [*args.posonlyargs, *args.args, *args.kwonlyargs]
            count = len(named) + (args.vararg is not None) + (args.kwarg is not None)
            count -= bool(named) and named[0].arg in ("self", "cls")
            if count > limit:
                found.append((path.relative_to(root), node.lineno, node.name, count))
    return [f"{path}:{line} {name}: {count}" for path, line, name, count in sorted(found)]


def wide_cells(markdown: str, limit: int) -> list[str]:
    """Table cells of ``markdown`` (outside fenced code) longer than ``limit`` characters, as
    ``line N: length``; an escaped ``\\|`` does not end a cell."""
    found, fenced = [], False
    for number, line in enumerate(markdown.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not line.lstrip().startswith("|"):
            continue
        for cell in re.split(r"(?<!\\)\|", line.strip().strip("|")):
            if len(cell.strip()) > limit:
                found.append(f"line {number}: {len(cell.strip())}")
    return found


def test_no_source_file_is_longer_than_400_lines():
    assert long_files(ROOT, MAX_LINES) == []


def test_no_function_in_train_takes_more_than_six_parameters():
    assert wide_functions(ROOT / "train", MAX_TRAIN_PARAMETERS) == []


def test_the_readme_is_a_page_with_narrow_tables():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    assert wide_cells(text, MAX_README_CELL) == []


def test_the_checks_find_what_they_look_for(tmp_path):
    (tmp_path / "wide.py").write_text(
        "def f(a, b, c, d, e, f, g):\n    pass\n"
        "class C:\n    def m(self, a, b, c, d, e, f):\n        pass\n"
        "def h(a, *rest, **options):\n    pass\n")
    (tmp_path / "long.c").write_text("int x;\n" * 401)
    assert wide_functions(tmp_path, 6) == ["wide.py:1 f: 7"]
    assert wide_functions(tmp_path, 2) == ["wide.py:1 f: 7", "wide.py:4 m: 6", "wide.py:6 h: 3"]
    assert long_files(tmp_path, 400) == ["long.c: 401 lines"]
    table = "| a | " + "x" * 121 + " |\n|---|---|\n| `p \\| q` | " + "y" * 120 + " |\n"
    assert wide_cells(table, 120) == ["line 1: 121"]
    assert wide_cells("```\n| " + "z" * 200 + " |\n```\n", 120) == []

"""The house rules a reader relies on, checked so they stay true: no source file longer than
fits a few screens (400 lines), and no function in ``train/`` with more than six parameters
(a small dataclass carries what belongs together)."""

import ast
from pathlib import Path

import postrl

ROOT = Path(postrl.__file__).parent
MAX_LINES = 400
MAX_TRAIN_PARAMETERS = 6
SOURCES = ("*.py", "*.c", "*.h")


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


def test_no_source_file_is_longer_than_400_lines():
    assert long_files(ROOT, MAX_LINES) == []


def test_no_function_in_train_takes_more_than_six_parameters():
    assert wide_functions(ROOT / "train", MAX_TRAIN_PARAMETERS) == []


def test_the_checks_find_what_they_look_for(tmp_path):
    (tmp_path / "wide.py").write_text(
        "def f(a, b, c, d, e, f, g):\n    pass\n"
        "class C:\n    def m(self, a, b, c, d, e, f):\n        pass\n"
        "def h(a, *rest, **options):\n    pass\n")
    (tmp_path / "long.c").write_text("int x;\n" * 401)
    assert wide_functions(tmp_path, 6) == ["wide.py:1 f: 7"]
    assert wide_functions(tmp_path, 2) == ["wide.py:1 f: 7", "wide.py:4 m: 6", "wide.py:6 h: 3"]
    assert long_files(tmp_path, 400) == ["long.c: 401 lines"]

"""The house rules a reader relies on, checked so they stay true: no source file longer than
fits a few screens (400 lines), no function in ``train/`` with more than six parameters
(a small dataclass carries what belongs together), a README that stays the product's page
(at most 220 lines, no table cell over 120 characters: the detail lives in docs/), and no
module's global set from outside it (what a module reads is what its own file says)."""

import ast
import os
import re
from pathlib import Path

import postrl

ROOT = Path(postrl.__file__).parent
REPO = ROOT.parent
README = REPO / "README.md"
# the code whose assignments of postrl globals are checked (folders that exist)
CHECKED = ("postrl", "bench", "tests", "examples", "studies")
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


def python_files(repo: Path, tops: tuple[str, ...]) -> list[Path]:
    """The ``.py`` files under ``repo``'s folders ``tops`` (those that exist), hidden folders
    (a virtual environment such as ``bench/.venv``) left out."""
    found = []
    for top in tops:
        for folder, subfolders, files in os.walk(repo / top):
            subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
            found += [Path(folder) / f for f in sorted(files) if f.endswith(".py")]
    return found


def is_module(dotted: str, repo: Path) -> bool:
    """Whether ``dotted`` names a module or package of ``repo``'s own files (not imported)."""
    path = repo.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def postrl_modules(node: ast.Import | ast.ImportFrom, package: list[str],
                   repo: Path) -> dict[str, str]:
    """The names ``node`` binds to postrl modules, with each module's dotted name; a relative
    import is read from ``package``, the importing file's."""
    if isinstance(node, ast.Import):
        return {alias.asname or "postrl": alias.name if alias.asname else "postrl"
                for alias in node.names if alias.name.split(".")[0] == "postrl"
                and (alias.asname is None or is_module(alias.name, repo))}
    base = node.module or ""
    if node.level:
        base = ".".join([*package[:len(package) - node.level + 1], *filter(None, [base])])
    if base.split(".")[0] != "postrl":
        return {}
    return {alias.asname or alias.name: f"{base}.{alias.name}" for alias in node.names
            if is_module(f"{base}.{alias.name}", repo)}


def assigned_module_globals(path: Path, repo: Path) -> list[str]:
    """``file:line`` of each statement in ``path`` that sets a global of a postrl module other
    than ``path``'s own: an assignment (plain, augmented or annotated, one element of a tuple
    too) to an attribute of a name bound to the module by an import, or ``setattr(module,
    ...)``. Imports inside a function bind for that function only; its parameters shadow."""
    parts = path.relative_to(repo).with_suffix("").parts
    own = ".".join(parts).removesuffix(".__init__")
    found = []

    def module_of(expr: ast.expr, names: dict[str, str]) -> str | None:
        if isinstance(expr, ast.Name):
            return names.get(expr.id)
        if isinstance(expr, ast.Attribute):
            outer = module_of(expr.value, names)
            if outer is not None and is_module(f"{outer}.{expr.attr}", repo):
                return f"{outer}.{expr.attr}"
        return None

    def leaves(target: ast.expr):
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                yield from leaves(element)
        else:
            yield target.value if isinstance(target, ast.Starred) else target

    def check(node: ast.AST, names: dict[str, str]) -> None:
        if isinstance(node, ast.Assign):
            targets = [leaf for target in node.targets for leaf in leaves(target)]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "setattr" and node.args):
            name = node.args[1] if len(node.args) > 1 else None
            targets = [ast.Attribute(value=node.args[0], attr=name.value if isinstance(
                name, ast.Constant) and isinstance(name.value, str) else "?")]
        else:
            return
        for target in targets:
            if isinstance(target, ast.Attribute):
                module = module_of(target.value, names)
                if module is not None and module != own:
                    found.append(f"{path.relative_to(repo)}:{node.lineno} {module}.{target.attr}")

    def visit(node: ast.AST, names: dict[str, str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                names.update(postrl_modules(child, list(parts[:-1]), repo))
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                args = child.args
                shadowed = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs,
                                            args.vararg, args.kwarg) if a is not None}
                visit(child, {k: v for k, v in names.items() if k not in shadowed})
            else:
                check(child, names)
                visit(child, names)

    visit(ast.parse(path.read_text()), {})
    return found


def test_no_source_file_is_longer_than_400_lines():
    assert long_files(ROOT, MAX_LINES) == []


def test_no_function_in_train_takes_more_than_six_parameters():
    assert wide_functions(ROOT / "train", MAX_TRAIN_PARAMETERS) == []


def test_the_readme_is_a_page_with_narrow_tables():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    assert wide_cells(text, MAX_README_CELL) == []


def test_no_module_global_of_postrl_is_assigned_from_outside_its_module():
    """A module's globals (a threshold, a function) change only in its own file: a library
    whose behaviour a bench script or a test switches by assigning ``ops.X = ...`` runs, for
    the rest of that process, code no file shows (and an A/B that forgets to put it back
    measures the wrong thing after). Tests use pytest's ``monkeypatch.setattr``, allowed here:
    it is scoped to one test and undone after it."""
    found = [hit for path in python_files(REPO, CHECKED)
             for hit in assigned_module_globals(path, REPO)]
    assert found == []


def test_bench_scripts_reach_the_trainer_through_its_phases_only():
    """The bench wraps and times a step's phases through ``trainer.phases``
    (``postrl/train/phases.py``), never by replacing or calling the trainer's private methods:
    those may change without notice. (``vs_trl.py``'s TRL trainer is TRL's.)"""
    private = []
    for path in sorted((REPO / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "trainer" and node.attr.startswith("_")
                    and node.attr != "_generate_and_score_completions"):
                private.append(f"{path.name}:{node.lineno} trainer.{node.attr}")
    assert private == []


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
    (tmp_path / "postrl" / "models").mkdir(parents=True)
    for module in ("__init__", "models/__init__", "models/ops", "models/vocab"):
        (tmp_path / "postrl" / f"{module}.py").write_text("X = 1\n")
    (tmp_path / "patches.py").write_text(
        "import postrl.models.ops as ops\n"
        "from postrl.models import vocab, X\n"
        "import postrl\n"
        "ops.X = 2\n"
        "vocab.X, other = 3, 4\n"
        "postrl.models.ops.X += 1\n"
        "setattr(vocab, 'X', 5)\n"
        "X.y = 6\n"  # X is no module: an attribute of a value
        "def scoped(monkeypatch, ops):\n"
        "    monkeypatch.setattr(vocab, 'X', 7)\n"  # undone after the test
        "    ops.X = 8\n"  # a parameter, not the module
        "    from postrl.models import ops as o\n"
        "    o.X: int = 9\n")
    (tmp_path / "postrl" / "models" / "ops.py").write_text("from . import ops\nops.X = 2\n")
    assert assigned_module_globals(tmp_path / "patches.py", tmp_path) == [
        "patches.py:4 postrl.models.ops.X", "patches.py:5 postrl.models.vocab.X",
        "patches.py:6 postrl.models.ops.X", "patches.py:7 postrl.models.vocab.X",
        "patches.py:13 postrl.models.ops.X"]
    assert assigned_module_globals(tmp_path / "postrl" / "models" / "ops.py", tmp_path) == []

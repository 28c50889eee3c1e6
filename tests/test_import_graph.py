"""postrl's imports point one way: no module imports itself back through others, and every
arrow between packages goes down the layers below. Function-level imports count, and so do
those under ``if TYPE_CHECKING:``: an import made only for annotations still ties the two
modules together (a reader, a type checker, a refactoring sees the circle)."""

import ast
from pathlib import Path

import postrl

ROOT = Path(postrl.__file__).parent

# Top-level packages and modules, from the top: each may import only ranks below its own.
# cli -> experiments -> train -> {rollout, rewards, tasks, telemetry} -> {models, envs} -> the base
# (recipes, objectives, config); the optional backend (accel) sits on models' seams and
# nothing imports it.
RANKS = {
    "cli": 9,
    "experiments": 8,
    "options_docs": 8,
    "train": 7,  # with train/distributed: the trainer over processes
    "accel": 6,
    "rollout": 6,
    "rewards": 6,
    "tasks": 6,
    "telemetry": 6,
    "models": 5,
    "envs": 5,  # the environment protocol, below the tasks that define environments
    "config": 4,
    "config_checks": 3,
    "components": 3,
    "recipes": 2,
    "objectives": 1,
    "config_yaml": 1,  # a config file read with its lines
    "postrl": 1,  # the package's __init__: its errors
    "errors": 0,
    "options": 0,
    "config_paths": 0,
    "devices": 0,
    "process": 0,
    "buckets": 0,
    "cliargs": 0,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in ROOT.rglob("*.py")}


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    return getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING"


def _nodes(tree: ast.AST, type_only: bool = False):
    """``(node, type_only)`` for every node, ``type_only`` where it is under
    ``if TYPE_CHECKING:`` (and so runs only for a type checker)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield child, True
                yield from _nodes(child, True)
            for child in node.orelse:
                yield child, type_only
                yield from _nodes(child, type_only)
            continue
        yield node, type_only
        yield from _nodes(node, type_only)


def _known(name: str) -> str:
    """The postrl module ``name`` is, or is in (``postrl.models.ops.attention``: ops)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports(name: str, type_only: bool = True, source: str | None = None) -> set[str]:
    """The postrl modules that module ``name`` (whose text is ``source``, or its file's)
    imports: at run time, and with ``type_only`` for annotations too."""
    path = MODULES.get(name, ROOT / "__init__.py")
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node, for_types in _nodes(ast.parse(path.read_text() if source is None else source)):
        if for_types and not type_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {_known(t) for t in targets if t.split(".")[0] == "postrl"}
    return found - {name}


GRAPH = {name: imports(name) for name in MODULES}  # type-only imports included
RUNTIME = {name: imports(name, type_only=False) for name in MODULES}


def top(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "postrl"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_back():
    assert cycles(RUNTIME) == []


def test_no_module_imports_itself_back_even_for_annotations():
    assert cycles(GRAPH) == []


def test_imports_for_annotations_are_found():
    source = ("from typing import TYPE_CHECKING\nimport typing\n"
              "if TYPE_CHECKING:\n    from postrl.config import TrainConfig\n"
              "if typing.TYPE_CHECKING:\n    import postrl.recipes\n"
              "else:\n    from postrl import errors\n")
    assert imports("postrl.x", source=source) == {"postrl.config", "postrl.recipes",
                                                  "postrl.errors"}
    assert imports("postrl.x", type_only=False, source=source) == {"postrl.errors"}


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_package_has_a_rank():
    assert {top(name) for name in MODULES} <= set(RANKS)


def test_imports_between_packages_point_down_the_layers():
    upward = sorted(f"{name} -> {other}" for name, others in GRAPH.items() for other in others
                    if top(name) != top(other) and RANKS[top(other)] >= RANKS[top(name)])
    assert upward == []


def test_nothing_imports_the_backend_but_the_backend():
    importers = sorted(name for name, others in GRAPH.items()
                       if top(name) != "accel" and any(top(o) == "accel" for o in others))
    assert importers == []

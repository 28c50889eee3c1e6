"""The scripts under ``bench/`` as modules, for the tests that check them (``bench/`` is no
package: its scripts run as ``python bench/<name>.py``)."""

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench_script(name: str) -> ModuleType:
    """``bench/<name>.py``, imported under ``name``."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

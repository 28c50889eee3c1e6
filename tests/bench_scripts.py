"""The scripts under ``bench/`` as modules, for the tests that check them (``bench/`` is no
package: its scripts run as ``python bench/<name>.py``)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench_script(name: str) -> ModuleType:
    """``bench/<name>.py``, imported under ``name``, with ``bench/`` on the import path as
    when it runs as a script (its scripts import each other)."""
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as importlib's recipe does: dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def varying_reward(monkeypatch, folder: Path) -> None:
    """The bench's runs score by a reward that varies within the tiny model's groups (the
    response's length, from a file in ``folder``), so that their updates train every row."""
    (folder / "lengths.py").write_text(
        "def length(prompts, completions, **_):\n"
        "    return [float(len(str(c))) for c in completions]\n")
    vs_trl = load_bench_script("vs_trl")  # the module the A/B scripts import their run from
    monkeypatch.setattr(vs_trl, "reward_spec", lambda regime: f"{folder}/lengths.py:length")

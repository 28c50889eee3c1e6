"""Every example config loads, validates and names the recipe its file is named after."""

from pathlib import Path

import pytest

from postrl.config import load_config
from postrl.recipes import PRESETS

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def test_there_is_one_example_per_recipe():
    assert {p.stem for p in EXAMPLES} >= set(PRESETS)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_loads(path):
    cfg = load_config(path)
    if path.stem in PRESETS:
        assert cfg.recipe == path.stem
    cfg.build_recipe()

"""Shared fixtures: the real SmolLM2 tokenizer and a tiny randomly initialised Llama."""

import pytest

from postrl.models import load_policy


@pytest.fixture(scope="session")
def tiny():
    """``(model, tokenizer)``: 2 layers, 64 wide, the real SmolLM2 tokenizer, seed 0."""
    return load_policy("tiny", seed=0)

"""DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) on hand-computed numbers."""

from __future__ import annotations

import pytest

from postrl.errors import ConfigError
from postrl.rewards import soft_overlong_penalty


def test_hand_computed_values() -> None:
    # L_max = 20, L_cache = 5: free up to 15, then a linear ramp to -1 at 20, -1 beyond.
    lengths = [0, 10, 15, 16, 17, 18, 19, 20, 25]
    expected = [0.0, 0.0, 0.0, -0.2, -0.4, -0.6, -0.8, -1.0, -1.0]
    assert soft_overlong_penalty(lengths, max_new_tokens=20, buffer=5) == pytest.approx(expected)


def test_factor_scales_the_penalty() -> None:
    penalties = soft_overlong_penalty([15, 17, 20, 30], max_new_tokens=20, buffer=5, factor=0.5)
    assert penalties == pytest.approx([0.0, -0.2, -0.5, -0.5])


def test_empty_batch() -> None:
    assert soft_overlong_penalty([], max_new_tokens=20, buffer=5) == []


@pytest.mark.parametrize("buffer", [0, -1, 20, 21])
def test_buffer_must_lie_inside_the_generation_limit(buffer: int) -> None:
    with pytest.raises(ConfigError, match=r"overlong buffer .*max_new_tokens=20.*got"):
        soft_overlong_penalty([10], max_new_tokens=20, buffer=buffer)

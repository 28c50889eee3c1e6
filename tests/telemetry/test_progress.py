"""TrainProgress: a live bar on a terminal, plain lines elsewhere, nothing when quiet."""

import io
import math

from rich.console import Console

from postrl.telemetry.progress import (
    TrainProgress,
    format_count,
    format_number,
    format_seconds,
    headline,
)

STEP_METRICS = {
    "reward/mean": 0.5,
    "accuracy/mean": 0.3125,
    "loss/total": 0.01234,
    "length/mean": 37.25,
    "rollout/tokens_generated": 1234,
    "time/step_s": 2.5,
    "grad/norm": 9.0,
}


def console(terminal: bool) -> Console:
    return Console(file=io.StringIO(), force_terminal=terminal, width=140, color_system=None)


def test_formatting():
    assert format_number(0.421337) == "0.4213" and format_number(math.nan) == "nan"
    assert format_count(950) == "950" and format_count(12345) == "12.3k"
    assert format_count(4_560_000) == "4.56M"
    assert format_seconds(2.5) == "2.50s" and format_seconds(125.4) == "125s"


def test_headline_shows_what_is_present_in_a_fixed_order():
    text = headline(STEP_METRICS)
    assert text == "reward 0.5  acc 0.3125  loss 0.01234  len 37.25  tokens 1.23k  step 2.50s"
    assert "kl" not in text and "grad" not in text
    assert "kl 0.002" in headline({"kl/mean": 0.002, "reward/mean": None})
    assert headline({"rollout/tokens_generated": 500}, token_budget=10_000) == "tokens 500/10k"


def test_plain_lines_when_not_on_a_terminal():
    out = console(terminal=False)
    with TrainProgress(total_steps=3, console=out) as progress:
        assert not progress.live
        progress.update(1, STEP_METRICS)
        progress.update(2, {"reward/mean": 0.75})
    lines = out.file.getvalue().splitlines()
    assert lines == [
        "step 1/3  reward 0.5  acc 0.3125  loss 0.01234  len 37.25  tokens 1.23k  step 2.50s",
        "step 2/3  reward 0.75",
    ]


def test_plain_lines_without_a_step_total():
    out = console(terminal=False)
    with TrainProgress(token_budget=5000, console=out) as progress:
        progress.update(1, {"rollout/tokens_generated": 2500})
    assert out.file.getvalue() == "step 1  tokens 2.5k/5k\n"


def test_quiet_prints_nothing_even_on_a_terminal():
    for terminal in (False, True):
        out = console(terminal)
        with TrainProgress(total_steps=2, quiet=True, console=out) as progress:
            progress.update(1, STEP_METRICS)
        assert out.file.getvalue() == ""


def test_live_bar_on_a_terminal_shows_steps_tokens_and_headline():
    out = console(terminal=True)
    with TrainProgress(total_steps=2, token_budget=10_000, console=out) as progress:
        assert progress.live
        progress.update(1, STEP_METRICS)
        progress.update(2, {**STEP_METRICS, "rollout/tokens_generated": 2468})
    final = out.file.getvalue()
    assert "steps" in final and "2/2" in final
    assert "tokens" in final and "2468/10000" in final
    assert "reward 0.5  acc 0.3125" in final and "tokens 2.47k/10k" in final

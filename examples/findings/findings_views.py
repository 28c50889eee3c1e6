"""What docs/findings.md shows for each experiment: the rows of its table and its figures.

Row keys are what notes.md cites inline, e.g. ``{{ length value grpo len_incorrect_change }}``.
Figures reuse ``postrl report``'s panels (x = generated tokens, mean over seeds with a band
from the lowest to the highest seed); ``samples/accuracy`` is the per-step accuracy of every
generated response, computed from samples.jsonl by :func:`with_sample_accuracy`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from findings_data import RunData
from findings_tables import (
    Row,
    change,
    complete_samples,
    correct_per_1k_tokens,
    early,
    largest,
    last,
    late,
    late_sampled_accuracy,
    over_run,
    smallest,
    wasted_share,
)

from postrl.errors import DataError
from postrl.experiments import plots
from postrl.experiments.plots import Line, Panel

SAMPLE_ACCURACY = "samples/accuracy"  # derived here, never logged by the trainer


@dataclass(frozen=True)
class View:
    rows: tuple[Row, ...]
    panels: tuple[Panel, ...]


COMMON_ROWS = (
    Row("eval_last", "held-out greedy accuracy (last evaluation)", last("eval/accuracy")),
)


def drift_rows(key: str, label: str, metric: str) -> tuple[Row, Row, Row]:
    """``KEY_early``, ``KEY_late`` and ``KEY_change`` (late - early) of one metric."""
    return (Row(f"{key}_early", f"{label}, early", early(metric)),
            Row(f"{key}_late", f"{label}, late", late(metric)),
            Row(f"{key}_change", f"{label}, late - early", change(metric)))


def _panel(name: str) -> Panel:
    return next(p for p in plots.PANELS if p.filename == f"{name}.png")


ACCURACY = Panel("accuracy.png", "Accuracy of sampled answers (T = 1, training prompts)",
                 "fraction", (Line("accuracy/mean"),))
SAMPLED_ACCURACY = Panel("sampled_accuracy.png",
                         "Accuracy of ALL generated answers (dropped groups too)", "fraction",
                         (Line(SAMPLE_ACCURACY),))
WASTED = Panel("tokens_wasted.png", "Tokens generated for dropped groups (cumulative)",
               "tokens", (Line("rollout/tokens_wasted"),))
GRAD = Panel("grad_norm.png", "Gradient norm before clipping", "norm", (Line("grad/norm"),))
LOGRATIO = Panel("token_logratio_std.png", "Spread of token log-ratios within a response",
                 "nats", (Line("ratio/token_logratio_std"),))

VIEWS: dict[str, View] = {
    "length": View(
        rows=(
            Row("acc_late", "accuracy of sampled answers, late", late("accuracy/mean")),
            *drift_rows("len_correct", "length of correct answers", "length/correct_mean"),
            *drift_rows("len_incorrect", "length of incorrect answers",
                        "length/incorrect_mean"),
            Row("truncated_late", "share truncated at max_new_tokens, late", late(
                "length/truncated_frac")),
            Row("entropy_late", "entropy (nats/token), late", late("entropy/mean")),
            *COMMON_ROWS),
        panels=(_panel("length_by_correctness"), _panel("length"), ACCURACY,
                _panel("eval_accuracy"))),
    "ladder": View(
        rows=(
            Row("zero_var", "zero-variance groups (share, mean over steps)", over_run(
                "batch/zero_variance_frac")),
            Row("rounds", "sampling rounds per step (mean)", over_run("rollout/sampling_rounds")),
            Row("wasted", "wasted tokens (share of generated)", wasted_share),
            Row("entropy_early", "entropy (nats/token), early", early("entropy/mean")),
            Row("entropy_late", "entropy (nats/token), late", late("entropy/mean")),
            Row("acc_all_late", "accuracy of all generated answers, late", late_sampled_accuracy),
            Row("correct_per_1k", "correct answers per 1,000 generated tokens",
                correct_per_1k_tokens),
            Row("len_late", "response length, late", late("length/mean")),
            *COMMON_ROWS),
        panels=(_panel("zero_variance"), WASTED, _panel("entropy"), SAMPLED_ACCURACY,
                _panel("length"), _panel("eval_accuracy"))),
    "offpolicy": View(
        rows=(
            Row("seq_std", "std of sequence ratios s_i (mean over steps)", over_run(
                "ratio/seq_std")),
            Row("logratio_std", "std of token log-ratios in a response (mean over steps)",
                over_run("ratio/token_logratio_std")),
            Row("ratio_max", "largest ratio of the recipe's unit (run max)", largest(
                "ratio/max")),
            Row("ratio_min", "smallest ratio of the recipe's unit (run min)", smallest(
                "ratio/min")),
            Row("clip_low", "clipped share, low (mean over steps)", over_run("clip/low_frac")),
            Row("clip_high", "clipped share, high (mean over steps)", over_run(
                "clip/high_frac")),
            Row("grad_mean", "gradient norm before clipping (mean over steps)", over_run(
                "grad/norm")),
            Row("grad_max", "gradient norm before clipping (run max)", largest("grad/norm")),
            Row("skipped", "steps skipped for a non-finite loss", last("guard/skipped_steps")),
            Row("acc_early", "accuracy of sampled answers, early", early("accuracy/mean")),
            Row("acc_late", "accuracy of sampled answers, late", late("accuracy/mean")),
            Row("entropy_late", "entropy (nats/token), late", late("entropy/mean")),
            *COMMON_ROWS),
        panels=(_panel("ratio_seq_std"), LOGRATIO, _panel("clip"), GRAD, ACCURACY,
                _panel("eval_accuracy"))),
}


def view(name: str) -> View:
    """The view of experiment ``name``; KeyError listing the known ones."""
    if name not in VIEWS:
        raise KeyError(f"no table or figures are defined for experiment {name!r} (only for "
                       f"{', '.join(VIEWS)}: examples/findings/findings_views.py)")
    return VIEWS[name]


def with_sample_accuracy(run: RunData) -> list[dict[str, Any]]:
    """The run's metric records, each with :data:`SAMPLE_ACCURACY` added when samples.jsonl
    logs every response of the run (for plotting only; the tables refuse incomplete ones)."""
    try:
        by_step = complete_samples(run) if run.samples else {}
    except DataError:
        by_step = {}
    records = []
    for record in run.records:
        rows = by_step.get(int(record["step"]))
        extra = {SAMPLE_ACCURACY: sum(bool(r["correct"]) for r in rows) / len(rows)} if rows else {}
        records.append({**record, **extra})
    return records


def prefixed(panel: Panel, name: str) -> Panel:
    """The panel saved as ``<name>_<file>.png`` so experiments never overwrite each other."""
    return replace(panel, filename=f"{name}_{panel.filename}")

"""The generated Markdown blocks of docs/findings.md, each computed from run directories.

One function per placeholder kind of notes.md (see write_report.py): ``overview``, and per
experiment ``setup``, ``table``, ``cost``, ``figures``, ``runs`` and ``value``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from findings_data import ExperimentData
from findings_plan import BY_NAME
from findings_tables import Row, cell_text, find_row, last, logged_seconds, markdown_table, steps
from findings_views import prefixed, view, with_sample_accuracy

from postrl.components import differing
from postrl.errors import DataError
from postrl.experiments import plots
from postrl.recipes import Recipe

COST_ROWS = (
    Row("steps", "optimizer steps", steps),
    Row("tokens", "tokens generated", last("rollout/tokens_generated")),
    Row("tokens_wasted", "tokens wasted (dropped groups)", last("rollout/tokens_wasted")),
    Row("seconds", "seconds logged (steps + evaluations)", logged_seconds),
)


def _minutes(seconds: float | None) -> str:
    return "not recorded" if seconds is None else f"{seconds / 60:.1f} min"


def _total(data: ExperimentData, metric: str) -> int:
    return int(sum(last(metric)(run) or 0 for run in data.runs))


def overview(experiments: Sequence[ExperimentData]) -> str:
    """One row per experiment: recipes, seeds, budget, tokens and wall time; then the total."""
    lines = ["| experiment | recipes | seeds | token budget per run | tokens generated (all "
             "runs) | wall time |", "|---|---|---:|---:|---:|---:|"]
    for data in experiments:
        config = data.runs[0].run.config
        seeds = {len(runs) for runs in data.groups.values()}
        title = BY_NAME[data.name].title if data.name in BY_NAME else data.name
        lines.append(f"| {title} (`{data.path}`) | {', '.join(data.groups)} | "
                     f"{'/'.join(map(str, sorted(seeds)))} | {config.get('token_budget'):,} | "
                     f"{_total(data, 'rollout/tokens_generated'):,} | "
                     f"{_minutes(data.wall_seconds)} |")
    walls = [d.wall_seconds for d in experiments]
    total = None if None in walls else sum(walls)
    tokens = sum(_total(d, "rollout/tokens_generated") for d in experiments)
    lines.append(f"| all | | | | {tokens:,} | {_minutes(total)} |")
    return "\n".join(lines)


def _recipe(run) -> Recipe:
    resolved = dict(run.run.config.get("resolved_recipe") or {})
    if not resolved:
        raise DataError(f"{run.path}/config.yaml: no resolved_recipe")
    return Recipe(**resolved)


def setup(data: ExperimentData) -> str:
    """The command, the shared schedule (from config.yaml), and what each recipe changes."""
    config = data.runs[0].run.config
    options = ", ".join(f"{k}={v}" for k, v in (config.get("task_options") or {}).items())
    updates = config["epochs"] * config["minibatches"]
    seeds = sorted({run.seed for run in data.runs})
    lines = [f"- command: `{data.command}`" if data.command else
             "- command: not recorded (no findings.json)",
             f"- model `{config['model']}`, task `{config['task']}` ({options}); "
             f"{config['prompts_per_step']} prompts x {config['group_size']} samples per step, "
             f"max_new_tokens {config['max_new_tokens']}, temperature {config['temperature']}, "
             f"lr {config['lr']}, {updates} update(s) per batch (epochs {config['epochs']} x "
             f"minibatches {config['minibatches']})",
             f"- every run stops at the step that crosses {config['token_budget']:,} generated "
             f"tokens; seeds {seeds}"]
    first = _recipe(data.groups[next(iter(data.groups))][0])
    for label, runs in data.groups.items():
        recipe = _recipe(runs[0])
        changes = "; ".join(f"{c.title}: {c.describe(recipe)}" for c in differing(first, recipe))
        lines.append(f"- `{label}`: " + (changes or "the baseline"))
    lines += [f"- warning from `postrl {data.manifest.get('command', 'compare')}`: {w}"
              for w in data.manifest.get("warnings", [])]
    return "\n".join(lines)


def table(data: ExperimentData) -> str:
    return markdown_table(data, view(data.name).rows)


def cost(data: ExperimentData) -> str:
    return markdown_table(data, COST_ROWS) + (
        f"\n\nWall time of the whole experiment: {_minutes(data.wall_seconds)}.")


def figures(data: ExperimentData, figures_dir: Path, doc_dir: Path) -> str:
    """Draw the experiment's panels into ``figures_dir``; Markdown image links to them."""
    figures_dir.mkdir(parents=True, exist_ok=True)
    groups = {label: [with_sample_accuracy(run) for run in runs]
              for label, runs in data.groups.items()}
    links = []
    for panel in view(data.name).panels:
        if not any(plots.has_data(groups, metric) for metric in panel.metrics):
            continue
        path = plots.plot_panel(prefixed(panel, data.name), groups, figures_dir)
        links.append(f"![{panel.title}]({Path(os.path.relpath(path, doc_dir)).as_posix()})")
    return "\n".join(links)


def runs(data: ExperimentData) -> str:
    return "\n".join(f"- `{run.path}` ({label}, seed {run.seed}, {_steps(len(run.records))})"
                     for label, members in data.groups.items() for run in members)


def _steps(count: int) -> str:
    return f"{count} step" + ("" if count == 1 else "s")


def value(data: ExperimentData, label: str, key: str) -> str:
    """One table cell, ``mean ± half-width``, for inline use in the prose."""
    if label not in data.groups:
        raise KeyError(f"no recipe {label!r} in {data.path}; recipes: {', '.join(data.groups)}")
    rows = view(data.name).rows + COST_ROWS
    try:
        row = find_row(rows, key)
    except KeyError:
        raise KeyError(f"no row {key!r} for {data.name}; rows: "
                       + ", ".join(dict.fromkeys(r.key for r in rows))) from None
    return cell_text(data.groups[label], row)

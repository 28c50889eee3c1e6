"""``postrl report DIR...``: curves, final metrics and costs of runs, as HTML and Markdown.

A DIR is a run directory (it holds ``metrics.jsonl``) or a directory with run directories
somewhere below it (a ``compare`` or ``ladder`` output). Runs are grouped by recipe, the
``resolved_recipe.name`` of their ``config.yaml``; the runs of one recipe are its seeds.
The report (``report.html``, ``report.md`` and one PNG per panel, all in one folder) has

- curves against generated tokens (:mod:`postrl.experiments.plots`);
- final metrics: each seed's last logged value, and the mean over seeds with its 95%
  Student-t interval, clipped to the values the metric can take;
- paired differences between recipes, seed by seed (:mod:`postrl.experiments.paired`): every
  recipe against the first, or each rung against the one before for a ``ladder`` output;
- costs per run: tokens generated and wasted, seconds per phase summed over steps,
  as mean ± 95% CI over seeds;
- the list of runs read.

The HTML uses relative image paths and inline CSS only, so it works offline and can be moved
together with its PNGs.
"""

from __future__ import annotations

import argparse
import html
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from postrl.errors import DataError
from postrl.experiments import plots
from postrl.experiments.paired import (
    FINAL_METRICS,
    PAIRED_HEADERS,
    Finals,
    final_values,
    paired_cells,
    paired_rows,
    power_note,
    seed_rows,
)
from postrl.experiments.stats import finite, format_interval, format_number, mean_interval
from postrl.telemetry import RunDir, read_metrics
from postrl.telemetry.names import value_range

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
COMPARISON_FILE = "comparison.json"  # written by compare and ladder
CUMULATIVE_COSTS: tuple[tuple[str, str], ...] = (
    ("tokens generated", "rollout/tokens_generated"), ("tokens wasted", "rollout/tokens_wasted"),
)
PHASE_SECONDS: tuple[tuple[str, str], ...] = (
    ("generate s", "time/generate_s"), ("score s", "time/score_s"),
    ("reference s", "time/reference_s"), ("train s", "time/train_s"),
    ("eval s", "time/eval_s"), ("step s", "time/step_s"),
)


@dataclass(frozen=True)
class Table:
    """A titled table with an optional note, rendered to both HTML and Markdown."""

    title: str
    headers: list[str]
    rows: list[list[str]]
    note: str = ""


@dataclass
class Run:
    """One finished (or stopped) training run: where it is, its config and its metrics."""

    path: Path
    config: dict[str, Any]
    records: list[dict[str, Any]]

    @property
    def recipe(self) -> str:
        """``resolved_recipe.name``; else the ``recipe`` option; else the directory name."""
        resolved = self.config.get("resolved_recipe") or {}
        return str(resolved.get("name") or self.config.get("recipe") or self.path.name)

    @property
    def seed(self) -> Any:
        return self.config.get("seed", "?")

    def final(self, metric: str) -> float | None:
        """The last finite value of ``metric`` (None if never logged)."""
        values = finite(record.get(metric) for record in self.records)
        return values[-1] if values else None

    def total(self, metric: str) -> float | None:
        """The sum of ``metric`` over steps (None if never logged)."""
        values = finite(record.get(metric) for record in self.records)
        return sum(values) if values else None


def find_run_dirs(paths: Iterable[Path | str]) -> list[Path]:
    """Every run directory given, or found below a given directory, in a stable order.

    Raises DataError naming the path for a path that does not exist, a run directory without
    ``metrics.jsonl`` and a directory with no run below it.
    """
    found: list[Path] = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise DataError(f"{path}: no such directory")
        if (path / METRICS_FILE).is_file():
            found.append(path)
            continue
        nested = sorted({p.parent for p in path.rglob(METRICS_FILE)})
        nested = [p for p in nested if not any(q in p.parents for q in nested)]
        order = _manifest_labels(path)  # compare's order: the baseline first
        nested.sort(key=lambda p: order.index(p.relative_to(path).parts[0])
                    if p.relative_to(path).parts[0] in order else len(order))
        if nested:
            found.extend(nested)
        elif (path / CONFIG_FILE).is_file():
            raise DataError(f"{path / METRICS_FILE}: missing (the run logged no step)")
        else:
            raise DataError(f"{path}: no runs found (a run directory holds {METRICS_FILE})")
    unique: dict[Path, Path] = {}
    for path in found:
        unique.setdefault(path.resolve(), path)  # a run named twice is read once
    return list(unique.values())


def _manifest(path: Path) -> dict[str, Any]:
    """The ``comparison.json`` that compare and ladder write in their output ({} if none)."""
    file = Path(path) / COMPARISON_FILE
    if not file.is_file():
        return {}
    try:
        manifest = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{file}: not valid JSON ({err})") from None
    return manifest if isinstance(manifest, dict) else {}


def _manifest_labels(path: Path) -> list[str]:
    runs = _manifest(path).get("runs") or []
    return list(dict.fromkeys(str(r.get("label")) for r in runs if isinstance(r, dict)))


def is_ladder(paths: Sequence[Path]) -> bool:
    """Whether the report is of one ``postrl ladder`` output (rungs compared in order)."""
    return len(paths) == 1 and _manifest(Path(paths[0])).get("command") == "ladder"


def load_run(path: Path) -> Run:
    """Read one run directory; DataError naming the file when its metrics are unusable."""
    run_dir = RunDir(path)
    if not run_dir.metrics_path.is_file():
        raise DataError(f"{run_dir.metrics_path}: missing")
    try:
        records = read_metrics(run_dir.metrics_path)
    except json.JSONDecodeError as err:
        raise DataError(f"{run_dir.metrics_path}: not valid JSON Lines ({err})") from None
    if not records:
        raise DataError(f"{run_dir.metrics_path}: empty (no step logged)")
    config = run_dir.read_config() if run_dir.config_path.is_file() else {}
    return Run(path=path, config=config, records=records)


def group_by_recipe(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """Recipe name → its runs (seeds), recipes in order of first appearance, seeds sorted.

    Runs with the same name but different resolved components get numbered labels, so they
    are never averaged together.
    """
    keyed: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        components = json.dumps(run.config.get("resolved_recipe"), sort_keys=True, default=str)
        keyed.setdefault((run.recipe, components), []).append(run)
    names = [name for name, _ in keyed]
    groups: dict[str, list[Run]] = {}
    seen: dict[str, int] = {}
    for (name, _), members in keyed.items():
        seen[name] = seen.get(name, 0) + 1
        label = f"{name} #{seen[name]}" if names.count(name) > 1 else name
        groups[label] = sorted(members, key=lambda run: str(run.seed))
    return groups


def _cell(values: Iterable[float | None], metric: str = "") -> str:
    return format_interval(mean_interval(values, value_range(metric)))


def final_table(groups: dict[str, list[Run]]) -> Table:
    """Rows = metrics logged by some run, columns = recipes; last values, mean [95% CI]."""
    rows = []
    for metric in FINAL_METRICS:
        cells = [_cell((run.final(metric) for run in runs), metric) for runs in groups.values()]
        if any(cell != "–" for cell in cells):
            rows.append([metric, *cells])
    headers = ["metric", *(f"{label} (n={len(runs)})" for label, runs in groups.items())]
    note = ("Each seed's last logged value of the metric; mean over seeds [95% Student-t "
            "interval, clipped to the values the metric can take].")
    return Table("Final metrics", headers, rows, note)


def finals_by_seed(groups: dict[str, list[Run]]) -> Finals:
    """Recipe -> seed -> final values, for the paired tables."""
    return {label: {_seed(run): final_values(run.records, FINAL_METRICS) for run in runs}
            for label, runs in groups.items()}


def _seed(run: Run) -> int:
    try:
        return int(run.seed)
    except (TypeError, ValueError):
        raise DataError(f"{run.path / CONFIG_FILE}: seed {run.seed!r} is not an integer; "
                        "paired comparisons match runs by seed") from None


def per_seed_table(finals: Finals) -> Table:
    """Every seed's final value, beside the mean and its interval."""
    headers, rows = seed_rows(finals, FINAL_METRICS)
    return Table("Final metrics per seed", headers, rows)


def paired_table(finals: Finals, consecutive: bool) -> Table | None:
    """Paired differences between recipes; None for a single recipe."""
    if len(finals) < 2:
        return None
    rows = [paired_cells(row) for row in paired_rows(finals, FINAL_METRICS, consecutive)]
    return Table("Paired differences", list(PAIRED_HEADERS), rows, power_note(finals))


def cost_table(groups: dict[str, list[Run]]) -> Table:
    """Rows = recipes; tokens (final cumulative count) and seconds (summed over steps) per run."""
    rows = []
    for label, runs in groups.items():
        cells = [_cell((run.final(m) for run in runs), m) for _, m in CUMULATIVE_COSTS]
        cells += [_cell((run.total(m) for run in runs), m) for _, m in PHASE_SECONDS]
        steps = _cell((run.final("step") for run in runs), "step")
        rows.append([label, str(len(runs)), steps, *cells])
    headers = ["recipe", "seeds", "steps", *(name for name, _ in CUMULATIVE_COSTS),
               *(name for name, _ in PHASE_SECONDS)]
    note = ("Per run, mean over seeds [95% CI]. Tokens: cumulative counts at the last step "
            "(wasted = generated for groups dropped by dynamic sampling). Seconds: summed over "
            "steps; eval time is not part of step time.")
    return Table("Cost", headers, rows, note)


def runs_table(groups: dict[str, list[Run]]) -> Table:
    """One row per run read."""
    rows = [[str(run.path), label, str(run.seed), format_number(run.final("step") or 0.0),
             format_number(run.final(plots.TOKENS) or 0.0)]
            for label, runs in groups.items() for run in runs]
    return Table("Runs", ["run directory", "recipe", "seed", "steps", "tokens generated"], rows)


def write_report(run_dirs: list[Path], out: Path) -> tuple[Path, Path]:
    """Write ``out/report.html``, ``out/report.md`` and the PNGs; return the two reports."""
    runs = [load_run(path) for path in find_run_dirs(run_dirs)]
    groups = group_by_recipe(runs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    drawn, skipped = plots.plot_all(
        {label: [run.records for run in members] for label, members in groups.items()}, out)
    figures = [(panel.title, path.name) for panel, path in drawn]
    finals = finals_by_seed(groups)
    paired = paired_table(finals, is_ladder(run_dirs))
    tables = [final_table(groups), per_seed_table(finals), *([paired] if paired else []),
              cost_table(groups), runs_table(groups)]
    missing = sorted({metric for panel in skipped for metric in panel.metrics})
    summary = (f"{len(runs)} run(s) of {len(groups)} recipe(s): "
               + ", ".join(f"{label} ({len(members)} seed(s))" for label, members in groups.items())
               + ". Curves: x = generated tokens; line = mean over seeds on a common token grid, "
               "band = lowest to highest seed.")
    if missing:
        summary += " Not logged by any run: " + ", ".join(missing) + "."
    html_path, md_path = out / "report.html", out / "report.md"
    html_path.write_text(render_html("postrl report", summary, figures, tables), encoding="utf-8")
    md_path.write_text(render_markdown("postrl report", summary, figures, tables), encoding="utf-8")
    return html_path, md_path


CSS = """
body { font-family: sans-serif; margin: 2em auto; max-width: 72em; padding: 0 1em; color: #222; }
h1, h2 { font-weight: 600; }
figure { display: inline-block; vertical-align: top; width: 46%; margin: 0.5em 1%; }
figure img { border: 1px solid #ddd; width: 100%; height: auto; }
figcaption { font-size: 0.85em; color: #555; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f3f3f3; }
p.note { font-size: 0.85em; color: #555; }
"""


def render_html(title: str, summary: str, figures: list[tuple[str, str]],
                tables: list[Table]) -> str:
    """A self-contained page: inline CSS, images by relative path, no scripts or fonts."""
    esc = html.escape
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{esc(title)}</title><style>{CSS}</style></head><body>",
             f"<h1>{esc(title)}</h1>", f"<p>{esc(summary)}</p>", "<h2>Curves</h2>"]
    for caption, name in figures:
        parts.append(f'<figure><img src="{esc(name)}" alt="{esc(caption)}" '
                     f'width="{plots.FIGSIZE[0] * plots.DPI:.0f}" '
                     f'height="{plots.FIGSIZE[1] * plots.DPI:.0f}">'
                     f"<figcaption>{esc(caption)}</figcaption></figure>")
    for table in tables:
        parts.append(f"<h2>{esc(table.title)}</h2>")
        if table.note:
            parts.append(f'<p class="note">{esc(table.note)}</p>')
        header = "".join(f"<th>{esc(h)}</th>" for h in table.headers)
        parts.append(f"<table><thead><tr>{header}</tr></thead><tbody>")
        parts += ["<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>"
                  for row in table.rows]
        parts.append("</tbody></table>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def render_markdown(title: str, summary: str, figures: list[tuple[str, str]],
                    tables: list[Table]) -> str:
    """The same report as Markdown, images by relative path."""
    lines = [f"# {title}", "", summary, "", "## Curves", ""]
    lines += [f"![{caption}]({name})" for caption, name in figures]
    for table in tables:
        lines += ["", f"## {table.title}", ""] + ([table.note, ""] if table.note else [])
        lines.append("| " + " | ".join(table.headers) + " |")
        lines.append("|" + "---|" * len(table.headers))
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |"
                  for row in table.rows]
    return "\n".join(lines) + "\n"


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``postrl report``."""
    parser.add_argument("dirs", nargs="+", metavar="DIR", type=Path,
                        help="run directories, or directories holding them (e.g. compare output)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for report.html, report.md and the PNGs "
                             "(default: DIR/report for one DIR, ./report for several)")


def run_report(args: argparse.Namespace) -> int:
    """``postrl report``: write the report and print where it is."""
    out = args.out or (args.dirs[0] / "report" if len(args.dirs) == 1 else Path("report"))
    html_path, md_path = write_report(list(args.dirs), out)
    print(f"wrote {html_path} and {md_path}")
    return 0

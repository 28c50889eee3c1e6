"""docs/metrics.md is generated from names.py and never drifts from it."""

from pathlib import Path

from postrl.telemetry import METRICS, is_declared, render_markdown
from postrl.telemetry.docs import DOCS_PATH, areas, main

REPO = Path(__file__).resolve().parents[2]

# The metrics issue 3 asks for at minimum ("reward/<fn>/mean" as a real function name).
REQUIRED = """reward/mean reward/math_answer/mean accuracy/mean loss/total loss/per_token
loss/per_response loss/value kl/mean entropy/mean clip/low_frac clip/high_frac ratio/mean
ratio/max ratio/seq_std batch/zero_variance_frac batch/groups_kept rollout/tokens_generated
rollout/tokens_wasted length/mean length/correct_mean length/incorrect_mean
length/truncated_frac time/generate_s time/score_s time/train_s throughput/tokens_per_s
grad/norm lr""".split()


def test_docs_file_matches_the_declarations():
    assert DOCS_PATH == REPO / "docs" / "metrics.md"
    assert DOCS_PATH.read_text(encoding="utf-8") == render_markdown(), (
        "docs/metrics.md is stale: run `python -m postrl.telemetry.docs`"
    )


def test_every_metric_has_one_table_row():
    rows = [line for line in render_markdown().splitlines() if line.startswith("| ")]
    assert len(rows) == 2 + len(METRICS)  # header, separator, one per metric
    for metric in METRICS:
        assert sum(f"| `{metric.name}` |" in row for row in rows) == 1


def test_the_required_metrics_are_declared():
    assert [name for name in REQUIRED if not is_declared(name)] == []


def test_names_are_unique_and_areas_keep_declaration_order():
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    grouped = areas(METRICS)
    assert list(grouped)[:3] == ["step", "rollout", "reward"]
    assert sum(len(members) for members in grouped.values()) == len(METRICS)


def test_page_explains_naming_and_the_two_loss_views():
    page = render_markdown()
    assert "`area/what`" in page
    assert "`loss/per_token`" in page and "`loss/per_response`" in page
    assert "both\nalways logged, whichever the recipe optimises" in page


def test_main_writes_the_page(tmp_path, capsys):
    target = tmp_path / "metrics.md"
    assert main([str(target)]) == 0
    assert target.read_text(encoding="utf-8") == render_markdown()
    assert str(target) in capsys.readouterr().out

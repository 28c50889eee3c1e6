"""`report`: PNGs, an offline HTML page that references them, tables; checked in Chromium."""

import argparse
import html
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from postrl.cli import main
from postrl.errors import DataError
from postrl.experiments.plots import seed_band
from postrl.experiments.report import add_report_arguments, run_report, write_report
from postrl.telemetry import read_metrics
from tests.experiments.test_diagnose import healthy_rows, write_run

CHROMIUM = Path("/usr/bin/chromium")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory) -> Path:
    """A folder holding two real 3-step tiny runs of grpo, seeds 0 and 1."""
    root = tmp_path_factory.mktemp("compare")
    for seed in (0, 1):
        code = main(["train", "--model", "tiny", "--task", "arithmetic", "--steps", "3",
                     "--seed", str(seed), "--out", str(root / f"grpo_seed{seed}"),
                     "prompts_per_step=2", "group_size=4", "max_new_tokens=8", "eval_every=3",
                     "eval_n=2", "quiet=true"])
        assert code == 0
    return root


def synthetic_dapo_runs(root: Path, rewards=(0.1, 0.2, 0.3)) -> list[Path]:
    """Three seeds of dapo with held-out accuracy every 5 steps; last rewards as given."""
    runs = []
    for seed, last_reward in enumerate(rewards):
        rows = healthy_rows(10)
        for index, row in enumerate(rows):
            row["rollout/tokens_generated"] += 37 * seed  # seeds do not share a token grid
            if index % 5 == 4:
                row["eval/accuracy"] = 0.4 + 0.05 * index + 0.01 * seed
        rows[-1]["reward/mean"] = last_reward
        runs.append(write_run(root / f"dapo_seed{seed}", rows, "dapo", seed=seed))
    return runs


class _Page(HTMLParser):
    """Collects image sources, external references and table shapes of an HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.references: list[str] = []
        self.tables: list[list[list[str]]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs["src"])
        self.references += [attrs[k] for k in ("src", "href") if attrs.get(k)]
        if tag in ("script", "link"):
            self.references.append(f"<{tag}>")
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][-1].append("".join(self._cell or []))
            self._cell = None


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def test_report_on_real_and_synthetic_runs(real_runs, tmp_path):
    real = read_metrics(real_runs / "grpo_seed1" / "metrics.jsonl")
    assert len(real) == 1 + 3 and "eval/accuracy" in real[0] and "eval/accuracy" in real[-1]
    synthetic_dapo_runs(tmp_path / "synthetic")
    html_path, md_path = write_report([real_runs, tmp_path / "synthetic"], tmp_path / "out")
    pngs = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    assert "reward.png" in pngs and "eval_accuracy.png" in pngs and len(pngs) == 9
    for name in pngs:
        data = (tmp_path / "out" / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000
    page = _parse(html_path)
    assert sorted(page.images) == pngs
    assert all(ref.endswith(".png") and "/" not in ref for ref in page.references)  # offline
    final, per_seed, paired, cost, runs = page.tables
    assert final[0] == ["metric", "grpo (n=2)", "dapo (n=3)"]
    assert per_seed[0] == ["metric", "arm", "seed 0", "seed 1", "seed 2", "mean [95% CI]"]
    assert paired[1][:2] == ["reward/mean", "dapo - grpo"]  # seeds 0 and 1 are shared
    assert [row[0] for row in final[1:]][:2] == ["reward/mean", "accuracy/mean"]
    assert [row[0] for row in cost[1:]] == ["grpo", "dapo"]
    assert cost[0][3:5] == ["tokens generated", "tokens wasted"]
    # 3 steps x 2 prompts x 4 samples x 8 tokens, both seeds
    assert cost[1][3] == "192 (2 seeds, all equal)"
    assert len(runs) == 1 + 5
    assert write_report([real_runs / "grpo_seed0", real_runs], tmp_path / "again")  # no twice
    assert len(_parse(tmp_path / "again" / "report.html").tables[-1]) == 1 + 2
    markdown = md_path.read_text(encoding="utf-8")
    assert all(f"]({name})" in markdown for name in pngs)
    assert "| metric | grpo (n=2) | dapo (n=3) |" in markdown and "## Cost" in markdown


def test_final_metrics_show_mean_and_ci_over_seeds(tmp_path):
    runs = synthetic_dapo_runs(tmp_path / "runs", rewards=(1.0, 2.0, 3.0))
    html_path, _ = write_report(runs, tmp_path / "out")
    final = _parse(html_path).tables[0]
    reward = next(row for row in final if row[0] == "reward/mean")
    assert reward[1] == "2 [-0.484, 4.48]"  # s = 1, t(0.975, 2) = 4.303, 4.303 / sqrt(3)
    assert "eval/accuracy" in [row[0] for row in final]


def _two_recipes(root: Path, first: dict[int, float], second: dict[int, float]) -> None:
    for label, finals in (("grpo", first), ("dr_grpo", second)):
        for seed, accuracy in finals.items():
            rows = healthy_rows(4)
            rows[-1]["accuracy/mean"] = accuracy
            write_run(root / label / f"s{seed}", rows, label, seed=seed)
    runs = [{"label": label, "seed": 0} for label in ("grpo", "dr_grpo")]  # grpo first
    (root / "comparison.json").write_text(json.dumps({"command": "compare", "runs": runs}))


def test_paired_differences_match_seeds_and_keep_shares_in_range(tmp_path):
    first = {0: 0.1, 1: 0.0, 2: 0.3, 3: 0.2, 4: 0.0}
    second = {0: 0.4, 1: 0.1, 2: 0.35, 3: 0.6, 4: 0.2}
    _two_recipes(tmp_path / "runs", first, second)
    tables = _parse(write_report([tmp_path / "runs"], tmp_path / "out")[0]).tables
    paired = next(t for t in tables if t[0][0] == "metric" and "p" in t[0])
    row = next(r for r in paired if r[0] == "accuracy/mean")
    assert row[1] == "dr_grpo - grpo"
    assert row[2] == "0.3, 0.1, 0.05, 0.4, 0.2"  # seed by seed, not sorted values
    assert row[4].startswith("0.0625 (Wilcoxon")  # all five positive: the floor for 5 pairs
    per_seed = tables[1]
    grpo = next(r for r in per_seed if r[:2] == ["accuracy/mean", "grpo"])
    assert grpo[2:7] == ["0.1", "0", "0.3", "0.2", "0"]
    assert grpo[7].startswith("0.12 [0, ")  # the t-interval would go below 0


def test_ladder_output_pairs_each_rung_with_the_previous(tmp_path):
    root = tmp_path / "ladder"
    _two_recipes(root, {0: 0.1, 1: 0.2}, {0: 0.2, 1: 0.4})
    for seed, accuracy in {0: 0.5, 1: 0.5}.items():
        rows = healthy_rows(4)
        rows[-1]["accuracy/mean"] = accuracy
        write_run(root / "dapo" / f"s{seed}", rows, "dapo", seed=seed)
    runs = [{"label": label} for label in ("grpo", "dr_grpo", "dapo")]
    (root / "comparison.json").write_text(json.dumps({"command": "ladder", "runs": runs}))
    tables = _parse(write_report([root], tmp_path / "out")[0]).tables
    arms = {r[1] for r in tables[2][1:]}
    assert arms == {"dr_grpo - grpo", "dapo - dr_grpo"}


def test_seed_band_interpolates_onto_the_common_token_range():
    a = (np.array([0.0, 10.0]), np.array([0.0, 10.0]))  # y = x
    b = (np.array([2.0, 6.0, 12.0]), np.array([4.0, 8.0, 14.0]))  # y = x + 2
    grid, mean, low, high = seed_band([a, b], points=5)
    assert grid[0] == 2.0 and grid[-1] == 10.0
    np.testing.assert_allclose(mean, grid + 1)
    np.testing.assert_allclose(low, grid)
    np.testing.assert_allclose(high, grid + 2)
    assert seed_band([a]) is None and seed_band([a, (np.array([11.0, 12.0]), b[1][:2])]) is None


def test_same_name_with_different_components_is_not_averaged(tmp_path):
    write_run(tmp_path / "a", healthy_rows(3), "grpo")
    write_run(tmp_path / "b", healthy_rows(3), "grpo", name="grpo", clip_high=0.3)
    final = _parse(write_report([tmp_path], tmp_path / "out")[0]).tables[0]
    assert final[0] == ["metric", "grpo #1 (n=1)", "grpo #2 (n=1)"]


def test_errors_name_the_path(tmp_path):
    (tmp_path / "nothing").mkdir()
    with pytest.raises(DataError, match="nothing: no runs found"):
        write_report([tmp_path / "nothing"], tmp_path / "out")
    write_run(tmp_path / "halfrun", healthy_rows(2))
    (tmp_path / "halfrun" / "metrics.jsonl").unlink()
    with pytest.raises(DataError, match="halfrun/metrics.jsonl: missing"):
        write_report([tmp_path / "halfrun"], tmp_path / "out")
    write_run(tmp_path / "empty", [])
    with pytest.raises(DataError, match="empty/metrics.jsonl: empty"):
        write_report([tmp_path / "empty"], tmp_path / "out")
    with pytest.raises(DataError, match="absent: no such directory"):
        write_report([tmp_path / "absent"], tmp_path / "out")


def test_cli_writes_next_to_a_single_dir(tmp_path, capsys):
    run = write_run(tmp_path / "run", healthy_rows(4))
    parser = argparse.ArgumentParser()
    add_report_arguments(parser)
    assert run_report(parser.parse_args([str(run)])) == 0
    assert (run / "report" / "report.html").is_file()
    assert "wrote" in capsys.readouterr().out


CHECK_SCRIPT = """<img id="control" src="missing-control.png" alt="">
<script>
window.addEventListener('load', function () {
  function loaded(i) { return i.complete && i.naturalWidth > 0; }
  var report = Array.prototype.filter.call(document.images, function (i) {
    return i.id !== 'control'; });
  var result = {
    images: report.map(function (i) { return [i.getAttribute('src'), loaded(i)]; }),
    control: loaded(document.getElementById('control')),
    tables: Array.prototype.map.call(document.querySelectorAll('table'), function (t) {
      return [t.rows.length, t.getBoundingClientRect().height]; })
  };
  var pre = document.createElement('pre');
  pre.id = 'check';
  pre.textContent = JSON.stringify(result);
  document.body.appendChild(pre);
});
</script>"""


def test_report_renders_in_headless_chromium(real_runs, tmp_path):
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not found: install Debian's chromium package to run this check")
    synthetic_dapo_runs(tmp_path / "synthetic")
    html_path, _ = write_report([real_runs, tmp_path / "synthetic"], tmp_path / "out")
    check = html_path.with_name("check.html")  # next to the report, so relative paths hold
    check.write_text(html_path.read_text().replace("</body>", CHECK_SCRIPT + "</body>"))
    command = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
               check.as_uri()]
    dom = subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
    match = re.search(r'<pre id="check">(.*?)</pre>', dom, re.S)
    assert match, f"the check script did not run; DOM starts {dom[:300]!r}"
    result = json.loads(html.unescape(match.group(1)))
    assert result["control"] is False  # a missing image is detected as such
    assert len(result["images"]) == 9
    assert all(ok for _, ok in result["images"]), result["images"]
    assert len(result["tables"]) == 5
    assert all(rows > 1 and height > 0 for rows, height in result["tables"])
    shutil.rmtree(tmp_path / "profile", ignore_errors=True)

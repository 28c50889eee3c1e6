"""The `postrl recipes` and `postrl explain` commands, and the README's recipe table."""

from pathlib import Path

from postrl.cli import main
from postrl.components import markdown_table
from postrl.recipes import CORE, PRESETS


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_recipes_prints_every_core_recipe(capsys):
    code, out, _ = run(capsys, "recipes")
    assert code == 0
    for name in CORE:
        assert f"│ {name} " in out
    assert "seq_mean_token_sum_norm" in out and "reward, k1, beta=0.05" in out


def test_explain_dapo_vs_grpo_names_exactly_the_dapo_changes(capsys):
    code, out, _ = run(capsys, "explain", "dapo", "--vs", "grpo")
    assert code == 0
    headings = [line.split(":")[0] for line in out.splitlines() if line and not line[0].isspace()]
    assert headings[0] == "dapo = grpo + 5 component changes"
    assert headings[1:] == ["clip", "aggregation", "KL", "dynamic sampling", "overlong shaping"]
    assert "(clip-higher)" in out and "token-level" in out and "KL off" in out
    assert "soft overlong punishment" in out
    assert out.count("from:") == 5 and out.count("formula:") == 5
    for paper in ("Yu et al. 2025 §3.1", "§3.3", "§3.2", "eq. 13"):
        assert paper in out


def test_explain_same_recipe_has_no_difference(capsys):
    _, out, _ = run(capsys, "explain", "gspo", "--vs", "gspo")
    assert out.strip() == "gspo = gspo + 0 component changes"


def test_explain_one_recipe_lists_all_its_components(capsys):
    _, out, _ = run(capsys, "explain", "gspo")
    assert "ratio: sequence ratio (GSPO)" in out and "Zheng et al. 2025 eq. 7" in out


def test_explain_takes_arms_as_compare_and_ladder_do(capsys):
    code, out, _ = run(capsys, "explain", "grpo:kl_coef=0", "--vs", "dr_grpo")
    assert code == 0
    assert out.splitlines()[0] == "grpo+kl_coef=0 = dr_grpo + 2 component changes"
    assert "KL" not in out  # dr_grpo has no KL term, and kl_coef=0 turns grpo's off
    _, out, _ = run(capsys, "explain", "dapo:clip_high=0.3", "--vs", "dapo")
    assert out.splitlines()[0] == "dapo+clip_high=0.3 = dapo + 1 component change"
    assert "eps_high=0.28" in out and "eps_high=0.3" in out
    code, _, err = run(capsys, "explain", "grpo:lr=1e-5")
    assert code == 2 and "explain 'grpo:lr=1e-5': takes recipe options only" in err


def test_unknown_recipe_is_a_clear_error_without_traceback(capsys):
    code, out, err = run(capsys, "explain", "dapoo", "--vs", "grpo")
    assert code == 2 and out == ""
    assert err.startswith("postrl: error: unknown recipe 'dapoo' (did you mean dapo or sapo?)")
    assert "Traceback" not in err


def test_readme_recipe_table_is_the_one_the_code_prints():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert markdown_table(list(PRESETS.values())) in readme

"""Every option has one line of help, declared on its field; `postrl options`, `postrl train
--help` and docs/options.md print it, and docs/options.md never drifts from the fields."""

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import postrl.options_docs as options_docs
from postrl.cli import build_parser, main
from postrl.components import COMPONENTS
from postrl.config import LoraConfig, TeacherConfig, TrainConfig, load_config
from postrl.errors import ConfigError
from postrl.options import help_of, opt
from postrl.options_docs import (
    DOCS_PATH,
    RECIPE_PREFIX,
    TRAIN_GROUPS,
    UNGROUPED,
    format_value,
    missing_help,
    recipe_groups,
    render_markdown,
    render_text,
    train_groups,
)
from postrl.recipes import PRESETS, Recipe

REPO = Path(__file__).resolve().parents[1]


def every_option_name() -> list[str]:
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    names += [f"lora.{f.name}" for f in dataclasses.fields(LoraConfig)]
    names += [f"teacher.{f.name}" for f in dataclasses.fields(TeacherConfig)]
    return names + [RECIPE_PREFIX + f.name for f in dataclasses.fields(Recipe)]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---- the help, on the fields ---------------------------------------------------------------


def test_every_field_has_one_line_of_help():
    assert missing_help() == []
    for cls in (TrainConfig, LoraConfig, TeacherConfig, Recipe):
        for field in dataclasses.fields(cls):
            text = help_of(field)
            assert text.strip() and "\n" not in text, f"{cls.__name__}.{field.name}"


def test_a_field_without_help_is_reported_and_still_listed(monkeypatch):
    @dataclasses.dataclass
    class Extended(TrainConfig):
        new_option: int = 3  # declared without opt(...)

    monkeypatch.setattr(options_docs, "TrainConfig", Extended)
    assert missing_help() == ["new_option"]
    title, rows = train_groups()[-1]
    assert title == UNGROUPED and [o.name for o in rows] == ["new_option"]
    assert "  new_option: int = 3" in render_text()
    assert options_docs.main([]) == 1  # no page is written while an option lacks help


def test_opt_fields_keep_their_defaults_and_fresh_mutable_values():
    first, second = TrainConfig(), TrainConfig()
    assert first == second and first.stop is not second.stop and first.lora is not second.lora
    assert first.lr == 1e-6 and first.adam_betas == [0.9, 0.999] and first.lora.r == 0
    assert first.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert list(dataclasses.asdict(first)) == [f.name for f in dataclasses.fields(TrainConfig)]
    assert load_config(None, ["lr=3e-6", "lora.r=4"]).lora.r == 4
    with pytest.raises(TypeError):
        Recipe()  # a recipe still needs its name

    @dataclasses.dataclass
    class Probe:
        items: list[int] = opt(factory=list, doc="a list")
        size: int = opt(2, "a number")

    assert Probe().items is not Probe().items and Probe().size == 2
    assert [help_of(f) for f in dataclasses.fields(Probe)] == ["a list", "a number"]


CITATION = re.compile(r"([A-Z][\w&-]+)(?: et al\.)?,? (\d{4}) (eqs?\. \d+(?:-\d+)?|§\d+(?:\.\d+)*)")
SOURCES = ["postrl/components.py", "postrl/rewards/shaping.py", "docs/recipes.md",
           *sorted(str(p.relative_to(REPO)) for p in (REPO / "postrl/objectives").glob("*.py"))]


def _normalised(text: str) -> str:
    return re.sub(r"\s+", " ", text).replace("eqs. ", "eq. ")


def test_recipe_help_cites_only_equations_and_sections_the_repo_names():
    corpus = _normalised(" ".join((REPO / p).read_text(encoding="utf-8") for p in SOURCES))
    cited = [(m.group(1), m.group(2), _normalised(m.group(3)), o.name)
             for _, options in recipe_groups() for o in options
             for m in CITATION.finditer(o.help)]
    assert len(cited) > 20
    for author, year, where, option in cited:
        spots = [m.start() for m in re.finditer(re.escape(where) + r"(?![\d.])", corpus)]
        assert any(author in corpus[s - 70:s] and year in corpus[s - 70:s] for s in spots), (
            f"{option}: {author} {year} {where} is not cited so in {', '.join(SOURCES)}")


def test_clip_high_names_the_paper_explain_names():
    clip = next(c for c in COMPONENTS if c.title == "clip")
    source = clip.source(PRESETS["dapo"])
    assert "Yu et al. 2025 §3.1" in source
    assert "Yu et al. 2025 §3.1" in help_of(Recipe.__dataclass_fields__["clip_high"])


# ---- groups --------------------------------------------------------------------------------


def test_groups_follow_config_py_sections_and_field_order():
    listed = [name for _, names in TRAIN_GROUPS for name in names]
    assert listed == [f.name for f in dataclasses.fields(TrainConfig)]
    source = inspect.getsource(TrainConfig).splitlines()
    for title, names in TRAIN_GROUPS:  # each group starts where config.py has a section comment
        first = next(i for i, line in enumerate(source) if line.startswith(f"    {names[0]}:"))
        assert source[first - 1].strip().startswith("# "), (title, source[first - 1])
    assert [t for t, _ in train_groups()] == [t for t, _ in TRAIN_GROUPS]


def test_recipe_groups_are_explains_components_and_cover_every_field_once():
    groups = recipe_groups()
    assert [t for t, _ in groups] == ["the recipe", *(c.title for c in COMPONENTS)]
    names = [o.name for _, options in groups for o in options]
    assert sorted(names) == sorted(RECIPE_PREFIX + f.name for f in dataclasses.fields(Recipe))
    assert len(names) == len(set(names))


def test_recipe_defaults_are_the_presets_values():
    by_name = {o.name: o for _, opts in recipe_groups() for o in opts}
    clip_high = by_name["recipe_options.clip_high"]
    assert clip_high.default == 0.2
    assert ("dapo", 0.28) in clip_high.presets and all(v != 0.2 for _, v in clip_high.presets)
    dapo = {o.name: o.default for _, opts in recipe_groups(PRESETS["dapo"]) for o in opts}
    assert dapo["recipe_options.clip_high"] == 0.28 and dapo["recipe_options.name"] == "dapo"


def test_format_value_writes_yaml():
    assert [format_value(v) for v in (None, True, 1e-6, "grpo", "no", [0.9, 0.999], {}, "")] == [
        "null", "true", "1e-06", "grpo", "'no'", "[0.9, 0.999]", "{}", "''"]


# ---- docs/options.md -----------------------------------------------------------------------


def test_docs_file_matches_the_fields():
    assert DOCS_PATH == REPO / "docs" / "options.md"
    assert DOCS_PATH.read_text(encoding="utf-8") == render_markdown(), (
        "docs/options.md is stale: run `python -m postrl.options_docs`"
    )


def test_every_option_has_one_table_row_with_its_help():
    page = render_markdown()
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert len(rows) == len(every_option_name())
    for name in every_option_name():
        [row] = [r for r in rows if r.startswith(f"| `{name}` |")]
        assert row.count(" | ") >= 3 and not row.endswith("|  |")
    assert "| `lr` | `float` | `1e-06` | learning rate" in page
    assert "| `system_prompt` | `str \\| None` | `null` |" in page  # a pipe cannot split a cell
    assert "runs/&lt;recipe>-&lt;task>-s&lt;seed>" in page  # not swallowed as HTML tags


def test_main_writes_the_page(tmp_path, capsys):
    target = tmp_path / "options.md"
    assert options_docs.main([str(target)]) == 0
    assert target.read_text(encoding="utf-8") == render_markdown()
    assert str(target) in capsys.readouterr().out


# ---- postrl options and postrl train --help ------------------------------------------------


def test_options_command_prints_every_option_with_type_default_and_help(capsys):
    code, out, _ = run(capsys, "options")
    assert code == 0
    for name in every_option_name():
        assert re.search(rf"^  {re.escape(name)}: ", out, re.M), name
    assert "  lr: float = 1e-06\n      learning rate of the policy's AdamW optimizer\n" in out
    assert "  resume: str = 'no'\n" in out and "  out: str | None = null\n" in out
    titles = [t for t, _ in TRAIN_GROUPS] + [c.title for c in COMPONENTS]
    positions = [out.index(f"\n\n{t}\n") for t in titles]
    assert positions == sorted(positions)
    assert "  recipe_options.kl_coef: float = 0.04\n" in out  # grpo's, the default recipe


def test_options_command_filters_by_name_and_shows_a_recipes_values(capsys):
    code, out, _ = run(capsys, "options", "clip_high", "--recipe", "dapo")
    assert code == 0
    assert re.findall(r"^  (\S+):", out, re.M) == ["recipe_options.clip_high",
                                                  "recipe_options.seq_clip_high"]
    assert "  recipe_options.clip_high: float = 0.28\n" in out and "Yu et al. 2025 §3.1" in out
    _, out, _ = run(capsys, "options", "lora")
    assert re.findall(r"^  (\S+):", out, re.M) == [
        "lora", "lora.r", "lora.alpha", "lora.dropout", "lora.target_modules"]


def test_options_command_errors_name_the_problem(capsys):
    code, out, err = run(capsys, "options", "clip_hihg")
    assert code == 2 and out == ""
    assert err.startswith("postrl: error: no option's name contains 'clip_hihg' (did you mean")
    code, _, err = run(capsys, "options", "--recipe", "dapoo")
    assert code == 2 and "unknown recipe 'dapoo'" in err


def test_train_help_lists_the_options_after_its_flags(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.index("--config CONFIG") < out.index("  lr: float = 1e-06")
    assert "  recipe_options.clip_high: float = 0.2\n" in out
    args = build_parser().parse_args(["train", "--steps", "3", "lr=1e-5", "lora.r=4"])
    assert args.steps == "3" and args.overrides == ["lr=1e-5", "lora.r=4"]


def test_make_docs_rewrites_a_stale_readme_recipe_table_and_nothing_else(tmp_path, capsys):
    from postrl.components import markdown_table

    table = markdown_table(list(PRESETS.values())).split("\n")
    stale = "\n".join(["# Title", "", *table[:3], "| gone | row |", "", "After.", "| other |"])
    readme = tmp_path / "README.md"
    readme.write_text(stale)
    assert options_docs.main([str(tmp_path / "options.md"), "--readme", str(readme)]) == 0
    assert readme.read_text() == "\n".join(["# Title", "", *table, "", "After.", "| other |"])
    readme.write_text("no table here")
    with pytest.raises(ConfigError, match="no recipe table"):
        options_docs.write_readme_recipes(readme)
    assert options_docs.main(["--readme"]) == 2
    assert "--readme needs the README's path" in capsys.readouterr().err

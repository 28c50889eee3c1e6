"""``postrl ladder``: one component at a time from FROM to TO, then run like compare."""

import argparse

import pytest

from postrl.components import differing
from postrl.errors import ConfigError
from postrl.experiments.compare import plan_runs
from postrl.experiments.ladder import (
    add_ladder_arguments,
    build_ladder,
    ladder_rungs,
    run_ladder,
    rung_spec,
)
from postrl.recipes import PRESETS, get_recipe


def test_ladder_grpo_to_dapo_changes_one_component_per_rung_in_dapos_ablation_order():
    ladder = build_ladder("grpo", "dapo")
    assert [r.name for r in ladder] == [
        "grpo", "grpo+kl", "grpo+kl+clip", "grpo+kl+clip+overlong_shaping",
        "grpo+kl+clip+overlong_shaping+aggregation", "dapo"]
    for previous, rung in zip(ladder, ladder[1:], strict=False):
        assert len(differing(previous, rung)) == 1
    assert ladder[0] == get_recipe("grpo")
    assert differing(ladder[-1], get_recipe("dapo")) == []
    changed = [differing(a, b)[0].title for a, b in zip(ladder, ladder[1:], strict=False)]
    assert changed == ["KL", "clip", "overlong shaping", "aggregation", "dynamic sampling"]


def test_order_overrides_the_default_and_bad_titles_are_refused():
    ladder = build_ladder("grpo", "dapo", ["aggregation", "clip"])
    changed = [differing(a, b)[0].title for a, b in zip(ladder, ladder[1:], strict=False)]
    assert changed == ["aggregation", "clip", "KL", "overlong shaping", "dynamic sampling"]
    with pytest.raises(ConfigError, match="unknown component 'clipping'"):
        build_ladder("grpo", "dapo", ["clipping"])
    with pytest.raises(ConfigError, match="'ratio' is the same in grpo and dapo"):
        build_ladder("grpo", "dapo", ["ratio"])


@pytest.mark.parametrize("start", sorted(PRESETS))
@pytest.mark.parametrize("end", ["grpo", "dapo", "gspo", "dhpo", "ppo"])
def test_every_ladder_ends_at_its_target_through_valid_recipes(start, end):
    rungs = ladder_rungs(start, end)
    assert differing(rungs[-1].recipe, get_recipe(end)) == []
    assert rungs[-1].recipe.name == end or start == end
    for previous, rung in zip(rungs, rungs[1:], strict=False):
        assert differing(previous.recipe, rung.recipe)  # every rung changes something
        # more than one component changes only when coupled (GAE needs the critic; a new ratio
        # unit brings its own clip ranges)
        assert len(rung.changed) == 1 or set(rung.changed) & {"critic", "ratio", "advantage"}


def test_rungs_become_run_configs_with_the_same_components(tmp_path):
    ladder = build_ladder(get_recipe("grpo").with_(overlong_buffer=4),
                          get_recipe("dapo").with_(overlong_buffer=4))
    specs = [rung_spec(r, "grpo") for r in ladder]
    planned = plan_runs(specs, None, ["model=tiny", "max_new_tokens=8"], 1, None, tmp_path)
    for rung, run in zip(ladder, planned, strict=True):
        assert run.config.recipe == "grpo" and run.config.out.endswith(f"{rung.name}/s0")
        assert differing(run.config.build_recipe(), rung) == []
        assert run.config.resolved()["resolved_recipe"]["name"] == rung.name  # for the report


def test_ladder_command_prints_the_rungs_and_plans_them(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_ladder_arguments(parser)
    args = parser.parse_args(["grpo", "dapo", "--dry-run", "--seeds", "1", "--out",
                              str(tmp_path), "model=tiny", "max_new_tokens=8",
                              "recipe_options.overlong_buffer=4"])
    assert run_ladder(args) == 0
    printed = capsys.readouterr().out
    assert "ladder grpo -> dapo: 5 steps" in printed
    assert "grpo+kl+clip  " in printed and "clip-higher" in printed
    assert "warning: grpo+kl, grpo+kl+clip differ only in clip" in printed  # on-policy
    assert not any(tmp_path.iterdir())

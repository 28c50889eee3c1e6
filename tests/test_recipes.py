"""Recipes are validated data; presets match docs/algorithms.md §7."""

import dataclasses
import re
from pathlib import Path

import pytest

from postrl.components import COMPONENTS, differing
from postrl.errors import ConfigError
from postrl.recipes import CORE, PRESETS, Recipe, get_recipe


def test_presets_match_the_algorithms_table():
    ppo, grpo, dr, dapo, gspo, dhpo = (get_recipe(n) for n in CORE)
    assert (ppo.advantage, ppo.critic, ppo.ratio, ppo.aggregation) == ("gae", True, "token",
                                                                      "token_mean")
    assert (ppo.kl_placement, ppo.kl_estimator, ppo.kl_coef) == ("reward", "k1", 0.05)
    assert (grpo.advantage, grpo.adv_scale, grpo.aggregation) == ("group", "group",
                                                                  "seq_mean_token_mean")
    assert (grpo.kl_placement, grpo.kl_estimator, grpo.kl_coef) == ("loss", "k3", 0.04)
    assert (dr.adv_scale, dr.aggregation, dr.needs_reference) == ("none",
                                                                  "seq_mean_token_sum_norm", False)
    assert (dapo.clip_low, dapo.clip_high, dapo.aggregation) == (0.2, 0.28, "token_mean")
    assert dapo.dynamic_sampling and dapo.overlong_penalty and not dapo.needs_reference
    assert (gspo.ratio, gspo.clip_low, gspo.clip_high) == ("sequence", 3e-4, 4e-4)
    assert (dhpo.ratio, dhpo.hybrid_mixing, dhpo.clip_low, dhpo.clip_high) == (
        "hybrid", "averaged", 0.2, 0.28)
    assert (dhpo.seq_clip_low, dhpo.seq_clip_high, dhpo.aggregation) == (
        3e-4, 4e-4, "seq_mean_token_mean")
    for recipe in (ppo, grpo, dr, dapo, gspo, dhpo):
        assert recipe.clip_low == recipe.clip_low and recipe.dual_clip is None


def test_loss_config_resolves_the_constant_and_kl_placement():
    assert get_recipe("dr_grpo").policy_loss_config(max_new_tokens=64).norm_constant == 64
    assert get_recipe("grpo").policy_loss_config(64).kl_coef == 0.04
    assert get_recipe("ppo").policy_loss_config(64).kl_coef == 0.0  # KL lives in the reward


def test_with_overrides_and_names_the_change():
    recipe = get_recipe("dapo").with_(clip_high=0.3)
    assert recipe.clip_high == 0.3 and recipe.name == "dapo(clip_high=0.3)"
    assert get_recipe("dapo").clip_high == 0.28  # presets are frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.clip_high = 0.5  # type: ignore[misc]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"advantage": "gae"}, "advantage='gae' needs a learned value function"),
        ({"critic": True}, "critic=true is only used by advantage='gae'"),
        ({"clip_low": -0.1}, "clip ranges must be >= 0: clip_low=-0.1"),
        ({"clip_low": 1.0}, "lower ratio bound"),
        ({"dual_clip": 1.0}, "dual_clip c must be > 1"),
        ({"dual_clip": 0.5}, "dual_clip c must be > 1"),
        ({"hybrid_mixing": "entropy"}, "only applies to ratio='hybrid'"),
        ({"ratio": "seq"}, "ratio='seq' is not one of token, sequence"),
        ({"aggregation": "mean"}, "aggregation='mean' is not one of"),
        ({"kl_placement": "reward", "kl_coef": 0.1}, "kl_placement='reward' needs token rewards"),
        ({"kl_coef": -1.0}, "kl_coef must be >= 0"),
        ({"clip_hihg": 0.3}, "no option 'clip_hihg' (did you mean 'clip_high'?)"),
        ({"clip_high": "0.3"}, "'clip_high' must be float, got '0.3'"),
        ({"dynamic_sampling": 1}, "'dynamic_sampling' must be bool"),
        ({"lam": 1.5}, "lam must be in [0, 1]"),
        ({"ratio": "geometric", "dual_clip": 3.0}, "dual_clip applies to PPO-clipped"),
    ],
)
def test_impossible_overrides_are_named(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        get_recipe("grpo").with_(**overrides)


def test_schedule_checks():
    with pytest.raises(ConfigError, match=re.escape("advantage='group'") + ".*group_size >= 2"):
        get_recipe("grpo").check_schedule(group_size=1, max_new_tokens=64)
    with pytest.raises(ConfigError, match="dynamic_sampling.*got 1"):
        get_recipe("ppo").with_(dynamic_sampling=True).check_schedule(1, 64)
    with pytest.raises(ConfigError, match="overlong_buffer must be in"):
        get_recipe("dapo").check_schedule(group_size=8, max_new_tokens=16)
    get_recipe("ppo").check_schedule(group_size=1, max_new_tokens=64)  # a critic needs no group
    get_recipe("dapo").check_schedule(group_size=8, max_new_tokens=64)


def test_unknown_recipe_suggests_close_names():
    with pytest.raises(ConfigError, match="did you mean grpo"):
        get_recipe("grop")


def test_every_recipe_field_belongs_to_exactly_one_component():
    owned = [name for component in COMPONENTS for name in component.fields]
    assert len(owned) == len(set(owned))
    assert set(owned) == {f.name for f in dataclasses.fields(Recipe)} - {"name"}


def test_each_field_change_shows_up_in_its_component():
    """Changing any relevant field makes exactly its component differ."""
    base = get_recipe("grpo").with_(ratio="hybrid", dynamic_sampling=True, overlong_penalty=True,
                                    aggregation="seq_mean_token_sum_norm", norm_constant=10.0)
    changes = {"adv_scale": "batch", "adv_std": "population", "adv_eps": 1e-3,
               "hybrid_mixing": "entropy", "clip_low": 0.1, "clip_high": 0.3,
               "seq_clip_low": 1e-3, "seq_clip_high": 1e-3, "dual_clip": 3.0,
               "norm_constant": 5.0, "kl_estimator": "k2", "kl_coef": 0.1, "entropy_coef": 0.01,
               "max_sampling_rounds": 5, "overlong_filter": True, "overlong_buffer": 8,
               "overlong_penalty_factor": 0.5, "kl_placement": "none"}
    owner = {name: c.title for c in COMPONENTS for name in c.fields}
    for key, value in changes.items():
        assert [c.title for c in differing(base, base.with_(**{key: value}))] == [owner[key]], key


def test_no_code_branches_on_a_recipe_name():
    names = "|".join(PRESETS)
    quoted = rf"""["']({names})["']"""
    pattern = re.compile(rf"name\s*[!=]=\s*{quoted}|{quoted}\s*[!=]=\s*\w*name")
    package = Path(__file__).resolve().parents[1] / "postrl"
    offenders = [str(p) for p in package.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []

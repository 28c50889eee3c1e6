"""TrainConfig: YAML and key=value overrides, with errors that say where."""

import re

import pytest

from postrl.config import load_config
from postrl.errors import ConfigError


def test_defaults_and_overrides():
    cfg = load_config(None, ["recipe=dapo", "recipe_options.clip_high=0.3", "lora.r=8",
                             "lr=1e-5", "report_to=tensorboard", "stop=[\"\\n\"]"])
    recipe = cfg.build_recipe()
    assert recipe.clip_high == 0.3 and recipe.name == "dapo(clip_high=0.3)"
    assert cfg.lora.r == 8 and cfg.lr == 1e-5 and cfg.report_to == ["tensorboard"]
    assert cfg.stop == ["\n"] and cfg.updates_per_batch == 1
    resolved = cfg.resolved()
    assert resolved["resolved_recipe"]["clip_high"] == 0.3
    assert resolved["resolved_recipe"]["dynamic_sampling"] is True


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("recipe: gspo\nsteps: 5\nlr: 1e-6\nlora:\n  r: 4\n")
    cfg = load_config(path, ["steps=7"])
    assert (cfg.recipe, cfg.steps, cfg.lr, cfg.lora.r) == ("gspo", 7, 1e-6, 4)


@pytest.mark.parametrize("text, message", [
    ("steps: 0\n", "run.yaml:1: steps must be > 0"),
    ("recipe: grpo\nlr: -1\n", "run.yaml:2: lr must be > 0"),
    ("recipe: grpo\nstpes: 3\n", "run.yaml:2: unknown option 'stpes' (did you mean 'steps'?)"),
    ("lora:\n  r: 4\n  alhpa: 3\n", "run.yaml:3: unknown option 'lora.alhpa'"),
    ("recipe: grpo\ngroup_size: 8.5\n", "run.yaml:2: group_size must be int"),
    ("recipe: dapoo\n", "run.yaml:1: unknown recipe 'dapoo'"),
    ("recipe_options:\n  clip_low: -0.2\n", "run.yaml:1: clip ranges must be >= 0"),
    ("- a\n- b\n", "the top level must be a mapping"),
    ("0\n", "the top level must be a mapping"),  # a falsy scalar, not an empty file
    ("false\n", "the top level must be a mapping"),
    ("steps: [\n", "invalid YAML"),
])
def test_yaml_errors_name_file_and_line(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(path)


@pytest.mark.parametrize("override, message", [
    ("steps=abc", "override steps=abc: steps must be int"),
    ("temperature=0", "temperature > 0"),
    ("group_size=1", "group_size >= 2"),
    ("minibatches=99", "minibatches=99 exceeds the 32 responses"),
    ("lr_schedule=step", "lr_schedule='step' is not one of constant, linear, cosine"),
    ("noequals", "'noequals' is not key=value"),
    ("precision=fp16", "precision must be one of fp32, bf16, bf16-master, got 'fp16'"),
])
def test_override_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_exponent_floats_without_a_dot_are_floats(tmp_path):
    """YAML 1.1 would read 1e-6 as a string; postrl reads it as the number a user means."""
    path = tmp_path / "run.yaml"
    path.write_text("lr: 1e-6\nrecipe: dapo\nrecipe_options: {clip_high: 3e-1}\n")
    cfg = load_config(path, ["critic_lr=2E-5", "recipe_options.clip_low=1e-1"])
    assert (cfg.lr, cfg.critic_lr) == (1e-6, 2e-5)
    assert (cfg.build_recipe().clip_high, cfg.build_recipe().clip_low) == (0.3, 0.1)
    assert load_config(None, ["system_prompt=1e-3x"]).system_prompt == "1e-3x"


def test_paths_in_a_config_file_are_relative_to_its_folder(tmp_path, monkeypatch):
    from postrl.config_paths import TASK_FILE_KINDS
    from postrl.tasks.registry import FILE_KINDS

    assert set(TASK_FILE_KINDS) == set(FILE_KINDS)
    folder = tmp_path / "project" / "configs"
    folder.mkdir(parents=True)
    (folder / "model").mkdir()
    (folder / "saved").mkdir()
    (folder / "c.yaml").write_text(
        "task: jsonl:../data/train.jsonl\n"
        "task_options: {test_path: data/test.jsonl}\n"
        "rewards: [rw.py:fn, {fn: sub/rw2.py:g, weight: 2}, math_answer, pkg.mod:fn,\n"
        "          reward_model:rm, reward_model:/abs/rm]\n"
        "out: ../runs/x\nmodel: model\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(folder / "c.yaml")
    assert cfg.task == f"jsonl:{tmp_path / 'project' / 'data' / 'train.jsonl'}"
    assert cfg.task_options["test_path"] == str(folder / "data" / "test.jsonl")
    assert cfg.rewards == [f"{folder / 'rw.py'}:fn", {"fn": f"{folder / 'sub' / 'rw2.py'}:g",
                                                       "weight": 2}, "math_answer", "pkg.mod:fn",
                           f"reward_model:{folder / 'rm'}", "reward_model:/abs/rm"]
    assert cfg.out == str(tmp_path / "project" / "runs" / "x")
    assert cfg.model == str(folder / "model")
    # names that are not paths stay; overrides are relative to the current directory
    (folder / "d.yaml").write_text("task: saved\nmodel: tiny\nout: /abs/run\n")
    assert load_config(folder / "d.yaml").task == str(folder / "saved")
    assert load_config(folder / "d.yaml").model == "tiny"
    assert load_config(folder / "d.yaml").out == "/abs/run"
    assert load_config(folder / "c.yaml", ["out=runs/y"]).out == "runs/y"
    (folder / "e.yaml").write_text("task: arithmetic\nmodel: HuggingFaceTB/SmolLM2-135M\n")
    assert load_config(folder / "e.yaml").model == "HuggingFaceTB/SmolLM2-135M"


def test_yes_no_on_off_are_strings_as_in_yaml_1_2(tmp_path):
    """YAML 1.1 read ``resume=no`` as False, and the run was refused; true and false alone
    are booleans."""
    assert load_config(None, ["resume=no"]).resume == "no"
    config = tmp_path / "c.yaml"
    config.write_text("resume: no\nquiet: true\nstop: [yes, off]\n")
    cfg = load_config(config)
    assert (cfg.resume, cfg.quiet, cfg.stop) == ("no", True, ["yes", "off"])
    with pytest.raises(ConfigError, match=r"quiet must be bool, got 'yes' \(write true or false\)"):
        load_config(None, ["quiet=yes"])


def test_a_runs_config_yaml_reloads_as_the_same_run(tmp_path):
    """``postrl train --config RUN/config.yaml`` reruns the run: the recorded components
    (resolved_recipe) are checked against recipe and recipe_options, not refused as unknown."""
    import yaml

    cfg = load_config(None, ["recipe=dapo", "recipe_options.clip_high=0.3", "model=tiny"])
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(cfg.resolved(), sort_keys=False))
    assert load_config(saved).resolved() == cfg.resolved()
    assert load_config(saved, ["recipe=grpo"]).build_recipe().name == "grpo(clip_high=0.3)"
    text = saved.read_text()
    at = text.rindex("clip_high: 0.3")  # the record's, below recipe_options
    edited = text[:at] + "clip_high: 0.25" + text[at + len("clip_high: 0.3"):]
    saved.write_text(edited)
    line = edited.splitlines().index("resolved_recipe:") + 1
    with pytest.raises(ConfigError, match=rf"config.yaml:{line}: resolved_recipe.clip_high is "
                                          r"0.25, but recipe='dapo' .* gives 0.3"):
        load_config(saved)

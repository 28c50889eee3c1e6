"""Property-based fuzzing: the config parser and the answer extractor raise nothing but their
documented errors, and never hang, whatever they are fed."""

import string

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from postrl.config import load_config
from postrl.errors import ConfigError
from postrl.rewards import extract_answer, math_answer

KEYS = ["steps", "lr", "recipe", "group_size", "lora.r", "recipe_options.clip_high", "stop",
        "temperature", "task_options.digits", "rewards", "max_grad_norm", "report_to", "nope",
        "lora", "recipe_options", "adam_betas", "token_budget", "resume", ""]
VALUES = st.one_of(st.text(max_size=12), st.integers(-10, 10).map(str),
                   st.floats(allow_nan=True).map(str),
                   st.sampled_from(["[1, 2]", "{a: 1}", "null", "true", "1e-3", "[", "'", ":"]))


@settings(max_examples=300, deadline=2000)
@given(st.lists(st.tuples(st.sampled_from(KEYS), VALUES), max_size=4))
def test_config_overrides_raise_only_config_errors(pairs):
    try:
        load_config(None, [f"{k}={v}" for k, v in pairs])
    except ConfigError:
        pass


YAML_PIECES = st.sampled_from(["steps: 3\n", "lr: -1\n", "lora:\n  r: x\n", "- a\n", "[\n",
                               "recipe_options: 7\n", "recipe: dapo\n", ":\n", "a: {b: [\n",
                               "group_size: 1.5\n", "\t\n", "steps: !!python/name:os.system\n"])


@settings(max_examples=200, deadline=2000,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(YAML_PIECES, max_size=5), st.text(max_size=30))
def test_config_files_raise_only_config_errors(tmp_path, pieces, noise):
    path = tmp_path / "fuzz.yaml"
    path.write_text("".join(pieces) + noise)
    try:
        load_config(path)
    except ConfigError:
        pass


TEXT = st.text(alphabet=string.printable + "\\{}$∞½−×÷", max_size=400)


@settings(max_examples=500, deadline=1000)
@given(TEXT)
def test_answer_extractor_never_raises_or_hangs(text):
    answer = extract_answer(text)
    assert answer is None or isinstance(answer, str)


@settings(max_examples=200, deadline=3000)
@given(TEXT, st.one_of(st.integers(-1000, 1000).map(str), TEXT))
def test_math_answer_reward_is_zero_or_one(completion, gold):
    (value,) = math_answer(["q"], [completion], answer=[gold])
    assert value in (0.0, 1.0, None)

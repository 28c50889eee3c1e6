"""``load_task``: each spec form, and clear errors for unknown specs and options."""

import json

import pytest

from postrl.errors import ConfigError
from postrl.tasks import ArithmeticTask, CountdownTask, load_task


def write_gsm8k(path, count):
    lines = (json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) for i in range(count))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_built_in_tasks_with_options():
    task = load_task("arithmetic", operators="+-", seed=3)
    assert isinstance(task, ArithmeticTask) and task.operators == ("+", "-") and task.seed == 3
    assert task.name == "arithmetic" and task.default_rewards == ("math_answer",)
    countdown = load_task("countdown", num_problems=100)
    assert isinstance(countdown, CountdownTask) and countdown.default_rewards == ("countdown",)


def test_file_specs(tmp_path):
    write_gsm8k(tmp_path / "train.jsonl", 30)
    write_gsm8k(tmp_path / "test.jsonl", 4)
    gsm8k = load_task(f"gsm8k:{tmp_path / 'train.jsonl'}")
    assert gsm8k.name == "gsm8k" and len(gsm8k.test()) == 4
    assert gsm8k.test()[0].columns["answer"] == "0"
    jsonl = load_task(f"jsonl:{tmp_path / 'train.jsonl'}", answer_field=None)
    assert jsonl.name == "jsonl" and jsonl.test()[0].columns["answer"] == "#### 0"


def test_saved_dataset_directory_spec(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(50)]
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "saved")
    task = load_task(str(tmp_path / "saved"), test_fraction=0.3)
    assert task.name == "dataset" and len(task.train()) + len(task.test()) == 50


@pytest.mark.parametrize("spec", ["arithmetc", "gsm8k", "csv:data.csv", "", "/no/such/dir"])
def test_unknown_spec_lists_the_valid_forms(spec):
    with pytest.raises(ConfigError) as error:
        load_task(spec)
    message = str(error.value)
    assert f"unknown task '{spec}'" in message
    for form in ("arithmetic", "countdown", "gsm8k:PATH", "jsonl:PATH", "parquet:PATH", "DIR"):
        assert form in message


def test_empty_path_and_unknown_option():
    with pytest.raises(ConfigError, match="a path is needed after 'parquet:'"):
        load_task("parquet:")
    with pytest.raises(ConfigError, match="task option 'digit' does not apply to task 'arith"):
        load_task("arithmetic", digit=2)
    with pytest.raises(ConfigError, match="option 'prompt_field' does not apply.*test_path"):
        load_task("gsm8k:x.jsonl", prompt_field="q")

"""File-backed tasks: the real GSM8K files, small hand-written files, and their errors."""

import json
from pathlib import Path

import pytest

from postrl.errors import ConfigError, DataError
from postrl.tasks.files import load_gsm8k, load_saved_dataset, load_table, parse_gsm8k_answer

GSM8K_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def gsm8k_record(question, number):
    return {"question": question, "answer": f"Work it out.\n#### {number}"}


@pytest.fixture(scope="module")
def real_gsm8k():
    if not (GSM8K_DIR / "train.jsonl").is_file():
        pytest.skip(f"GSM8K data not found at {GSM8K_DIR}")
    return load_gsm8k(GSM8K_DIR / "train.jsonl")


def test_real_gsm8k_sizes_and_first_test_answer(real_gsm8k):
    assert len(real_gsm8k.train()) == 7473 and len(real_gsm8k.test()) == 1319
    first = real_gsm8k.test()[0]
    assert first.columns["answer"] == "18"
    assert first.question.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert first.id == f"{GSM8K_DIR / 'test.jsonl'}:1"
    assert first.columns["solution"].endswith("#### 18")
    assert real_gsm8k.default_rewards == ("math_answer",)


def test_real_gsm8k_answers_are_plain_numbers(real_gsm8k):
    for ex in (*real_gsm8k.train(), *real_gsm8k.test()):
        answer = ex.columns["answer"]
        assert "," not in answer and float(answer) == float(answer.strip())


def test_real_gsm8k_folder_form_is_the_same(real_gsm8k):
    task = load_gsm8k(GSM8K_DIR)
    assert task.test() == real_gsm8k.test() and task.train() == real_gsm8k.train()


def test_gsm8k_answer_by_hand():
    assert parse_gsm8k_answer("2 + 3 = 5\n#### 1,234", "f:1") == "1234"
    assert parse_gsm8k_answer("#### -7", "f:1") == "-7"
    with pytest.raises(DataError, match="f:3: field 'answer' must end with '#### <number>'"):
        parse_gsm8k_answer("no marker", "f:3")


def test_sibling_explicit_and_held_out_test_splits(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [gsm8k_record(f"q{i}", i) for i in range(5)])
    write_jsonl(tmp_path / "test.jsonl", [gsm8k_record("t0", "1,000")])
    write_jsonl(tmp_path / "other.jsonl", [gsm8k_record("o0", 7), gsm8k_record("o1", 8)])
    sibling = load_gsm8k(tmp_path / "train.jsonl")
    assert [ex.columns["answer"] for ex in sibling.test()] == ["1000"]
    explicit = load_gsm8k(tmp_path / "train.jsonl", test_path=tmp_path / "other.jsonl")
    assert [ex.question for ex in explicit.test()] == ["o0", "o1"]
    many = write_jsonl(tmp_path / "all.jsonl", [gsm8k_record(f"q{i}", i) for i in range(200)])
    held = load_gsm8k(many, test_fraction=0.2)
    train_q, test_q = {ex.question for ex in held.train()}, {ex.question for ex in held.test()}
    assert not train_q & test_q and len(train_q | test_q) == 200
    assert 20 <= len(test_q) <= 60
    assert load_gsm8k(many, test_fraction=0.2).test() == held.test()


def test_train_is_shuffled_by_seed(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [gsm8k_record(f"q{i}", i) for i in range(50)])
    write_jsonl(tmp_path / "test.jsonl", [gsm8k_record("t", 1)])
    first, second = load_gsm8k(path, seed=0), load_gsm8k(path, seed=1)
    assert first.train() == load_gsm8k(path, seed=0).train()
    assert first.train() != second.train()
    assert sorted(ex.id for ex in first.train()) == sorted(ex.id for ex in second.train())


def test_malformed_files_name_file_and_line(tmp_path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"question": "a", "answer": "#### 1"}\n{"question": \n')
    with pytest.raises(DataError, match=f"{bad_json}:2: invalid JSON"):
        load_gsm8k(bad_json)
    missing = write_jsonl(tmp_path / "missing.jsonl", [gsm8k_record("a", 1), {"answer": "#### 2"}])
    with pytest.raises(DataError, match=f"{missing}:2: missing field 'question'"):
        load_gsm8k(missing)
    no_marker = write_jsonl(tmp_path / "marker.jsonl", [{"question": "a", "answer": "5"}])
    with pytest.raises(DataError, match=f"{no_marker}:1: field 'answer'"):
        load_gsm8k(no_marker)
    not_object = tmp_path / "list.jsonl"
    not_object.write_text("\n[1, 2]\n")
    with pytest.raises(DataError, match=f"{not_object}:2: expected a JSON object"):
        load_gsm8k(not_object)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match=f"{tmp_path / 'nope.jsonl'}: no such file"):
        load_gsm8k(tmp_path / "nope.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match=f"{empty}: no examples"):
        load_table("jsonl", empty)
    single = write_jsonl(tmp_path / "one.jsonl", [gsm8k_record("only", 1)])
    with pytest.raises(ConfigError, match="test_fraction"):
        load_gsm8k(single)


def test_generic_jsonl_fields_and_columns(tmp_path):
    rows = [{"prompt": f"p{i}", "answer": i, "level": "easy"} for i in range(40)]
    path = write_jsonl(tmp_path / "data_train.jsonl", rows)
    write_jsonl(tmp_path / "data_test.jsonl", [{"prompt": "t", "answer": 2.5, "level": "hard"}])
    task = load_table("jsonl", path)
    assert task.test()[0].question == "t"
    assert task.test()[0].columns == {"answer": "2.5", "level": "hard"}
    assert task.default_rewards == ("math_answer",)
    custom = load_table("jsonl", path, prompt_field="level", answer_field="prompt")
    assert custom.test()[0].question == "hard"
    assert custom.test()[0].columns == {"answer": "t", "prompt": "t"}
    no_answer = load_table("jsonl", path, answer_field=None)
    # without an answer field nothing is parsed: an "answer" field passes through untouched
    assert no_answer.test()[0].columns == {"answer": 2.5, "level": "hard"}
    assert no_answer.default_rewards == ()
    with pytest.raises(DataError, match=f"{path}:1: missing field 'query'"):
        load_table("jsonl", path, prompt_field="query")


def test_parquet(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet

    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(60)]
    path = tmp_path / "rows.parquet"
    parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    task = load_table("parquet", path, test_fraction=0.25)
    examples = sorted((*task.train(), *task.test()), key=lambda ex: int(ex.columns["answer"]))
    assert [ex.question for ex in examples] == [f"q{i}" for i in range(60)]
    assert examples[0].id == f"{path}:row 1"
    with pytest.raises(DataError, match=f"{path}:row 1: missing field 'solution'"):
        load_table("parquet", path, answer_field="solution")
    broken = tmp_path / "broken.parquet"
    broken.write_text("not parquet")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        load_table("parquet", broken)


def test_saved_datasets_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    train = datasets.Dataset.from_list([{"question": f"q{i}", "answer": str(i)} for i in range(8)])
    test = datasets.Dataset.from_list([{"question": "t", "answer": "9"}])
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(tmp_path / "dict")
    task = load_saved_dataset(tmp_path / "dict")
    assert len(task.train()) == 8 and task.test()[0].columns == {"answer": "9"}
    assert task.test()[0].id == f"{tmp_path / 'dict'}[test]:row 1"
    single = datasets.Dataset.from_list([{"prompt": f"p{i}", "answer": "1"} for i in range(100)])
    single.save_to_disk(tmp_path / "single")
    held = load_saved_dataset(tmp_path / "single")
    assert len(held.train()) + len(held.test()) == 100 and held.test()
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="not a dataset saved with save_to_disk"):
        load_saved_dataset(tmp_path / "plain")


def test_a_byte_order_mark_at_the_start_of_a_jsonl_file_is_skipped(tmp_path):
    path = tmp_path / "train.jsonl"
    lines = [json.dumps(gsm8k_record(f"q{i}", i)) for i in range(20)]
    path.write_bytes("\n".join(lines).encode("utf-8-sig"))
    task = load_gsm8k(path, test_fraction=0.2)
    assert sorted(ex.question for ex in [*task.train(), *task.test()]) == sorted(
        f"q{i}" for i in range(20))
    path.write_bytes(b"\n".join([lines[0].encode(), b"\xef\xbb\xbf" + lines[1].encode()]))
    with pytest.raises(DataError, match="train.jsonl:2: invalid JSON"):  # only at the start
        load_gsm8k(path)

"""`postrl train` and `postrl eval` from the command line, on the tiny model."""

import json

from postrl.cli import main


def test_train_with_flags_then_eval_the_run(tmp_path, capsys):
    out = tmp_path / "x"
    code = main(["train", "--recipe", "dapo", "--model", "tiny", "--task", "arithmetic",
                 "--steps", "3", "--out", str(out), "prompts_per_step=2", "group_size=4",
                 "max_new_tokens=8", "recipe_options.overlong_buffer=4", "quiet=true"])
    assert code == 0
    assert "saved" in capsys.readouterr().out
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    code = main(["eval", "--model", str(out), "--task", "arithmetic", "--n", "2", "--k", "1,2",
                 "--max-new-tokens", "4", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["n_problems"] == 2 and set(result["pass_at_k"]) == {"1", "2"}


def test_bad_option_is_reported_without_traceback(tmp_path, capsys):
    code = main(["train", "--model", "tiny", "--out", str(tmp_path / "y"), "lr=-1"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("postrl: error: override lr=-1: lr must be > 0")
    assert "Traceback" not in err


def test_a_finished_run_is_not_overwritten(tmp_path, capsys):
    args = ["train", "--model", "tiny", "--out", str(tmp_path / "z"), "--steps", "1",
            "prompts_per_step=1", "group_size=2", "max_new_tokens=4", "quiet=true"]
    assert main(args) == 0
    assert main(args) == 2
    assert "overwrite" in capsys.readouterr().err

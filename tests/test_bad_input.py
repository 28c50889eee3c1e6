"""A corpus of malformed inputs: every one exits non-zero with a one-paragraph message naming
the culprit, prints no traceback, and leaves an earlier run's files untouched."""

import hashlib
import json
from pathlib import Path

import pytest

from postrl.cli import main

TINY = ["--model", "tiny", "prompts_per_step=1", "group_size=2", "max_new_tokens=4",
        "quiet=true", "--steps", "1"]


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("earlier") / "run"
    assert main(["train", *TINY, "--out", str(run)]) == 0
    return run


def snapshot(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


def write(path: Path, content: str | bytes) -> str:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return str(path)


REWARD_FILE = '''
import math
def raises(prompts, completions, **kw): raise ZeroDivisionError("oops")
def short(prompts, completions, **kw): return [1.0]
def nan(prompts, completions, **kw): return [math.nan] * len(completions)
def text(prompts, completions, **kw): return ["good"] * len(completions)
not_callable = 3
'''


def cases(tmp: Path, earlier: Path):
    """(id, argv, what the message must name)."""
    rewards = write(tmp / "rewards.py", REWARD_FILE)
    broken_py = write(tmp / "broken.py", "def f(:\n")
    cfg = lambda name, text: write(tmp / f"{name}.yaml", text)  # noqa: E731
    jsonl = lambda name, text: write(tmp / f"{name}.jsonl", text)  # noqa: E731
    no_config_model = tmp / "empty_model"
    no_config_model.mkdir()
    bad_model = tmp / "bad_model"
    bad_model.mkdir()
    write(bad_model / "config.json", "{not json")
    out = ["--out", str(tmp / "new_run")]
    train = lambda *a: ["train", *TINY, *out, *a]  # noqa: E731
    long_question = "".join(json.dumps({"question": f"{i} " + "word " * 2000, "answer": "1"})
                            + "\n" for i in range(20))
    bad_json = jsonl("badjson", '{"question": "q", "answer": "1"}\n{oops\n')
    no_field = jsonl("nofield", '{"q": "x"}\n')
    latin = write(tmp / "latin.jsonl", b'{"question": "caf\xe9"}')
    gsm = jsonl("gsm", '{"question": "q", "answer": "4"}')
    parquet = write(tmp / "x.parquet", "not parquet")
    yield from [
        # configuration
        ("unknown-key", train("stpes=3"), "unknown option 'stpes' (did you mean 'steps'?)"),
        ("unknown-nested", train("lora.rr=2"), "unknown option 'lora.rr'"),
        ("wrong-type", train("group_size=abc"), "group_size must be int"),
        ("negative-lr", train("lr=-1"), "lr must be > 0"),
        ("zero-temperature", train("temperature=0"), "temperature > 0"),
        ("top-p", train("top_p=1.5"), "top_p must be in (0, 1]"),
        ("group-of-one", train("group_size=1"), "group_size >= 2"),
        ("gae-no-critic", train("recipe_options.advantage=gae"), "needs a learned value"),
        ("dual-clip", train("recipe_options.dual_clip=0.5"), "dual_clip c must be > 1"),
        ("negative-clip", train("recipe_options.clip_low=-1"), "clip ranges must be >= 0"),
        ("unknown-recipe", ["train", *TINY, *out, "--recipe", "grpoo"], "unknown recipe 'grpoo'"),
        ("recipe-option", train("recipe_options.clip_hihg=1"), "no option 'clip_hihg'"),
        ("kl-in-reward", train("recipe_options.kl_placement=reward"), "kl_placement='reward'"),
        ("mixing", train("recipe_options.hybrid_mixing=entropy"), "hybrid_mixing='entropy'"),
        ("yaml-syntax", ["train", "--config", cfg("syntax", "steps: [\n")], "syntax.yaml"),
        ("yaml-list", ["train", "--config", cfg("list", "- 1\n")], "top level must be a mapping"),
        ("yaml-line", ["train", "--config", cfg("line", "recipe: grpo\nlr: -2\n")],
         "line.yaml:2: lr must be > 0"),
        ("config-missing", ["train", "--config", str(tmp / "nope.yaml")], "nope.yaml"),
        ("schedule", train("lr_schedule=exp"), "lr_schedule='exp'"),
        ("minibatches", train("minibatches=9"), "minibatches=9"),
        ("resume-overwrite", train("resume=auto", "overwrite=true"), "exclude each other"),
        ("reward-errors", train("reward_errors=ignore"), "reward_errors must be raise or zero"),
        ("no-equals", train("steps"), "'steps' is not key=value"),
        ("report-to", train("report_to=[nosuchsink]"), "nosuchsink"),
        ("resume-missing", train("resume=step_9"), "resume='step_9'"),
        # data
        ("jsonl-missing", train(f"task=jsonl:{tmp / 'none.jsonl'}"), "none.jsonl"),
        ("jsonl-bad-json", train(f"task=jsonl:{bad_json}"), "badjson.jsonl:2: invalid JSON"),
        ("jsonl-no-field", train(f"task=jsonl:{no_field}"), "nofield.jsonl:1"),
        ("jsonl-empty", train(f"task=jsonl:{jsonl('empty', '')}"), "empty.jsonl"),
        ("jsonl-not-utf8", train(f"task=jsonl:{latin}"), "latin.jsonl:1: not valid UTF-8"),
        ("gsm8k-no-hashes", train(f"task=gsm8k:{gsm}"),
         "gsm.jsonl:1: field 'answer' must end with '#### <number>'"),
        ("parquet-garbage", train(f"task=parquet:{parquet}"), "not a readable Parquet file"),
        ("unknown-task", train("task=chess"), "chess"),
        ("task-option", train("task_options.digitz=2"), "digitz"),
        ("task-digits", train("task_options.digits=0"), "digits"),
        ("prompt-too-long", train(f"task=jsonl:{jsonl('long', long_question)}",
                                  "task_options.answer_field=answer"),
         "exceeds the model's context of 1024 tokens"),
        # reward functions
        ("reward-module", train("rewards=[no_such_module:fn]"), "no_such_module"),
        ("reward-file", train(f"rewards=[{tmp / 'missing.py'}:fn]"), "missing.py"),
        ("reward-attr", train(f"rewards=[{rewards}:nothing]"), "nothing"),
        ("reward-not-callable", train(f"rewards=[{rewards}:not_callable]"), "not_callable"),
        ("reward-syntax", train(f"rewards=[{broken_py}:f]"), "broken.py"),
        ("reward-raises", train(f"rewards=[{rewards}:raises]"),
         "'raises' raised ZeroDivisionError"),
        ("reward-length", train(f"rewards=[{rewards}:short]"), "'short' returned 1 values for 2"),
        ("reward-nan", train(f"rewards=[{rewards}:nan]"), "'nan' returned nan for sample 0"),
        ("reward-text", train(f"rewards=[{rewards}:text]"), "'text' returned 'good'"),
        # models and runs
        ("model-missing", ["train", *TINY, *out, "--model", str(tmp / "nope")], "nope"),
        ("model-no-config", ["train", *TINY, *out, "--model", str(no_config_model)],
         "no config.json"),
        ("model-bad-config", ["train", *TINY, *out, "--model", str(bad_model)],
         "could not load the tokenizer in"),
        ("earlier-run", ["train", *TINY, "--out", str(earlier)], "set overwrite=true"),
        ("eval-k", ["eval", "--model", "tiny", "--k", "0"], "--k"),
        ("eval-model", ["eval", "--model", str(tmp / "nowhere"), "--n", "1"], "nowhere"),
        ("diagnose-missing", ["diagnose", str(tmp / "norun")], "norun"),
    ]


CORPUS_SIZE = 52


def test_corpus_has_at_least_forty_cases(tmp_path, earlier_run):
    assert len(list(cases(tmp_path, earlier_run))) == CORPUS_SIZE >= 40


@pytest.mark.parametrize("index", range(CORPUS_SIZE))
def test_bad_input_gets_a_clear_error(tmp_path, earlier_run, capsys, index):
    name, argv, culprit = list(cases(tmp_path, earlier_run))[index]
    before = snapshot(earlier_run)
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (name, out, err)
    assert err.startswith("postrl: error: "), (name, err)
    assert culprit in err, (name, err)
    assert "Traceback" not in err and "\n\n" not in err.strip(), (name, err)
    assert snapshot(earlier_run) == before, name

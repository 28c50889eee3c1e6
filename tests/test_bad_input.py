"""A corpus of malformed inputs: every one exits non-zero with a one-paragraph message naming
the culprit, prints no traceback, and leaves an earlier run's files untouched.

Every training case writes into the earlier run's directory with ``overwrite=true`` (or
resumes it): whatever fails, and whenever (loading, or the first step), that run's files must
be byte-identical afterwards."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from postrl.cli import main
from postrl.telemetry.run_lock import LOCK_FILE, RunLock

TINY = ["--model", "tiny", "prompts_per_step=1", "group_size=2", "max_new_tokens=4",
        "quiet=true", "--steps", "1"]


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory):
    """A finished run: config, metrics, samples, two checkpoints, a final model."""
    run = tmp_path_factory.mktemp("earlier") / "run"
    assert main(["train", *TINY, "--steps", "2", "save_every=1", "--out", str(run)]) == 0
    (run / "notes.md").write_text("the user's own notes")
    return run


def snapshot(run: Path) -> dict[str, str]:
    """Every file of a run but the lock (which only ever holds a live holder's pid)."""
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file() and p.name != LOCK_FILE}


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
def exits(prompts, completions, **kw):
    import sys
    sys.exit(3)
def none(prompts, completions, **kw): return [None] * len(completions)
'''


def truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def broken_model(tmp: Path, earlier: Path) -> str:
    """The earlier run's final model with half of model.safetensors."""
    model = tmp / "truncated_model"
    shutil.copytree(earlier / "final", model)
    truncated(model / "model.safetensors")
    return str(model)


def broken_checkpoints(tmp: Path, earlier: Path) -> tuple[str, str]:
    """Copies of a checkpoint: one with a truncated state.pt, one without its manifest."""
    truncated_state, no_manifest = tmp / "ckpt_truncated", tmp / "ckpt_no_manifest"
    for copy in (truncated_state, no_manifest):
        shutil.copytree(earlier / "checkpoints" / "step_000001", copy)
    truncated(truncated_state / "state.pt")
    (no_manifest / "manifest.json").unlink()
    return str(truncated_state), str(no_manifest)


def cases(tmp: Path, earlier: Path):
    """(id, argv, what the message must name)."""
    rewards = write(tmp / "rewards.py", REWARD_FILE)
    broken_py = write(tmp / "broken.py", "def f(:\n")
    exits_on_import = write(tmp / "exits.py", "import sys\nsys.exit(4)\n")
    cfg = lambda name, text: write(tmp / f"{name}.yaml", text)  # noqa: E731
    jsonl = lambda name, text: write(tmp / f"{name}.jsonl", text)  # noqa: E731
    no_config_model = tmp / "empty_model"
    no_config_model.mkdir()
    bad_model = tmp / "bad_model"
    bad_model.mkdir()
    write(bad_model / "config.json", "{not json")
    a_file = write(tmp / "a_file.txt", "not a directory")
    ckpt_truncated, ckpt_no_manifest = broken_checkpoints(tmp, earlier)
    sub = tmp / "configs"
    sub.mkdir()
    into_earlier = ["--out", str(earlier), "overwrite=true"]
    train = lambda *a: ["train", *TINY, *into_earlier, *a]  # noqa: E731
    resume = lambda *a: ["train", *TINY, "--out", str(earlier), *a]  # noqa: E731
    from_file = lambda name, text: ["train", "--config", cfg(name, text)]  # noqa: E731
    long_question = "".join(json.dumps({"question": f"{i} " + "word " * 2000, "answer": "1"})
                            + "\n" for i in range(20))
    bad_json = jsonl("badjson", '{"question": "q", "answer": "1"}\n{oops\n')
    no_field = jsonl("nofield", '{"q": "x"}\n')
    array_line = jsonl("array", '["question", "answer"]\n')
    latin = write(tmp / "latin.jsonl", b'{"question": "caf\xe9"}')
    gsm = jsonl("gsm", '{"question": "q", "answer": "4"}')
    parquet = write(tmp / "x.parquet", "not parquet")
    yield from [
        # configuration
        ("unknown-key", train("stpes=3"), "unknown option 'stpes' (did you mean 'steps'?)"),
        ("unknown-nested", train("lora.rr=2"), "unknown option 'lora.rr'"),
        ("wrong-type", train("group_size=abc"), "group_size must be int"),
        ("float-seed", train("seed=1.5"), "seed must be int"),
        ("negative-lr", train("lr=-1"), "lr must be > 0"),
        ("nan-lr", train("lr=.nan"), "lr must be a finite number, got nan"),
        ("inf-lr", train("lr=.inf"), "lr must be a finite number, got inf"),
        ("huge-lr", train("lr=1e999"), "lr must be a finite number, got inf"),
        ("nan-beta", train("adam_betas=[0.9,.nan]"), "adam_betas must be a finite number"),
        ("inf-grad-norm", train("max_grad_norm=.inf"), "max_grad_norm must be a finite number"),
        ("inf-timeout", train("reward_timeout_s=.inf"), "reward_timeout_s must be a finite"),
        ("nan-clip", train("recipe_options.clip_high=.nan"),
         "recipe_options.clip_high must be a finite number"),
        ("nan-weight", train("rewards=[{fn: math_answer, weight: .nan}]"),
         "rewards.weight must be a finite number"),
        ("zero-prompts", train("prompts_per_step=0"), "prompts_per_step must be > 0"),
        ("negative-micro", train("micro_batch_size=-1"), "micro_batch_size must be > 0"),
        ("negative-micro-tokens", train("micro_batch_tokens=-8"),
         "micro_batch_tokens must be >= 0"),
        ("zero-temperature", train("temperature=0"), "temperature > 0"),
        ("top-p", train("top_p=1.5"), "top_p must be in (0, 1]"),
        ("group-of-one", train("group_size=1"), "group_size >= 2"),
        ("precision", train("precision=fp16"), "precision must be one of"),
        ("device", train("device=gpu"), "device='gpu' is not one of auto, cpu, cuda"),
        # no GPU here, or fewer than 8 where there is one: either way the option is named
        ("device-cuda", train("device=cuda:7"), "device=cuda:7"),
        ("backend", train("backend=native"), "backend='native': choose auto or torch"),
        ("vllm-memory", train("vllm_gpu_memory_utilization=1.5"),
         "vllm_gpu_memory_utilization must be in (0, 1]"),
        ("launcher", train("launcher=slurm"), "launcher='slurm' is not one of"),
        ("gae-no-critic", train("recipe_options.advantage=gae"), "needs a learned value"),
        ("dual-clip", train("recipe_options.dual_clip=0.5"), "dual_clip c must be > 1"),
        ("negative-clip", train("recipe_options.clip_low=-1"), "clip ranges must be >= 0"),
        ("one-eval-sample", train("eval_samples=1"), "eval_samples=1 gives no spread"),
        ("unknown-recipe", ["train", *TINY, *into_earlier, "--recipe", "grpoo"],
         "unknown recipe 'grpoo'"),
        ("recipe-option", train("recipe_options.clip_hihg=1"), "no option 'clip_hihg'"),
        ("kl-in-reward", train("recipe_options.kl_placement=reward"), "kl_placement='reward'"),
        ("mixing", train("recipe_options.hybrid_mixing=entropy"), "hybrid_mixing='entropy'"),
        ("schedule", train("lr_schedule=exp"), "lr_schedule='exp'"),
        ("minibatches", train("minibatches=9"), "minibatches=9"),
        ("resume-overwrite", train("resume=auto"), "exclude each other"),
        ("reward-errors", train("reward_errors=ignore"), "reward_errors must be raise or zero"),
        ("no-equals", train("steps"), "'steps' is not key=value"),
        ("report-to", train("report_to=[nosuchsink]"), "nosuchsink"),
        ("report-to-second", train("report_to=[none,nosuchsink]"), "nosuchsink"),
        ("stop-empty", train("stop=['']"), "stop strings must be non-empty"),
        ("lora-target", train("lora.r=2", "lora.target_modules=[q_projj]"),
         "lora.target_modules: 'q_projj' matches no module"),
        ("lora-no-targets", train("lora.r=2", "lora.target_modules=[]"),
         "lora.target_modules is empty"),
        ("lora-rank", train("lora.r=-1"), "lora needs r >= 0"),
        # configuration files
        ("yaml-syntax", from_file("syntax", "steps: [\n"), "syntax.yaml"),
        ("yaml-list", from_file("list", "- 1\n"), "top level must be a mapping"),
        ("yaml-line", from_file("line", "recipe: grpo\nlr: -2\n"),
         "line.yaml:2: lr must be > 0"),
        ("yaml-duplicate", from_file("twice", "lr: 1e-5\nsteps: 2\nlr: 1e-3\n"),
         "twice.yaml:3: option 'lr' is set twice (also on line 1)"),
        ("yaml-duplicate-nested", from_file("twice_nested", "lora:\n  r: 2\n  r: 4\n"),
         "twice_nested.yaml:3: option 'r' is set twice (also on line 2)"),
        ("yaml-not-utf8", ["train", "--config", write(tmp / "latin.yaml",
                                                      b"steps: 2\nsystem_prompt: caf\xe9\n")],
         "latin.yaml:2: not valid UTF-8 (byte 0xe9)"),
        ("yaml-nan", from_file("nan", "lr: .nan\n"), "nan.yaml:1: lr must be a finite number"),
        ("config-missing", ["train", "--config", str(tmp / "nope.yaml")], "nope.yaml"),
        ("config-relative-data", ["train", "--config", write(
            sub / "rel.yaml", f"model: tiny\nsteps: 1\nout: {earlier}\noverwrite: true\n"
                              "task: jsonl:missing.jsonl\n")], str(sub / "missing.jsonl")),
        ("config-relative-reward", ["train", "--config", write(
            sub / "relreward.yaml", f"model: tiny\nsteps: 1\nout: {earlier}\noverwrite: true\n"
                                    "rewards: [nothere.py:fn]\n")], str(sub / "nothere.py")),
        # data
        ("jsonl-missing", train(f"task=jsonl:{tmp / 'none.jsonl'}"), "none.jsonl"),
        ("jsonl-bad-json", train(f"task=jsonl:{bad_json}"), "badjson.jsonl:2: invalid JSON"),
        ("jsonl-no-field", train(f"task=jsonl:{no_field}"), "nofield.jsonl:1"),
        ("jsonl-array", train(f"task=jsonl:{array_line}"),
         "array.jsonl:1: expected a JSON object, got list"),
        ("jsonl-empty", train(f"task=jsonl:{jsonl('empty', '')}"), "empty.jsonl"),
        ("jsonl-not-utf8", train(f"task=jsonl:{latin}"), "latin.jsonl:1: not valid UTF-8"),
        ("jsonl-test-path",
         train(f"task=jsonl:{gsm}", f"task_options.test_path={tmp / 'nt.jsonl'}"), "nt.jsonl"),
        ("gsm8k-no-hashes", train(f"task=gsm8k:{gsm}"),
         "gsm.jsonl:1: field 'answer' must end with '#### <number>'"),
        ("gsm8k-no-path", train("task=gsm8k:"), "a path is needed after 'gsm8k:'"),
        ("parquet-garbage", train(f"task=parquet:{parquet}"), "not a readable Parquet file"),
        ("unknown-task", train("task=chess"), "chess"),
        ("task-option", train("task_options.digitz=2"), "digitz"),
        ("task-digits", train("task_options.digits=0"), "digits"),
        ("task-guess-range", train("task=guess_number", "task_options.min_high=9",
                                   "task_options.max_high=4"), "max_high (4) must be >= min_high"),
        ("task-demonstrations", train("task=calculator", "task_options.demonstrations=3"),
         "demonstrations must be at most 2, got 3"),
        ("max-turns-zero", train("task=guess_number", "max_turns=0"), "max_turns"),
        ("env-reward-at-value", train("task=guess_number", "env_reward_at=middle"),
         "env_reward_at='middle' is not one of end, turn"),
        ("env-reward-at-turn-group", train("task=guess_number", "env_reward_at=turn"),
         "recipe 'grpo' has advantage='group', one value per episode"),
        ("env-reward-at-turn-single", train("recipe=ppo", "env_reward_at=turn"),
         "env_reward_at=turn: task 'arithmetic' is single-turn"),
        ("env-reward-at-turn-no-env-reward", train("recipe=ppo", "task=guess_number",
                                                   "env_reward_at=turn", "rewards=[format]"),
         "does not include it"),
        ("reasoning-gym-option", train("task=reasoning_gym:chain_sum",
                                       "task_options.max_digitz=2"),
         "task option 'max_digitz' does not apply to task 'reasoning_gym:chain_sum'"),
        # named either way: an unknown game, or the extra it needs where textarena is absent
        ("textarena-unknown-game", train("task=textarena:NoSuchGame-v0"),
         "textarena:NoSuchGame-v0"),
        ("prompt-too-long", train(f"task=jsonl:{jsonl('long', long_question)}",
                                  "task_options.answer_field=answer"),
         "exceeds the model's context of 1024 tokens"),
        # reward functions
        ("reward-module", train("rewards=[no_such_module:fn]"), "no_such_module"),
        ("reward-file", train(f"rewards=[{tmp / 'missing.py'}:fn]"), "missing.py"),
        ("reward-attr", train(f"rewards=[{rewards}:nothing]"), "nothing"),
        ("reward-not-callable", train(f"rewards=[{rewards}:not_callable]"), "not_callable"),
        ("reward-syntax", train(f"rewards=[{broken_py}:f]"), "broken.py"),
        ("reward-exits-on-import", train(f"rewards=[{exits_on_import}:f]"),
         "importing '" + exits_on_import + "' failed: SystemExit: 4"),
        ("reward-unknown-name", train("rewards=[math_answr]"), "unknown reward 'math_answr'"),
        ("reward-raises", train(f"rewards=[{rewards}:raises]"),
         "'raises' raised ZeroDivisionError"),
        ("reward-exits", train(f"rewards=[{rewards}:exits]"), "'exits' called sys.exit(3)"),
        ("reward-length", train(f"rewards=[{rewards}:short]"), "'short' returned 1 values for 2"),
        ("reward-nan", train(f"rewards=[{rewards}:nan]"), "'nan' returned nan for sample 0"),
        ("reward-text", train(f"rewards=[{rewards}:text]"), "'text' returned 'good'"),
        ("reward-none", train(f"rewards=[{rewards}:none]"), "no reward function applies"),
        ("reward-model-missing", train(f"rewards=[reward_model:{tmp / 'no_rm'}]"),
         f"reward 'reward_model:{tmp / 'no_rm'}': no such directory"),
        # models
        ("model-missing", ["train", *TINY, *into_earlier, "--model", str(tmp / "nope")], "nope"),
        ("model-no-config", ["train", *TINY, *into_earlier, "--model", str(no_config_model)],
         "no config.json"),
        ("model-bad-config", ["train", *TINY, *into_earlier, "--model", str(bad_model)],
         "could not load the tokenizer in"),
        ("model-truncated", ["train", *TINY, *into_earlier, "--model",
                             broken_model(tmp, earlier)],
         "could not load the model in " + str(tmp / "truncated_model")),
        ("model-hub-id", ["train", *TINY, *into_earlier, "--model", "HuggingFaceTB/SmolLM2-1.7B"],
         "looks like a Hugging Face Hub id, and postrl never downloads models"),
        # run directories and checkpoints
        ("earlier-run", ["train", *TINY, "--out", str(earlier)], "set overwrite=true"),
        ("out-is-a-file", ["train", *TINY, "--out", a_file], f"{a_file} is a file"),
        ("out-below-a-file", ["train", *TINY, "--out", f"{a_file}/run"], f"{a_file} is a file"),
        ("resume-missing", resume("resume=step_9"), "resume='step_9'"),
        ("resume-truncated", resume(f"resume={ckpt_truncated}"),
         "state.pt does not match its checksum"),
        ("resume-no-manifest", resume(f"resume={ckpt_no_manifest}"), "no readable manifest"),
        ("resume-changed", resume("resume=auto", "lr=1e-3"),
         "the run's options changed (lr: 1e-06 -> 0.001)"),
        # other commands
        ("eval-k", ["eval", "--model", "tiny", "--k", "0"], "--k"),
        ("eval-model", ["eval", "--model", str(tmp / "nowhere"), "--n", "1"], "nowhere"),
        ("eval-hub-id", ["eval", "--model", "Qwen/Qwen3-0.6B", "--n", "1"], "hf download"),
        ("eval-max-turns", ["eval", "--model", "tiny", "--max-turns", "0"], "--max-turns"),
        ("eval-stop", ["eval", "--model", "tiny", "--stop", ""], "--stop"),
        ("diagnose-missing", ["diagnose", str(tmp / "norun")], "norun"),
    ]


CORPUS_SIZE = 109


def test_corpus_has_at_least_eighty_cases(tmp_path, earlier_run):
    names = [name for name, *_ in cases(tmp_path, earlier_run)]
    assert len(names) == len(set(names)) == CORPUS_SIZE >= 80


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
    assert not (earlier_run / ".postrl-replaced").exists(), name


def test_a_second_training_into_a_run_in_use_is_refused_naming_the_holder(earlier_run,
                                                                         capsys):
    before = snapshot(earlier_run)
    lock = RunLock.acquire(earlier_run)  # as a training in progress holds it
    try:
        code = main(["train", *TINY, "--out", str(earlier_run), "overwrite=true"])
    finally:
        lock.release()
    err = capsys.readouterr().err
    assert code == 2
    # held in this process here, so the message says so (another process's: tests/telemetry)
    assert f"run directory {earlier_run} is in use by another training in this process " in err
    assert "Traceback" not in err
    assert snapshot(earlier_run) == before


def test_overwrite_replaces_the_earlier_run_once_the_new_one_has_run(earlier_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(earlier_run, run)
    old_metrics = (run / "metrics.jsonl").read_text()
    assert main(["train", *TINY, "--out", str(run), "overwrite=true", "seed=3"]) == 0
    assert (run / "metrics.jsonl").read_text() != old_metrics
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    assert not (run / "checkpoints").exists()  # the earlier run's, replaced
    assert (run / "notes.md").read_text() == "the user's own notes"
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == [LOCK_FILE]

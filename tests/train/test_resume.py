"""Checkpoints and exact resume: a run killed anywhere and resumed with resume=auto writes the
same metrics.jsonl, line for line (wall-clock times aside), as a run never interrupted."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from postrl.config import load_config
from postrl.errors import ConfigError
from postrl.train.checkpoint import CheckpointError, is_valid, latest_valid, list_checkpoints
from postrl.train.trainer import Trainer

HERE = Path(__file__).parent
REWARDS = HERE / "rewards_for_tests.py"
CLOCK = ("time/", "throughput/", "memory/")  # vary from run to run


def options(out: Path, recipe: str, *extra: str) -> list[str]:
    return [f"recipe={recipe}", "model=tiny", "task=arithmetic", "steps=4", "prompts_per_step=2",
            "group_size=4", "max_new_tokens=8", f"out={out}", "lr=1e-3", "quiet=true",
            "save_every=1", "keep_last=2", f"rewards=[{REWARDS}:length_parity]",
            "micro_batch_size=3", "threads=1", *extra]


def metrics_without_clock(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(CLOCK)} for r in rows]


def kill_then_resume(out: Path, recipe: str, when: str, step: int, *extra: str) -> Trainer:
    child = subprocess.run([sys.executable, str(HERE / "killable_run.py"), when, str(step),
                            *options(out, recipe, *extra)], capture_output=True, text=True)
    assert child.returncode == -9, child.stderr[-2000:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the half-written checkpoint is skipped with a warning
        trainer = Trainer(load_config(None, options(out, recipe, *extra, "resume=auto")))
    trainer.train()
    return trainer


CASES = [("grpo", "after_log", 2), ("grpo", "after_save", 1), ("grpo", "in_save", 3),
         ("dapo", "after_log", 3), ("ppo", "in_save", 2)]


@pytest.mark.parametrize("recipe, when, step", CASES, ids=[f"{r}-{w}-{s}" for r, w, s in CASES])
def test_killed_and_resumed_run_matches_an_uninterrupted_one(tmp_path, recipe, when, step):
    extra = (f"rewards=[{REWARDS}:parity_on_odd_answers]", "recipe_options.overlong_buffer=4"
             ) if recipe == "dapo" else ()
    Trainer(load_config(None, options(tmp_path / "whole", recipe, *extra))).train()
    resumed = kill_then_resume(tmp_path / "resumed", recipe, when, step, *extra)
    # it really continued from a checkpoint: the newest complete one before the kill
    assert resumed.resumed_from == (step if when == "after_save" else step - 1)
    expected = metrics_without_clock(tmp_path / "whole")
    assert [r["step"] for r in expected] == [1, 2, 3, 4]
    assert metrics_without_clock(tmp_path / "resumed") == expected



@pytest.mark.parametrize("recipe, reward_at", [("grpo", "end"), ("ppo", "turn")])
def test_a_killed_environment_run_resumes_exactly(tmp_path, recipe, reward_at):
    """Multi-turn episodes (environment tokens in the context, rewards per turn for PPO's
    critic) resume as single-turn runs do: the same metrics.jsonl, line for line."""
    extra = ("task=guess_number", "stop=[e]", "max_turns=3", "max_new_tokens=12",
             f"env_reward_at={reward_at}", f"rewards=[environment, {REWARDS}:length_parity]")
    Trainer(load_config(None, options(tmp_path / "whole", recipe, *extra))).train()
    resumed = kill_then_resume(tmp_path / "resumed", recipe, "after_log", 2, *extra)
    assert resumed.resumed_from == 1
    expected = metrics_without_clock(tmp_path / "whole")
    assert [r["step"] for r in expected] == [1, 2, 3, 4]
    assert any(r["episode/turns_mean"] > 1 for r in expected)  # the episodes had turns
    assert metrics_without_clock(tmp_path / "resumed") == expected

def test_bf16_master_resumes_exactly(tmp_path):
    """The working copy is rebuilt from the resumed float32 masters, so the resumed run's
    bf16 forwards are the uninterrupted run's."""
    extra = ("precision=bf16-master",)
    Trainer(load_config(None, options(tmp_path / "whole", "grpo", *extra))).train()
    resumed = kill_then_resume(tmp_path / "resumed", "grpo", "after_log", 2, *extra)
    assert resumed.resumed_from == 1
    assert metrics_without_clock(tmp_path / "resumed") == metrics_without_clock(tmp_path / "whole")


def test_a_checkpoint_counts_the_run_by_the_names_older_checkpoints_use(tmp_path):
    """``counters`` in ``state.pt`` is the run's ``RunState`` under the names every
    checkpoint has used (docs/reliability.md): older checkpoints resume as they are."""
    import torch

    Trainer(load_config(None, options(tmp_path / "run", "grpo", "steps=2"))).train()
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_000002" / "state.pt",
                       weights_only=False)
    rows = metrics_without_clock(tmp_path / "run")
    assert state["counters"] == {
        "step": 2, "tokens_generated": rows[-1]["rollout/tokens_generated"],
        "tokens_wasted": rows[-1]["rollout/tokens_wasted"],
        "responses": rows[-1]["rollout/responses"], "skipped_steps": 0, "skipped_in_a_row": 0}
    assert list(state["counters"]) == ["step", "tokens_generated", "tokens_wasted",
                                       "responses", "skipped_steps", "skipped_in_a_row"]


def test_a_run_state_comes_back_from_its_counters_or_says_why_not():
    from postrl.train.state import RunState

    state = RunState(step=3, tokens_generated=40, tokens_wasted=4, responses=24,
                     skipped_steps=1, skipped_in_a_row=1)
    assert RunState.from_counters(state.counters(), "here") == state
    assert RunState.from_counters({"step": 3}, "here") == RunState(step=3)  # older: 0
    with pytest.raises(ConfigError, match=r"cannot resume from ckpt: it counts "
                                          r"turns_taken, which this version of postrl"):
        RunState.from_counters({**state.counters(), "turns_taken": 2}, "ckpt")


def test_keep_last_and_manifest_checks(tmp_path):
    Trainer(load_config(None, options(tmp_path / "run", "grpo"))).train()
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == ["step_000003", "step_000004"]
    assert all(is_valid(p)[0] for p in list_checkpoints(root))
    (root / "step_000004" / "state.pt").write_bytes(b"corrupt")
    with pytest.warns(UserWarning, match="step_000004: state.pt does not match its checksum"):
        assert latest_valid(root).name == "step_000003"


def test_resume_refuses_changed_options(tmp_path):
    Trainer(load_config(None, options(tmp_path / "run", "grpo", "steps=2"))).train()
    with pytest.raises(ConfigError, match=r"the run's options changed \(lr: 0.001 -> 0.002"):
        Trainer(load_config(None, options(tmp_path / "run", "grpo", "resume=auto", "lr=2e-3")))


def test_resume_extends_a_finished_run(tmp_path):
    Trainer(load_config(None, options(tmp_path / "whole", "grpo"))).train()
    Trainer(load_config(None, options(tmp_path / "parts", "grpo", "steps=2"))).train()
    Trainer(load_config(None, options(tmp_path / "parts", "grpo", "resume=auto"))).train()
    assert metrics_without_clock(tmp_path / "parts") == metrics_without_clock(tmp_path / "whole")


def test_a_moved_run_directory_resumes(tmp_path, monkeypatch):
    """The run directory is where a run lives, not what it computes: a run moved, or named
    by a relative path after an absolute one, continues exactly."""
    Trainer(load_config(None, options(tmp_path / "whole", "grpo"))).train()
    Trainer(load_config(None, options(tmp_path / "first", "grpo", "steps=2"))).train()
    (tmp_path / "first").rename(tmp_path / "moved")
    monkeypatch.chdir(tmp_path)
    Trainer(load_config(None, options(Path("moved"), "grpo", "resume=auto"))).train()
    assert metrics_without_clock(tmp_path / "moved") == metrics_without_clock(tmp_path / "whole")


@pytest.mark.parametrize("failure", ["os-error", "zip-writer-on-full-disk",
                                     "zip-writer-with-space-left"])
def test_a_failed_save_keeps_earlier_checkpoints_and_says_why(tmp_path, monkeypatch, failure):
    """A full disk reaches save_checkpoint as an OSError, or, from torch's zip writer, as a
    RuntimeError after a partial write: either way a CheckpointError says what happened."""
    import errno
    from collections import namedtuple

    from postrl.train import checkpoint

    trainer = Trainer(load_config(None, options(tmp_path / "run", "grpo", "steps=3")))
    real_save = checkpoint.torch.save
    free = 0 if failure == "zip-writer-on-full-disk" else 50 * 2**30
    usage = namedtuple("usage", "total used free")

    def failing_save(obj, path):
        if "step_000002" not in str(path):
            return real_save(obj, path)
        if failure == "os-error":
            raise OSError(errno.ENOSPC, "No space left on device")
        Path(path).write_bytes(b"partial" * 1000)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 12 vs 8")

    monkeypatch.setattr(checkpoint.torch, "save", failing_save)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage",
                        lambda path: usage(100 * 2**30, 100 * 2**30 - free, free))
    expected = {"os-error": "the disk is full", "zip-writer-on-full-disk": "the disk is full",
                "zip-writer-with-space-left": r"torch.save failed \(\[enforce fail.*\) with "
                                              r"50.00 GiB free on the disk"}[failure]
    with pytest.raises(CheckpointError, match=f"step 2 .*{expected}.*; earlier checkpoints "
                                              "are intact"):
        trainer.train()
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in root.iterdir()] == ["step_000001"]
    assert is_valid(root / "step_000001")[0]


def test_resume_auto_without_a_checkpoint_keeps_the_attempt_before_and_warns(tmp_path):
    Trainer(load_config(None, options(tmp_path / "run", "grpo", "steps=2", "save_every=0"))
            ).train()
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.warns(UserWarning, match=r"holds no checkpoint to continue from \(it saves "
                                         r"none: save_every=0\); training starts from step 0"):
        trainer = Trainer(load_config(None, options(tmp_path / "run", "grpo", "steps=2",
                                                    "save_every=0", "resume=auto")))
    trainer.train()
    kept = tmp_path / "run" / "earlier" / "attempt-1"
    assert (kept / "metrics.jsonl").read_text() == before
    assert {p.name for p in kept.iterdir()} == {"metrics.jsonl", "samples.jsonl", "config.yaml"}
    assert [r["step"] for r in metrics_without_clock(tmp_path / "run")] == [1, 2]


def test_a_checkpoint_from_before_an_option_existed_resumes_with_its_default():
    from postrl.train.resume import check_same_run

    current = load_config(None, ["model=tiny"]).resolved()
    older = {k: v for k, v in current.items() if k != "sampler_precision"}
    older["resolved_recipe"] = {k: v for k, v in current["resolved_recipe"].items()
                                if not k.startswith(("mismatch_", "sapo_"))}
    check_same_run(older, current, "step_000003")  # the defaults are what the old run ran
    changed = load_config(None, ["model=tiny", "sampler_precision=bf16",
                                 "recipe_options.mismatch_weight=token"]).resolved()
    with pytest.raises(ConfigError, match=r"sampler_precision: None -> 'bf16'.*"
                                          r"resolved_recipe.mismatch_weight: None -> 'token'"):
        check_same_run(older, changed, "step_000003")

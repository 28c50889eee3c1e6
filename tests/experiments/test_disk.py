"""What compare says it will write to disk, against what a run writes."""

import shutil
from collections import namedtuple

import pytest

from postrl.config import load_config
from postrl.errors import ConfigError
from postrl.experiments.disk import (
    check_free_space,
    checkpoints_held,
    disk_plan,
    drop_weights,
    parameter_count,
    run_size,
)
from postrl.models.loading import load_policy
from postrl.train.trainer import Trainer
from tests.experiments.test_compare import TINY


def test_the_parameters_are_counted_without_loading_the_weights():
    model, _ = load_policy("tiny")
    assert parameter_count("tiny") == sum(p.numel() for p in model.parameters())


def test_the_estimates_are_within_a_tenth_of_what_a_run_writes(tmp_path):
    cfg = load_config(None, ["recipe=grpo", *TINY, f"out={tmp_path / 'run'}", "steps=2",
                             "save_every=1", "keep_last=1"])
    Trainer(cfg).train()
    size = run_size(cfg, parameter_count("tiny"))
    final = sum(f.stat().st_size for f in (tmp_path / "run" / "final").glob("*.safetensors"))
    checkpoint = (tmp_path / "run" / "checkpoints" / "step_000002" / "state.pt").stat().st_size
    assert final == pytest.approx(size.final, rel=0.1)
    assert checkpoint == pytest.approx(size.checkpoint, rel=0.1)


def test_the_plan_counts_finals_and_the_checkpoints_held_at_once(tmp_path):
    configs = [load_config(None, ["recipe=grpo", *TINY, f"out={tmp_path / str(i)}",
                                  "save_every=2", "keep_last=3"]) for i in range(4)]
    size = run_size(configs[0], parameter_count("tiny"))
    assert checkpoints_held(configs[0]) == 4
    pruned, line = disk_plan(configs, keep_checkpoints=False)
    assert pruned == 4 * size.final + 4 * size.checkpoint
    assert "4 final policies" in line and "up to 4 checkpoints" in line
    kept, _ = disk_plan(configs, keep_checkpoints=True)
    assert kept == 4 * size.final + 16 * size.checkpoint
    light, line = disk_plan(configs, keep_checkpoints=False, keep_weights=False)
    assert light == size.final + 4 * size.checkpoint and "one final policy of" in line


def test_dropping_weights_keeps_what_says_a_run_finished(tmp_path):
    final = tmp_path / "final"
    final.mkdir()
    for name in ("model.safetensors", "adapter_model.bin", "config.json", "tokenizer.json"):
        (final / name).write_text("x")
    drop_weights(final)
    assert sorted(p.name for p in final.iterdir()) == ["config.json", "tokenizer.json"]
    drop_weights(tmp_path / "absent")  # nothing to drop: no error


def test_too_little_free_space_is_refused_before_the_runs_start(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 5, 5 * 10**8))
    check_free_space(tmp_path / "a" / "b", 4 * 10**8, "disk: about 0.40 GB")
    with pytest.raises(ConfigError, match="disk: about 0.90 GB, but the disk holding .* has "
                                          "0.50 GB free"):
        check_free_space(tmp_path / "a" / "b", 9 * 10**8, "disk: about 0.90 GB")

"""A sampler that is not the trainer, for real: a bf16 sampler beside an fp32 update logs a
mismatch KL far above an fp32 sampler's, and truncated weights never exceed C."""

import json
from pathlib import Path

import pytest

from postrl.config import load_config
from postrl.train.setup import records_forward
from postrl.train.trainer import Trainer

REWARDS = Path(__file__).with_name("rewards_for_tests.py")
CAP = 1.0005


def run(out: Path, *extra: str) -> list[dict]:
    cfg = load_config(None, ["model=tiny", "recipe=dr_grpo", "steps=3", "prompts_per_step=2",
                             "group_size=4", "max_new_tokens=16", "lr=1e-3", "quiet=true",
                             f"rewards=[{REWARDS}:length_parity]", f"out={out}", *extra])
    Trainer(cfg).train()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_bf16_sampler_is_measured_and_truncated_weights_stay_below_c(tmp_path):
    same = run(tmp_path / "fp32")
    truncated = run(tmp_path / "bf16", "sampler_precision=bf16",
                    "recipe_options.mismatch_weight=token", f"recipe_options.mismatch_cap={CAP}")
    for fp32, bf16 in zip(same, truncated, strict=True):
        assert bf16["mismatch/kl_k3"] > 100 * fp32["mismatch/kl_k3"] >= 0
        assert bf16["mismatch/weight_max"] <= CAP
        assert bf16["mismatch/sampler_ppl"] != bf16["mismatch/trainer_ppl"]
    assert max(r["mismatch/truncated_frac"] for r in truncated) > 0
    assert all(r["mismatch/truncated_frac"] == 0 for r in same)


def test_a_sampler_of_another_precision_records_no_forward_for_the_update():
    cfg = load_config(None, ["model=tiny", "sampler_precision=bf16"])
    assert cfg.sampling_precision == "bf16" and not records_forward(cfg)
    assert records_forward(load_config(None, ["model=tiny"]))


@pytest.mark.parametrize("options", [["precision=bf16-master", "sampler_precision=fp32"],
                                     ["sampler_precision=fp16"]])
def test_unsupported_sampler_precisions_are_refused(options):
    from postrl.errors import ConfigError

    with pytest.raises(ConfigError, match="sampler_precision"):
        load_config(None, options)


def test_a_correction_with_truncated_sampling_warns(tmp_path):
    cfg = load_config(None, ["model=tiny", "top_k=5", "recipe_options.mismatch_weight=token",
                             f"out={tmp_path / 'r'}", "quiet=true"])
    with pytest.warns(UserWarning, match="truncated one, which these weights do not correct"):
        Trainer(cfg).close()

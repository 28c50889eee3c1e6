"""``postrl replay``: several recipes' losses and gradients on one frozen batch of a real run."""

import argparse
import json
from pathlib import Path

import pytest
import torch

from postrl.config import load_config
from postrl.errors import ConfigError
from postrl.experiments.replay import add_replay_arguments, replay, run_replay
from postrl.objectives import advantages as adv
from postrl.train.batch import load_rollout_batch
from postrl.train.trainer import Trainer

REWARDS = str(Path(__file__).parents[1] / "train" / "rewards_for_tests.py")


def tiny_run(path: Path, *extra: str) -> Path:
    cfg = load_config(None, [
        "recipe=grpo", "model=tiny", "steps=2", "prompts_per_step=2", "group_size=4",
        "max_new_tokens=8", "lr=1e-3", "quiet=true", "save_rollouts_every=1",
        f"rewards=[{REWARDS}:length_parity]", "micro_batch_size=3", f"out={path}", *extra])
    Trainer(cfg).train()
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return tiny_run(tmp_path_factory.mktemp("replay") / "grpo")


def test_recipes_with_equal_components_give_identical_gradients(run_dir):
    # the KL estimator is unused without KL, the sequence clip range without a hybrid ratio
    result = replay(run_dir, 2, ["dr_grpo", "dr_grpo:kl_estimator=k1,seq_clip_low=0.1"])
    first, second = result.recipes
    assert first.grad_norm > 0  # the parity rewards vary within groups
    assert first.loss == second.loss
    assert torch.equal(first.gradient, second.gradient)
    assert torch.equal(first.weights, second.weights)
    assert result.cosine[0][1] == pytest.approx(1.0, abs=1e-6)


def test_token_and_sequence_ratios_give_the_same_gradient_on_policy(run_dir):
    result = replay(run_dir, 1, ["gspo:ratio=token", "gspo", "dhpo", "dhpo:hybrid_mixing=entropy"])
    assert result.on_policy
    cosine = result.cosine
    assert cosine[0][1] == pytest.approx(1.0, abs=1e-6)  # token vs sequence (GSPO)
    assert cosine[0][2] == pytest.approx(1.0, abs=1e-6)  # token vs averaged hybrid (DHPO)
    assert cosine[0][3] < 1 - 1e-4  # entropy-guided mixing reweights tokens even on-policy
    assert result.recipes[0].loss == pytest.approx(result.recipes[1].loss, abs=1e-7)


def test_per_token_weights_are_the_aggregation_weights_on_policy(run_dir):
    """Dr. GRPO on-policy: d loss / d logp[i,t] = -A_i / (N * C) on every valid token."""
    batch, config = load_rollout_batch(run_dir / "rollouts" / "step_2.pt")
    result = replay(run_dir, 2, ["dr_grpo", "dapo:overlong_buffer=4"])
    advantages = adv.group(batch.rewards, batch.group_size, scale="none").unsqueeze(1)
    mask = batch.response_mask
    expected = -advantages / (batch.rows * config["max_new_tokens"]) * mask
    torch.testing.assert_close(result.recipes[0].weights, expected, rtol=1e-5, atol=1e-9)
    assert any("dynamic sampling, overlong shaping" in note for note in result.notes)


def test_gae_recipes_and_missing_batches_are_refused(run_dir):
    with pytest.raises(ConfigError, match="GAE advantages need the run's critic"):
        replay(run_dir, 1, ["ppo"])
    with pytest.raises(ConfigError, match=r"step_7.pt \(saved steps: 1, 2\)"):
        replay(run_dir, 7, ["grpo"])
    with pytest.raises(ConfigError, match="only recipe options can change"):
        replay(run_dir, 1, ["grpo:max_new_tokens=4"])


def test_off_policy_batch_uses_the_saved_old_logprobs(tmp_path):
    run = tiny_run(tmp_path / "off", "minibatches=2", "steps=1")
    wide = "clip_low=0.9,clip_high=10"  # nothing clipped: the difference is the ratio unit
    result = replay(run, 1, [f"gspo:ratio=token,{wide}", f"gspo:{wide}"])
    assert not result.on_policy  # the final policy moved away from the one that sampled
    assert all(r.grad_norm > 0 for r in result.recipes)
    assert result.cosine[0][1] < 1 - 1e-6


def test_replay_command_prints_json(run_dir, capsys):
    parser = argparse.ArgumentParser()
    add_replay_arguments(parser)
    assert run_replay(parser.parse_args([str(run_dir), "--step", "1", "grpo", "gspo",
                                         "--json"])) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["recipe"] for r in data["recipes"]] == ["grpo", "gspo"]
    assert len(data["recipes"][0]["token_weights"]) == 8 and data["on_policy"]
    assert data["saved_reference"]  # the grpo run computed its KL reference
    assert run_replay(parser.parse_args([str(run_dir), "--step", "1", "grpo", "gspo"])) == 0
    assert "cosine similarity of the parameter gradients" in capsys.readouterr().out


def test_corrected_and_uncorrected_losses_side_by_side(run_dir):
    """The replayed policy (after 2 steps) is not the one that sampled step 2's batch: each
    token's weight in the corrected loss is the uncorrected one times min(pi_old/pi_sampler, C)."""
    cap = 1.0001
    result = replay(run_dir, 2, ["dr_grpo", f"dr_grpo:mismatch_weight=token,mismatch_cap={cap}"])
    plain, corrected = result.recipes
    assert plain.metrics["mismatch/kl_k3"] > 0  # logged even with the correction off
    assert corrected.metrics["mismatch/weight_max"] <= cap
    assert corrected.metrics["mismatch/truncated_frac"] > 0
    scored = plain.weights != 0
    factor = corrected.weights[scored] / plain.weights[scored]
    assert factor.max() <= cap * (1 + 1e-5) and factor.min() < 1 - 1e-4
    assert corrected.grad_norm != plain.grad_norm

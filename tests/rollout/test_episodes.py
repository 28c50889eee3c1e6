"""Multi-turn episodes: token in, token out, and environment tokens that are context only.

The tiny random model never ends a turn by itself, so these episodes end turns at a stop
string that random text contains often ("e"); the environments answer with fixed text.
"""

import dataclasses
import json
from dataclasses import dataclass

import pytest
import torch

from postrl.envs import Step
from postrl.envs.turns import observation_ids
from postrl.models.logprobs import response_logprobs
from postrl.objectives.aggregation import BatchCounts
from postrl.objectives.policy_loss import PolicyLossInputs, policy_loss
from postrl.recipes import get_recipe
from postrl.rollout import HFRolloutEngine, SamplingParams
from postrl.rollout.base import select_rows
from postrl.rollout.episodes import EpisodeLimits, run_episodes, turn_reward_tensor
from postrl.tasks import build_prompt
from postrl.train.batch import assemble, compute_advantages
from postrl.train.sampling import Group

REPLY = "Not yet, try again."


@dataclass
class Scripted:
    """Replies REPLY until the model's third turn; pays 0.25 per turn."""

    turns: int = 0

    def step(self, response: str) -> Step:
        self.turns += 1
        return Step(REPLY, reward=0.25, done=self.turns == 3)


def play(tiny, max_turns=4, max_tokens=40, group_size=3):
    model, tokenizer = tiny
    prompts = [build_prompt(tokenizer, q) for q in ("Guess a word.", "Name a colour please.")]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    envs = [Scripted() for _ in range(len(ids) * group_size)]
    params = SamplingParams(temperature=1.0, max_new_tokens=max_tokens, stop=("e",))
    rollouts = run_episodes(HFRolloutEngine(model, tokenizer, entropies=True), tokenizer, ids,
                            envs, group_size, params, seed=3,
                            limits=EpisodeLimits(max_turns, max_tokens))
    return rollouts, envs, tokenizer


def segments(flags: list[bool]) -> list[tuple[bool, int, int]]:
    """(is_model, start, stop) runs of equal flags."""
    runs, start = [], 0
    for i in range(1, len(flags) + 1):
        if i == len(flags) or flags[i] != flags[start]:
            runs.append((flags[start], start, i))
            start = i
    return runs


def test_episodes_alternate_sampled_turns_and_appended_observation_tokens(tiny):
    rollouts, envs, tokenizer = play(tiny)
    extent = torch.arange(rollouts.response_ids.shape[1])[None] < rollouts.lengths[:, None]
    assert not (rollouts.response_mask & rollouts.env_mask).any()
    assert torch.equal(rollouts.response_mask | rollouts.env_mask, extent)
    assert (rollouts.logprobs[rollouts.env_mask] == 0).all()
    turns = rollouts.episodes.turns
    assert max(turns) >= 2, "the test needs episodes of several turns"
    for row in range(rollouts.response_ids.shape[0]):
        n = int(rollouts.lengths[row])
        runs = segments(rollouts.response_mask[row, :n].tolist())
        model_runs = [r for r in runs if r[0]]
        assert len(model_runs) == turns[row] and runs[0][0]  # starts with the model's turn
        for is_model, start, stop in runs:
            if not is_model:  # exactly the template's reply, appended as tokens
                ids = rollouts.response_ids[row, start:stop].tolist()
                assert ids in (observation_ids(tokenizer, REPLY, after_eos=False),
                               observation_ids(tokenizer, REPLY, after_eos=True))
        assert rollouts.episodes.env_tokens[row] == n - int(rollouts.generated_lengths[row])
        done = envs[row].turns == 3
        assert rollouts.episodes.rewards[row] == pytest.approx(0.25 * envs[row].turns)
        assert rollouts.episodes.out_of_turns[row] == (not done and turns[row] == 4
                                                       and rollouts.finish_reasons[row] != "length")
    assert rollouts.num_tokens == int(rollouts.response_mask.sum()) < int(rollouts.lengths.sum())


def test_the_sampled_log_probs_are_the_trainers_on_the_whole_episode(tiny):
    """Each turn was sampled from exactly the context the update sees (earlier turns as
    sampled, the environment's tokens in between): the trainer's forward over the whole row
    gives the sampler's log-probs at every model token, and nothing at the environment's."""
    rollouts, _, _ = play(tiny)
    assemble_rows = [Group(None, "", select_rows(rollouts, i, i + 3), [0.0] * 3, {},
                           [False] * 3) for i in (0, 3)]
    batch = assemble(assemble_rows, overlong_filter=False)
    with torch.no_grad():
        logp, entropy = response_logprobs(tiny[0], batch.sequences(torch.arange(6), 0),
                                          with_entropy=True)
    mask = batch.response_mask
    torch.testing.assert_close(logp[mask], batch.sampler_logp[mask], atol=2e-4, rtol=0)
    assert (logp[batch.env_mask] == 0).all() and (entropy[batch.env_mask] == 0).all()


def test_environment_tokens_carry_no_gradient_and_count_in_no_normaliser(tiny):
    """Must-show of issue 43: the environment's tokens are in the batch, yet the loss's
    gradient with respect to their log-probs is exactly zero and the token and response
    counts, and so ``loss/per_token`` and ``loss/per_response``, are over model tokens only."""
    model, _ = tiny
    rollouts, _, _ = play(tiny)
    rewards = [1.0, 0.0, 0.5, 0.0, 1.0, 0.25]
    groups = [Group(None, "", select_rows(rollouts, i, i + 3), rewards[i:i + 3], {},
                    [False] * 3) for i in (0, 3)]
    batch = assemble(groups, overlong_filter=False)
    recipe = get_recipe("dr_grpo")  # no KL term: no reference model needed
    batch.advantages, _ = compute_advantages(recipe, batch, 0.0, None)
    counts = BatchCounts.of(batch.response_mask)
    assert counts.tokens == int(batch.response_mask.sum()) == rollouts.num_tokens
    assert counts.tokens < int(batch.lengths.sum())  # the environment's are not counted
    logp, _ = response_logprobs(model, batch.sequences(torch.arange(6), 0))
    logp.retain_grad()
    inputs = PolicyLossInputs(logp, logp.detach(), batch.advantages, batch.response_mask)
    cfg = recipe.policy_loss_config(40)
    out = policy_loss(inputs, cfg, counts)
    out.loss.backward()
    assert (logp.grad[batch.env_mask] == 0).all()
    assert logp.grad[batch.response_mask].abs().sum() > 0
    # on policy every ratio is 1: the per-token objective is -A averaged over model tokens
    mask, adv = batch.response_mask, batch.advantages
    metrics = out.diagnostics.resolved().finish()
    expected_token = float(-(adv[mask]).sum() / mask.sum())
    per_row = [-(adv[i][mask[i]]).mean() for i in range(6) if mask[i].any()]
    assert metrics["loss/per_token"] == pytest.approx(expected_token, abs=1e-6)
    assert metrics["loss/per_response"] == pytest.approx(float(sum(per_row) / len(per_row)),
                                                         abs=1e-6)


def test_an_episode_stops_at_its_token_budget_as_truncated(tiny):
    rollouts, _, _ = play(tiny, max_tokens=6)
    assert int(rollouts.generated_lengths.max()) <= 6
    truncated = [r == "length" for r in rollouts.finish_reasons]
    assert any(truncated)
    for row, cut in enumerate(truncated):
        if cut:
            assert int(rollouts.generated_lengths[row]) == 6


def test_a_recipe_trains_and_evaluates_on_a_multi_turn_environment_task(tmp_path):
    """guess_number on the tiny model: episodes of several turns reach the loss, the token
    budget counts the model's tokens only, the environment's reward is logged per function
    beside another, and held-out evaluation plays episodes too."""
    from tests.train.test_trainer import REWARDS, read_metrics, tiny_config

    cfg = tiny_config(tmp_path, "dr_grpo", "task=guess_number", "stop=[e]", "max_turns=3",
                      "max_new_tokens=24", "steps=2", "eval_every=2", "eval_n=2",
                      "eval_samples=2", "log_samples=100",
                      f"rewards=[environment, {REWARDS}:length_parity]")
    from postrl.train.trainer import Trainer

    trainer = Trainer(cfg)
    before = [p.detach().clone() for p in trainer.lm.parameters()]
    trainer.train()
    rows = read_metrics(tmp_path / "dr_grpo")
    trained = [r for r in rows if "loss/total" in r]
    assert len(trained) == 2
    assert all(r["episode/turns_mean"] > 1 and r["episode/env_tokens_mean"] > 0
               for r in trained)
    assert all("reward/environment/mean" in r and "reward/length_parity/mean" in r
               for r in trained)
    assert all(r["length/max"] <= 24 for r in trained)  # the model's tokens of an episode
    samples = [json.loads(line) for line in (tmp_path / "dr_grpo" / "samples.jsonl")
               .read_text().splitlines()]
    assert "eval/accuracy" in rows[-1] and "eval/sampled_accuracy" in rows[-1]
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.lm.parameters(),
                                                      strict=True))
    assert len(samples) == 2 * 2 * 4 and all(s["length"] <= 24 for s in samples)
    # the budget counts what the model generated, not the environment's replies
    assert trained[-1]["rollout/tokens_generated"] == sum(s["length"] for s in samples)


def test_an_episode_filtered_out_of_the_loss_keeps_its_whole_context(tiny):
    """Overlong filtering masks a truncated episode's model tokens out of the loss; the
    forward still sees the episode as it was played (a prefix of each row, so packing holds)."""
    rollouts, _, _ = play(tiny, max_tokens=6)
    groups = [Group(None, "", select_rows(rollouts, i, i + 3), [0.0] * 3, {}, [False] * 3)
              for i in (0, 3)]
    batch = assemble(groups, overlong_filter=True)
    assert batch.truncated.any() and not batch.response_mask[batch.truncated].any()
    sequences = batch.sequences(torch.arange(6), 0)
    attended = sequences.attention_mask[:, sequences.prompt_width:].bool()
    width = attended.shape[1]
    assert torch.equal(attended, torch.arange(width) < batch.lengths.unsqueeze(1))
    assert torch.equal(sequences.scored, batch.response_mask[:, :width])


def test_each_steps_reward_is_placed_at_the_last_token_of_the_turn_it_answered(tiny):
    rollouts, envs, _ = play(tiny)
    placed = turn_reward_tensor(rollouts, 2.0)
    for row in range(rollouts.response_ids.shape[0]):
        n = int(rollouts.lengths[row])
        model_runs = [r for r in segments(rollouts.response_mask[row, :n].tolist()) if r[0]]
        stepped = rollouts.episodes.turn_rewards[row]
        assert len(stepped) == envs[row].turns  # a turn cut by the token budget pays nothing
        assert [p for p, _ in stepped] == [stop - 1 for _, _, stop in model_runs][:len(stepped)]
        assert all(r == 0.25 for _, r in stepped)
        assert float(placed[row].sum()) == pytest.approx(2.0 * rollouts.episodes.rewards[row])
        assert (placed[row][~rollouts.response_mask[row]] == 0).all()


def test_turn_rewards_reach_the_tokens_before_them_and_the_rest_pays_at_the_end(tiny):
    """env_reward_at=turn with REINFORCE++ (gamma 1, no whitening): a token's advantage is
    the reward still to come, the turns after it and the outcome part at the end."""
    rollouts, _, _ = play(tiny)
    placed = turn_reward_tensor(rollouts, 1.0)
    outcome = [1.0, 0.0, 0.5, 0.0, 1.0, 0.25]  # another reward function's, paid at the end
    totals = [o + r for o, r in zip(outcome, rollouts.episodes.rewards, strict=True)]
    groups = [Group(None, "", select_rows(rollouts, i, i + 3), totals[i:i + 3], {},
                    [False] * 3, turn_rewards=placed[i:i + 3, :select_rows(
                        rollouts, i, i + 3).response_ids.shape[1]]) for i in (0, 3)]
    batch = assemble(groups, overlong_filter=False)
    recipe = get_recipe("reinforce_pp").with_(whiten_advantages=False, kl_coef=0.0)
    advantages, _ = compute_advantages(recipe, batch, 0.0, None)
    mask = batch.response_mask
    for row in range(6):
        positions = mask[row].nonzero().flatten().tolist()
        to_come = placed[row].flip(0).cumsum(0).flip(0)  # the turn rewards at or after t
        for t in positions:
            assert float(advantages[row, t]) == pytest.approx(outcome[row] + float(to_come[t]))
        assert float(advantages[row, positions[0]]) == pytest.approx(totals[row])
        if len(rollouts.episodes.turn_rewards[row]) > 1:  # later turns see less to come
            assert float(advantages[row, positions[-1]]) < totals[row]
    end, _ = compute_advantages(recipe, dataclasses.replace(batch, turn_rewards=None), 0.0, None)
    for row in range(6):  # at the end: every token sees the whole episode's reward
        assert torch.allclose(end[row][mask[row]], torch.tensor(totals[row]))


def test_a_recipe_trains_with_turn_rewards_on_a_multi_turn_environment_task(tmp_path):
    """PPO (GAE) with env_reward_at=turn on guess_number with a cost per turn: the rewards
    placed turn by turn reach the batch, and are all of its rewards."""
    from postrl.train.trainer import Trainer
    from tests.train.test_trainer import tiny_config

    cfg = tiny_config(tmp_path, "ppo", "task=guess_number", "stop=[e]", "max_turns=3",
                      "max_new_tokens=24", "steps=1", "env_reward_at=turn",
                      "task_options.turn_cost=0.1",
                      "rewards=[{fn: environment, weight: 2.0}]")
    trainer = Trainer(cfg)
    seen = []
    original = trainer.phases.prepare

    def keep(batch):
        seen.append(batch)
        return original(batch)

    trainer.phases.prepare = keep
    trainer.train()
    [batch] = seen
    assert batch.turn_rewards is not None
    torch.testing.assert_close(batch.turn_rewards.sum(1), batch.rewards)  # all paid by turn
    assert (batch.turn_rewards != 0).sum() > batch.rows  # several turns paid in some rows

"""Multi-turn rollouts: the model and an environment take turns until the episode ends.

Token in, token out. Each model turn is sampled by the ordinary rollout engine from the
episode's whole context (prompt, earlier turns, observations) and kept exactly as sampled, with
its log-probs; the environment's reply is rendered by the chat template and *appended* as
tokens (``postrl.envs.turns``). Earlier turns are never re-tokenized. The episode becomes one
row of :class:`Rollouts`: model tokens under ``response_mask``, environment tokens under
``env_mask``, which the update attends to but never trains on or counts.

Limits: ``max_turns`` model turns, and ``max_tokens`` model tokens over the whole episode
(``max_new_tokens``: the same budget a single-turn response has; an episode that reaches it
is truncated, finish reason ``length``). An episode also ends when the environment says done,
or when its context would no longer fit the model's.

The first turn samples the G episodes of each prompt together (their prompt is shared); later
turns sample one continuation per running episode, each from its own context. An engine that
can keep its rows' keys and values from one call to the next (``keeping_turns``,
``postrl.rollout.kept_turns``) does so for the episodes' turns: a later turn then prefills only
the tokens after its context's kept part (the turn's last token, the reply, the next header).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch

from postrl.envs.base import Environment, Step
from postrl.envs.turns import observation_ids
from postrl.rollout.base import EpisodeStats, RolloutEngine, Rollouts, SamplingParams


@dataclass(frozen=True)
class EpisodeLimits:
    """``max_turns`` model turns; ``max_tokens`` model tokens per episode; ``max_context``
    tokens of prompt and episode together (the model's context; None: unbounded)."""

    max_turns: int
    max_tokens: int
    max_context: int | None = None

    @classmethod
    def for_model(cls, max_turns: int, max_tokens: int, model) -> EpisodeLimits:
        """The limits with ``model``'s context (``max_position_embeddings``, if it says)."""
        return cls(max_turns, max_tokens,
                   getattr(model.config, "max_position_embeddings", None))


@dataclass
class _Episode:
    """One episode being played: its tokens after the prompt, and what they are."""

    prompt: list[int]
    environment: Environment
    ids: list[int] = field(default_factory=list)
    is_model: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    turns: int = 0
    reward: float = 0.0
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)  # (last token, reward)
    tool_calls: int = 0
    tool_errors: int = 0
    env_seconds: float = 0.0
    prefilled: int | None = 0  # tokens its turns fed through a prefill (None: not reported)
    finish: str | None = None  # set when the episode is over
    out_of_turns: bool = False

    @property
    def generated(self) -> int:
        return sum(self.is_model)

    def append(self, ids: Sequence[int], model: bool, logprobs: Sequence[float] = (),
               entropies: Sequence[float] = ()) -> None:
        self.ids += ids
        self.is_model += [model] * len(ids)
        self.logprobs += list(logprobs) if model else [0.0] * len(ids)
        self.entropies += list(entropies) if model and entropies else [0.0] * len(ids)


def run_episodes(engine: RolloutEngine, tokenizer, prompt_ids: list[list[int]],
                 environments: Sequence[Environment], group_size: int,
                 params: SamplingParams, seed: int, limits: EpisodeLimits) -> Rollouts:
    """``len(prompt_ids) * group_size`` episodes, the G of each prompt adjacent, played with
    ``environments`` (one per episode, in row order)."""
    if len(environments) != len(prompt_ids) * group_size:
        raise ValueError(f"{len(environments)} environments for {len(prompt_ids)} prompts x "
                         f"{group_size} episodes")
    episodes = [_Episode(list(prompt_ids[i // group_size]), env)
                for i, env in enumerate(environments)]
    reported = True  # whether the engine reports entropies (vLLM does not)
    keeping = getattr(engine, "keeping_turns", None)
    with keeping() if keeping is not None else nullcontext():
        for turn in range(limits.max_turns):
            running = [e for e in episodes if e.finish is None]
            if not running:
                break
            budget = max(limits.max_tokens - e.generated for e in running)
            turn_params = replace(params, max_new_tokens=budget)
            turn_seed = (seed + 7919 * turn) % (2**31)
            if turn == 0:  # every episode is running: the G of a prompt share its prefill
                sampled = engine.generate(prompt_ids, group_size, turn_params, turn_seed)
            else:
                sampled = engine.generate([e.prompt + e.ids for e in running], 1, turn_params,
                                          turn_seed)
            reported = reported and sampled.entropies is not None
            for row, episode in enumerate(running):
                _count_prefill(episode, sampled, row)
                _take_turn(episode, sampled, row, tokenizer, limits,
                           last=turn + 1 == limits.max_turns)
    return _as_rollouts(episodes, group_size, tokenizer, reported)


def play_examples(engine: RolloutEngine, tokenizer, task, examples: Sequence,
                  prompt_ids: list[list[int]], group_size: int, params: SamplingParams,
                  seed: int, limits: EpisodeLimits) -> Rollouts:
    """:func:`run_episodes` with one environment per episode from ``task.environment``, the G
    episodes of each example adjacent."""
    environments = [task.environment(e) for e in examples for _ in range(group_size)]
    return run_episodes(engine, tokenizer, prompt_ids, environments, group_size, params, seed,
                        limits)


def turn_reward_tensor(rollouts: Rollouts, weight: float) -> torch.Tensor:
    """``[rows, T]``: each step's environment reward times ``weight`` at the last model token
    of the turn it answered, 0 elsewhere; a row sums to its weighted episode reward."""
    placed = torch.zeros(rollouts.response_ids.shape, dtype=torch.float32)
    for row, turns in enumerate(rollouts.episodes.turn_rewards):
        for position, reward in turns:
            placed[row, position] += weight * reward
    return placed


def _count_prefill(episode: _Episode, sampled: Rollouts, row: int) -> None:
    if episode.prefilled is not None and sampled.prefill_lengths is not None:
        episode.prefilled += int(sampled.prefill_lengths[row])
    else:
        episode.prefilled = None


def _take_turn(episode: _Episode, sampled: Rollouts, row: int, tokenizer,
               limits: EpisodeLimits, last: bool) -> None:
    """Append the model's turn ``row`` of ``sampled`` to ``episode``; unless the episode ends
    there, step its environment and append the observation."""
    room = limits.max_tokens - episode.generated
    length = int(sampled.lengths[row])
    kept = min(length, room)
    ids = sampled.response_ids[row, :kept].tolist()
    entropies = () if sampled.entropies is None else sampled.entropies[row, :kept].tolist()
    episode.append(ids, True, sampled.logprobs[row, :kept].tolist(), entropies)
    episode.turns += 1
    reason = "length" if kept < length else sampled.finish_reasons[row]
    if reason == "length" or episode.generated >= limits.max_tokens:
        episode.finish = "length"
        return
    text = sampled.texts[row]
    started = time.perf_counter()
    step = episode.environment.step(text)
    episode.env_seconds += time.perf_counter() - started
    if not isinstance(step, Step):
        raise TypeError(f"an environment's step() returned {type(step).__name__}, expected "
                        "postrl.envs.Step")
    episode.reward += float(step.reward)
    episode.turn_rewards.append((len(episode.ids) - 1, float(step.reward)))
    episode.tool_calls += step.tool_calls
    episode.tool_errors += step.tool_errors
    if step.done or last:
        episode.finish, episode.out_of_turns = reason, not step.done
        return
    reply = observation_ids(tokenizer, step.observation, step.role, after_eos=reason == "eos")
    context = len(episode.prompt) + len(episode.ids) + len(reply)
    if limits.max_context is not None and context + 1 > limits.max_context:
        episode.finish = "length"  # no room left for another turn
        return
    episode.append(reply, False)


def _as_rollouts(episodes: list[_Episode], group_size: int, tokenizer,
                 entropies_reported: bool) -> Rollouts:
    """The episodes as right-padded rows: model tokens in ``response_mask``, the
    environment's in ``env_mask``."""
    rows, width = len(episodes), max(max(len(e.ids) for e in episodes), 1)
    response_ids = torch.zeros(rows, width, dtype=torch.long)
    model = torch.zeros(rows, width, dtype=torch.bool)
    env = torch.zeros(rows, width, dtype=torch.bool)
    logprobs = torch.zeros(rows, width)
    entropies = torch.zeros(rows, width)
    for i, e in enumerate(episodes):
        n = len(e.ids)
        response_ids[i, :n] = torch.tensor(e.ids, dtype=torch.long)
        model[i, :n] = torch.tensor(e.is_model)
        env[i, :n] = ~model[i, :n]
        logprobs[i, :n] = torch.tensor(e.logprobs)
        entropies[i, :n] = torch.tensor(e.entropies)
    stats = EpisodeStats(
        turns=tuple(e.turns for e in episodes), rewards=tuple(e.reward for e in episodes),
        tool_calls=tuple(e.tool_calls for e in episodes),
        tool_errors=tuple(e.tool_errors for e in episodes),
        env_tokens=tuple(len(e.ids) - e.generated for e in episodes),
        env_seconds=tuple(e.env_seconds for e in episodes),
        out_of_turns=tuple(e.out_of_turns for e in episodes),
        turn_rewards=tuple(tuple(e.turn_rewards) for e in episodes))
    return Rollouts(
        prompt_ids=[e.prompt for e in episodes], response_ids=response_ids,
        response_mask=model, logprobs=logprobs,
        lengths=torch.tensor([len(e.ids) for e in episodes], dtype=torch.long),
        finish_reasons=[e.finish or "eos" for e in episodes],
        texts=[tokenizer.decode(e.ids, skip_special_tokens=True) for e in episodes],
        group_size=group_size, entropies=entropies if entropies_reported else None,
        env_mask=env, episodes=stats,
        prefill_lengths=(None if any(e.prefilled is None for e in episodes)
                         else torch.tensor([e.prefilled for e in episodes], dtype=torch.long)))

"""Turns that keep their cache: an episode's later turns prefill only what is new, and sample
what a full prefill of the whole context samples."""

from dataclasses import dataclass

import pytest
import torch

from postrl.envs import Step
from postrl.rollout import HFRolloutEngine, SamplingParams
from postrl.rollout.episodes import EpisodeLimits, run_episodes
from postrl.rollout.kept_turns import KeptRow, TurnCache, prefill_inputs
from postrl.tasks import build_prompt


@dataclass
class Scripted:
    """Replies with text of its own length each turn; done after the third."""

    turns: int = 0

    def step(self, response: str) -> Step:
        self.turns += 1
        return Step("No." + " again" * self.turns, reward=0.25, done=self.turns == 3)


class Forgetful:
    """The engine without ``keeping_turns``: every turn prefills its whole context."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def generate(self, *args, **kwargs):
        return self.engine.generate(*args, **kwargs)


def play(engine, tokenizer, temperature=1.0):
    prompts = [build_prompt(tokenizer, q) for q in ("Guess a word.", "Name a colour please.")]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    params = SamplingParams(temperature=temperature, max_new_tokens=40, stop=("e",))
    return run_episodes(engine, tokenizer, ids, [Scripted() for _ in range(6)], 3, params,
                        seed=3, limits=EpisodeLimits(4, 40))


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_kept_turns_sample_what_a_full_prefill_samples_and_prefill_less(tiny, lean):
    model, tokenizer = tiny
    engine = HFRolloutEngine(model, tokenizer, lean=lean)
    kept, full = play(engine, tokenizer), play(Forgetful(engine), tokenizer)
    assert max(kept.episodes.turns) >= 3  # later turns happened
    assert torch.equal(kept.response_ids, full.response_ids)
    assert torch.equal(kept.response_mask, full.response_mask)
    torch.testing.assert_close(kept.logprobs, full.logprobs, atol=2e-5, rtol=0)
    # every turn after the first fed only the turn's last token, the reply and its header
    first_turn = sum(len(p) for p in full.prompt_ids[::3])
    assert int(kept.prefill_lengths.sum()) == first_turn + sum(kept.episodes.env_tokens) + sum(
        t - 1 for t in kept.episodes.turns)
    assert (kept.prefill_lengths < full.prefill_lengths).all()


def test_the_prefill_count_without_turns_is_each_prompt_once(tiny):
    model, tokenizer = tiny
    prompts = [[5, 6, 7], [8, 9]]
    out = HFRolloutEngine(model, tokenizer).generate(prompts, 2, SamplingParams(max_new_tokens=3),
                                                     seed=0)
    assert out.prefill_lengths.tolist() == [3, 0, 2, 0]


def test_a_cache_is_kept_for_the_next_call_within_keeping_turns_only(tiny):
    model, tokenizer = tiny
    engine = HFRolloutEngine(model, tokenizer)
    params = SamplingParams(max_new_tokens=40, stop=("e",))
    prompt = [5, 6, 7]
    with engine.keeping_turns():
        first = engine.generate([prompt], 1, params, seed=0)
        assert first.finish_reasons == ["stop"]
        turn = prompt + first.response_ids[0, :int(first.lengths[0])].tolist() + [9, 10]
        second = engine.generate([turn], 1, params, seed=1)
    assert second.prefill_lengths.tolist() == [3]  # the stop token, then 9 and 10
    assert engine.generate([turn], 1, params, seed=1).prefill_lengths.tolist() == [len(turn)]


def test_a_prompt_takes_the_longest_kept_row_that_begins_it():
    cache = TurnCache()
    rows = [KeptRow((1, 2), torch.zeros(1, 1, 2, 1), torch.zeros(1, 1, 2, 1)),
            KeptRow((1, 2, 3), torch.zeros(1, 1, 3, 1), torch.zeros(1, 1, 3, 1)),
            KeptRow((4,), torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1))]
    for row in rows:
        cache.keep(row)
    matched = cache.take([[1, 2, 3, 4], [1, 2, 3], [5, 6], [4, 4]])
    # [1, 2, 3] itself would leave nothing to feed: the shorter row serves it
    assert matched == [rows[1], rows[0], None, rows[2]]
    assert cache.take([[1, 2, 3, 4]]) == [None]  # a call takes what the call before kept


def test_prefill_inputs_right_align_the_past_and_the_new_tokens():
    keys = torch.arange(4.0).reshape(1, 1, 4, 1)
    kept = KeptRow((1, 2, 3, 4), keys, -keys)
    past, ids, attention, positions = prefill_inputs([[1, 2, 3, 4, 5, 6], [7, 8]],
                                                     [kept, None], pad_id=0)
    # the first prompt has 2 new tokens, the second 2: Q = 4 kept columns, M = 2
    assert ids.tolist() == [[5, 6], [7, 8]]
    assert attention.tolist() == [[1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]]
    assert positions[:, -2:].tolist() == [[4, 5], [0, 1]]
    assert past.keys[0, 0, 0, :, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert past.keys[0, 1].abs().sum() == 0  # padding: zeros
    # a row with more new tokens than another recomputes some of the other's kept ones
    past, ids, attention, _ = prefill_inputs([[1, 2, 3, 4, 5], [1, 2, 3, 4, 9, 9, 9]],
                                             [kept, kept], pad_id=0)
    assert ids.tolist() == [[3, 4, 5], [9, 9, 9]]
    assert attention.tolist() == [[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]]
    assert past.keys[0, :, 0, :, 0].tolist() == [[0.0, 0.0, 0.0, 1.0], [0.0, 1.0, 2.0, 3.0]]

"""Sampling keyed by (seed, prompt, sample): exact draws by inversion, the same samples however
prompts are split over calls, chunks or workers, and early-finished rows dropped from the batch
without changing a single token."""

import copy

import pytest
import torch

from postrl.rollout import HFRolloutEngine, SamplingParams
from postrl.rollout import hf as hf_module
from postrl.rollout.sampling import next_tokens, row_generators, row_seed


@pytest.fixture(scope="module")
def engine(tiny):
    model, tokenizer = tiny
    return HFRolloutEngine(model, tokenizer, entropies=True)


def prompts(tokenizer):
    texts = ["What is 2 + 3?", "Name a colour, please, in one word only.", "Hi", "7 * 8 = ?"]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def test_draws_follow_the_truncated_softmax():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    logits = probs.log().expand(n, 4)
    generators = row_generators(seed=0, first_prompt=0, prompts=n, group_size=1)
    tokens, logprobs, _ = next_tokens(logits, SamplingParams(), generators)
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert (freq - probs).abs().max() < 0.015  # ~4 standard errors at n = 20000
    assert torch.allclose(logprobs, probs.log()[tokens], atol=1e-6)
    # top-k 2: the two most probable only, renormalised; log-probs stay untruncated
    tokens, logprobs, _ = next_tokens(logits, SamplingParams(top_k=2), generators)
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert freq[2:].sum() == 0 and abs(freq[0] - 0.5 / 0.8) < 0.015
    assert torch.allclose(logprobs, probs.log()[tokens], atol=1e-6)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9),
                                    SamplingParams(temperature=0)])
def test_logprobs_and_entropies_are_those_of_the_untruncated_policy(params):
    """Against float64, at logits of a real model's magnitude (~20, where float32 roundoff in
    the probabilities gets multiplied): the picked token's log-prob and the entropy."""
    torch.manual_seed(0)
    logits = torch.randn(32, 49152) * 3 + 20
    tokens, logprobs, entropies = next_tokens(logits, params, row_generators(0, 0, 32, 1))
    scaled = logits.double() / (params.temperature or 1.0)
    exact = torch.log_softmax(scaled, dim=-1)
    assert (logprobs - exact.gather(-1, tokens[:, None]).squeeze(-1)).abs().max() < 2e-5
    assert (entropies - (-(exact.exp() * exact).sum(dim=-1))).abs().max() < 5e-5


def test_row_seeds_are_stable_and_distinct():
    assert row_seed(1, 2, 3) == row_seed(1, 2, 3)
    seeds = {row_seed(s, i, j) for s in range(3) for i in range(5) for j in range(8)}
    assert len(seeds) == 3 * 5 * 8


def assert_same(a, b):
    assert a.texts == b.texts
    width = min(a.response_ids.shape[1], b.response_ids.shape[1])
    assert torch.equal(a.response_ids[:, :width], b.response_ids[:, :width])
    assert torch.equal(a.lengths, b.lengths) and a.finish_reasons == b.finish_reasons
    assert torch.allclose(a.logprobs[:, :width], b.logprobs[:, :width], atol=1e-5)
    assert (a.entropies is None) == (b.entropies is None)
    if a.entropies is not None:
        assert torch.allclose(a.entropies[:, :width], b.entropies[:, :width], atol=1e-5)


def test_samples_do_not_depend_on_how_prompts_are_split(engine):
    ids, params = prompts(engine.tokenizer), SamplingParams(max_new_tokens=10)
    whole = engine.generate(ids, 3, params, seed=11)
    first = engine.generate(ids[:1], 3, params, seed=11)
    rest = engine.generate(ids[1:], 3, params, seed=11, first_prompt=1)
    assert whole.texts == first.texts + rest.texts
    chunked = HFRolloutEngine(engine.model, engine.tokenizer, batch_size=3, entropies=True)
    assert_same(whole, chunked.generate(ids, 3, params, seed=11))
    # the key is the prompt's index: a different offset gives different samples
    shifted = engine.generate(ids[1:], 3, params, seed=11, first_prompt=0)
    assert shifted.texts != rest.texts


def test_dropping_finished_rows_changes_no_token(engine, monkeypatch):
    ids = prompts(engine.tokenizer)
    free = engine.generate(ids, 4, SamplingParams(max_new_tokens=16), seed=5)
    # stop strings taken from the samples themselves end rows at many different steps
    stops = tuple(sorted({t[3:5] for t in free.texts if len(t) >= 5}))[:6]
    params = SamplingParams(max_new_tokens=16, stop=stops)
    compacted = engine.generate(ids, 4, params, seed=5)
    assert len(set(compacted.lengths.tolist())) > 2, "rows should end at different steps"
    monkeypatch.setattr(hf_module, "COMPACT_FRACTION", 2.0)  # never drop a row
    assert_same(compacted, engine.generate(ids, 4, params, seed=5))


def test_bf16_engine_samples_from_a_fresh_bf16_copy_of_the_weights(tiny):
    model, tokenizer = copy.deepcopy(tiny[0]), tiny[1]
    engine = HFRolloutEngine(model, tokenizer, precision="bf16", lean=False)
    ids, greedy = prompts(tokenizer), SamplingParams(temperature=0, max_new_tokens=8)
    engine.generate(ids, 1, greedy, seed=0)
    with torch.no_grad():  # an "optimizer step": the next call must see it
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = engine.generate(ids, 1, greedy, seed=0)
    for mine, theirs in zip(engine._copy.parameters(), model.parameters(), strict=True):
        assert mine.dtype == torch.bfloat16 and torch.equal(mine, theirs.to(torch.bfloat16))
    by_hand = HFRolloutEngine(engine._copy, tokenizer, lean=False)
    assert_same(out, by_hand.generate(ids, 1, greedy, seed=0))
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_bf16_engine_samples_from_the_current_weights(tiny):
    model, tokenizer = copy.deepcopy(tiny[0]), tiny[1]
    engine = HFRolloutEngine(model, tokenizer, precision="bf16")  # the backend's forward or not
    ids, params = prompts(tokenizer), SamplingParams(temperature=1.0, max_new_tokens=8)
    before = engine.generate(ids, 2, params, seed=0)
    with torch.no_grad():  # an "optimizer step": the next call must see it
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    after = engine.generate(ids, 2, params, seed=0)
    assert not torch.equal(before.logprobs, after.logprobs)
    fresh = HFRolloutEngine(copy.deepcopy(model), tokenizer, precision="bf16")
    assert_same(after, fresh.generate(ids, 2, params, seed=0))

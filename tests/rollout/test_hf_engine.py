"""The HF rollout engine on the tiny model: shapes, masks, log-probs, seeding, stopping."""

import pytest
import torch

from postrl.errors import ConfigError
from postrl.models.logprobs import SequenceBatch, response_logprobs
from postrl.rollout import HFRolloutEngine, SamplingParams
from postrl.rollout.sampling import truncate_logits


@pytest.fixture(scope="module")
def engine(tiny):
    model, tokenizer = tiny
    return HFRolloutEngine(model, tokenizer)


def prompts(tokenizer):
    texts = ["What is 2 + 3?", "Name a colour, please, in one word only."]  # unequal lengths
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def test_shapes_masks_and_finish_reasons(engine):
    ids = prompts(engine.tokenizer)
    out = engine.generate(ids, 3, SamplingParams(max_new_tokens=10), seed=0)
    assert out.response_ids.shape[0] == 6 and out.group_size == 3
    assert out.prompt_ids == [ids[0]] * 3 + [ids[1]] * 3
    assert torch.equal(out.lengths, out.response_mask.sum(dim=1))
    for row, reason in zip(range(6), out.finish_reasons, strict=True):
        n = int(out.lengths[row])
        assert out.response_mask[row, :n].all() and not out.response_mask[row, n:].any()
        assert reason in ("eos", "length")
        assert (reason == "length") == (n == 10)
        if reason == "eos":
            assert int(out.response_ids[row, n - 1]) in engine.eos_ids.tolist()
    assert (out.logprobs[~out.response_mask] == 0).all()
    assert (out.logprobs[out.response_mask] < 0).all()


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_sampling_logprobs_and_entropies_match_a_teacher_forced_forward(engine, lean):
    """Both of the sampler's forwards record what the trainer's forward computes: the
    log-prob of each sampled token and the entropy at its position, of the temperature-scaled
    policy before top-k/top-p truncation."""
    engine = HFRolloutEngine(engine.model, engine.tokenizer, lean=lean, entropies=True)
    ids = prompts(engine.tokenizer)
    for params in (SamplingParams(temperature=1.0, max_new_tokens=12),
                   SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=12),
                   SamplingParams(temperature=0.0, max_new_tokens=12)):
        out = engine.generate(ids, 4, params, seed=3)
        batch = SequenceBatch.build(out.prompt_ids, out.response_ids, out.response_mask,
                                    engine.pad_id)
        with torch.no_grad():
            logp, entropy = response_logprobs(engine.model, batch, params.temperature or 1.0,
                                              with_entropy=True)
        mask = out.response_mask
        assert (logp - out.logprobs)[mask].abs().max() < 1e-4
        assert (entropy - out.entropies)[mask].abs().max() < 1e-4
        assert (out.entropies[~mask] == 0).all()
        assert out.entropies[mask].min() > 1.0  # the random tiny model: near-uniform


def test_entropies_are_recorded_only_when_asked_and_change_no_sample(engine):
    ids = prompts(engine.tokenizer)
    recording = HFRolloutEngine(engine.model, engine.tokenizer, entropies=True)
    for params in (SamplingParams(max_new_tokens=10),
                   SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=10),
                   SamplingParams(temperature=0.0, max_new_tokens=10)):
        plain, recorded = (e.generate(ids, 3, params, seed=2) for e in (engine, recording))
        assert plain.entropies is None and recorded.entropies is not None
        assert torch.equal(plain.response_ids, recorded.response_ids)
        assert (plain.logprobs - recorded.logprobs).abs().max() < 1e-5


def test_same_seed_same_samples_other_seed_other_samples(engine):
    ids = prompts(engine.tokenizer)
    params = SamplingParams(max_new_tokens=8)
    a, b = (engine.generate(ids, 4, params, seed=7) for _ in range(2))
    assert torch.equal(a.response_ids, b.response_ids) and a.texts == b.texts
    c = engine.generate(ids, 4, params, seed=8)
    assert not torch.equal(a.response_ids, c.response_ids)


def test_greedy_rows_of_one_prompt_are_identical(engine):
    ids = prompts(engine.tokenizer)
    out = engine.generate(ids, 3, SamplingParams(temperature=0, max_new_tokens=6), seed=0)
    assert torch.equal(out.response_ids[0], out.response_ids[1])
    assert torch.equal(out.response_ids[3], out.response_ids[5])


def test_stop_strings_end_a_response(engine):
    ids = prompts(engine.tokenizer)
    free = engine.generate(ids, 2, SamplingParams(max_new_tokens=12), seed=1)
    # stop on a piece of text the first response is known to produce
    piece = free.texts[0][2:4] if len(free.texts[0]) >= 4 else free.texts[0]
    out = engine.generate(ids, 2, SamplingParams(max_new_tokens=12, stop=(piece,)), seed=1)
    assert out.finish_reasons[0] == "stop" and piece in out.texts[0]
    assert out.lengths[0] <= free.lengths[0]


def test_truncation_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top2 = truncate_logits(logits, top_k=2, top_p=1.0)
    assert torch.isinf(top2[0, 2:]).all() and torch.isfinite(top2[0, :2]).all()
    # nucleus 0.7: 0.5 alone is below it, 0.5 + 0.3 reaches it -> keep two tokens
    nucleus = truncate_logits(logits, top_k=0, top_p=0.7)
    assert torch.isfinite(nucleus[0, :2]).all() and torch.isinf(nucleus[0, 2:]).all()
    # the most probable token always survives
    assert torch.isfinite(truncate_logits(logits, 0, 0.1)[0, 0])


@pytest.mark.parametrize("kwargs, option", [({"temperature": -1}, "temperature"),
                                            ({"top_p": 0}, "top_p"), ({"top_k": -1}, "top_k"),
                                            ({"max_new_tokens": 0}, "max_new_tokens")])
def test_bad_sampling_params_are_named(kwargs, option):
    with pytest.raises(ConfigError, match=option):
        SamplingParams(**kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_model_on_the_gpu_samples_there_and_returns_cpu_rollouts(tiny, precision):
    """On a GPU the engine samples with transformers' forward (the lean one is CPU-only); its
    recorded log-probs are those of the same weights teacher-forced on the CPU."""
    import copy

    model, tokenizer = tiny
    engine = HFRolloutEngine(copy.deepcopy(model).to("cuda"), tokenizer, precision=precision)
    assert engine.fast is None
    ids = prompts(tokenizer)
    params = SamplingParams(temperature=0.7, top_k=20, max_new_tokens=12)
    out = engine.generate(ids, 4, params, seed=3)
    assert {t.device.type for t in (out.response_ids, out.response_mask, out.logprobs,
                                    out.lengths)} == {"cpu"}
    assert torch.equal(out.lengths, out.response_mask.sum(dim=1))
    batch = SequenceBatch.build(out.prompt_ids, out.response_ids, out.response_mask,
                                engine.pad_id)
    with torch.no_grad():
        logp, _ = response_logprobs(model, batch, params.temperature)
    tolerance = 1e-4 if precision == "fp32" else 0.1  # bf16 samples from rounded weights
    assert (logp - out.logprobs)[out.response_mask].abs().max() < tolerance
    again = engine.generate(ids, 4, params, seed=3)
    assert torch.equal(out.response_ids, again.response_ids)

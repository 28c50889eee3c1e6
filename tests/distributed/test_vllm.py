"""The vllm rollout backend. On a machine without an NVIDIA GPU and vLLM only the lazy import
and its error are checked; the engine tests skip, saying why (tests/rollout/test_vllm_contract.py
checks the engine's side of its contract with vLLM against a fake ``vllm`` anywhere)."""

import importlib.util

import pytest
import torch

from postrl.errors import ConfigError
from postrl.models import load_policy
from postrl.rollout import SamplingParams
from postrl.rollout.vllm import VLLMOptions, VLLMRolloutEngine, sample_seed
from postrl.train.distributed.rollout import cat_rollouts, prompt_slices
from postrl.train.distributed.weights import trainable_state

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_gpu = pytest.mark.skipif(not (HAS_VLLM and torch.cuda.is_available()),
                               reason="the vllm backend needs vLLM and an NVIDIA GPU")
SMALL = VLLMOptions(gpu_memory_utilization=0.2)  # two engines of the tiny model share the GPU


def test_sample_seeds_depend_on_the_prompt_index_only():
    seeds = {sample_seed(3, prompt, sample) for prompt in range(10) for sample in range(8)}
    assert len(seeds) == 80 and all(0 <= s < 2**31 for s in seeds)
    assert sample_seed(3, 4, 1) == sample_seed(3, 4, 1) != sample_seed(4, 4, 1)


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed")
def test_without_vllm_the_engine_says_how_to_install_it(tiny):
    model, tokenizer = tiny
    with pytest.raises(ConfigError, match=r"rollout_backend=vllm needs vLLM: pip install"):
        VLLMRolloutEngine("unused", tokenizer)


@pytest.fixture(scope="module")
def engine():
    model, tokenizer = load_policy("tiny", seed=0)
    return VLLMRolloutEngine.from_policy(model, tokenizer, options=SMALL)


@needs_gpu
def test_rollouts_follow_the_protocol_and_do_not_depend_on_the_split(engine):
    prompts = [engine.tokenizer(f"{a} + {a} =").input_ids for a in range(5)]
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    whole = engine.generate(prompts, 3, params, seed=5)
    assert whole.response_ids.shape[0] == 15 and whole.group_size == 3
    assert torch.equal(whole.response_mask.sum(dim=1), whole.lengths)
    assert set(whole.finish_reasons) <= {"eos", "length", "stop"}
    assert (whole.logprobs[whole.response_mask] <= 0).all()
    parts = [engine.generate(prompts[a:b], 3, params, seed=5, first_prompt=a)
             for a, b in prompt_slices(5, 2)]
    assert cat_rollouts(parts, engine.pad_id).texts == whole.texts


@needs_gpu
def test_load_weights_makes_the_engine_sample_the_new_policy(engine):
    other, tokenizer = load_policy("tiny", seed=1)
    fresh = VLLMRolloutEngine.from_policy(other, tokenizer, options=SMALL)
    prompts = [tokenizer("1 + 1 =").input_ids]
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    before = engine.generate(prompts, 4, params, seed=9)
    engine.load_weights(trainable_state(other))
    after = engine.generate(prompts, 4, params, seed=9)
    assert after.texts == fresh.generate(prompts, 4, params, seed=9).texts != before.texts

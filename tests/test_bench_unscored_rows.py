"""bench/unscored_rows_ab.py times the sampler with and without the entropy; its copy
without the entropy must draw the same tokens with the same log-probs, or the A/B would
time two different samplers."""

import pytest
import torch

from postrl.rollout import SamplingParams
from postrl.rollout.sampling import next_tokens, row_generators
from tests.bench_scripts import load_bench_script


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_k=50,
                                                                     top_p=0.9),
                                    SamplingParams(temperature=0)])
def test_the_sampler_without_entropy_draws_what_the_sampler_draws(params):
    without_entropy = load_bench_script("unscored_rows_ab").without_entropy
    torch.manual_seed(0)
    logits = torch.randn(16, 49152) * 3 + 20
    tokens, logprobs, entropies = next_tokens(logits, params, row_generators(3, 0, 16, 1))
    plain_tokens, plain_logprobs, zeros = without_entropy(logits, params,
                                                          row_generators(3, 0, 16, 1))
    assert torch.equal(tokens, plain_tokens)
    torch.testing.assert_close(logprobs, plain_logprobs, atol=2e-5, rtol=0)
    assert (entropies > 0).all() and not zeros.any()

"""bench/prompt_pass_ab.py sets postrl's one pass of prompts and packed responses against the
two passes it replaced; both must compute the same log-probs and gradients, or the A/B would
time two different things."""

import pytest
import torch

import postrl.models.logprobs as lp
from tests.bench_scripts import load_bench_script
from tests.models.test_layers import shared_batch


@pytest.fixture(scope="module")
def prompt_pass_ab():
    module = load_bench_script("prompt_pass_ab")
    yield module
    module.use(True)


def test_one_pass_and_two_passes_give_the_same_logprobs_and_gradients(prompt_pass_ab, tiny):
    model, tokenizer = tiny
    batch = shared_batch(tokenizer)
    calls = []
    results = {}
    for one_pass in (True, False):
        prompt_pass_ab.use(one_pass)
        spied = lp._OwnLayers.forward_with_prompts

        def spy(self, *args, spied=spied, one_pass=one_pass, **kwargs):
            calls.append(one_pass)
            return spied(self, *args, **kwargs)

        lp._OwnLayers.forward_with_prompts = spy
        model.zero_grad(set_to_none=True)
        logp, _ = lp.response_logprobs(model, batch)
        (logp * torch.arange(1, 7)[:, None]).sum().backward()
        results[one_pass] = logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    prompt_pass_ab.use(True)
    model.zero_grad(set_to_none=True)
    assert calls == [True, False]  # each way took the packed path once
    assert lp._OwnLayers.forward_with_prompts is prompt_pass_ab.ONE_PASS
    (one_logp, one_grads), (two_logp, two_grads) = results[True], results[False]
    torch.testing.assert_close(one_logp, two_logp, atol=1e-5, rtol=0)
    for name, grad in one_grads.items():
        scale = max(1.0, float(two_grads[name].abs().max()))
        torch.testing.assert_close(grad, two_grads[name], atol=1e-5 * scale, rtol=0, msg=name)

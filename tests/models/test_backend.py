"""The seam between the algorithm and its speed-ups (postrl.models.backend): which backend is
chosen, what PyTorch's own computes, and that without one the sampler records nothing."""

import importlib.util

import pytest
import torch

from postrl.errors import ConfigError
from postrl.models import backend, ops
from postrl.models.vocab import logprob_and_entropy
from postrl.rollout import HFRolloutEngine, SamplingParams

HAS_ACCEL = importlib.util.find_spec("postrl.accel") is not None


@pytest.fixture
def restore_backend():
    before = backend._active
    yield
    backend._active = before


def test_torch_is_pytorchs_operations(restore_backend):
    chosen = backend.use("torch")
    assert type(chosen) is backend.Backend and backend.active() is chosen
    assert chosen.name == "torch" and chosen.reason() is None
    x, weight = torch.randn(3, 8), torch.randn(8)
    torch.testing.assert_close(chosen.rms_norm(x, weight, 1e-6),
                               weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    logits, targets = torch.randn(4, 11), torch.tensor([0, 3, 10, 5])
    logp, entropy = chosen.logprob_and_entropy(logits, targets, 0.7, False, True)
    want_logp, want_entropy = logprob_and_entropy(logits, targets, 0.7)
    assert torch.equal(logp, want_logp) and torch.equal(entropy, want_entropy)
    assert not chosen.draws(logits)


def test_auto_takes_the_installed_backend_and_an_unknown_one_is_refused(restore_backend):
    assert backend.use("auto").name == ("postrl.accel" if HAS_ACCEL else "torch")
    with pytest.raises(ConfigError, match="backend=postrl.nothing: cannot import"):
        backend.use("postrl.nothing")


def test_first_use_chooses_the_default(restore_backend):
    backend._active = None
    assert backend.active().name == ("postrl.accel" if HAS_ACCEL else "torch")


def test_a_known_linear_returns_its_value_and_the_linears_gradients():
    """The sampler's recorded output stands in for the product; the backward is the plain
    linear's, for the input, the weight and the bias."""
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, dtype=torch.float64, requires_grad=True)
    output = torch.nn.functional.linear(x, weight, bias).detach() + 1e-9  # "recorded"
    grad = torch.randn(5, 4, dtype=torch.float64)
    known = ops.KnownLinear.apply(x, weight, bias, output)
    assert torch.equal(known, output)
    known.backward(grad)
    got = [t.grad.clone() for t in (x, weight, bias)]
    for t in (x, weight, bias):
        t.grad = None
    torch.nn.functional.linear(x, weight, bias).backward(grad)
    for mine, theirs in zip(got, (x.grad, weight.grad, bias.grad), strict=True):
        torch.testing.assert_close(mine, theirs)


def test_without_a_backend_the_sampler_is_transformers_and_records_nothing(tiny,
                                                                          restore_backend):
    model, tokenizer = tiny
    backend.use("torch")
    engine = HFRolloutEngine(model, tokenizer, record_forward=True)
    assert engine.fast is None
    ids = [tokenizer("What is 2 + 3?", add_special_tokens=False).input_ids]
    rollouts = engine.generate(ids, 2, SamplingParams(temperature=1.0, max_new_tokens=6), 0)
    assert rollouts.recorded is None and rollouts.response_ids.shape[0] == 2

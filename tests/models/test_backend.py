"""The seam between the algorithm and its speed-ups (postrl.models.backend): which backend is
chosen, what PyTorch's own computes, and that without one the sampler keeps nothing of its
forward and the update reads nothing of it."""

import importlib.util

import pytest
import torch

from postrl.errors import ConfigError
from postrl.models import backend
from postrl.models.vocab import logprob_and_entropy
from postrl.rollout import HFRolloutEngine, SamplingParams

HAS_ACCEL = importlib.util.find_spec("postrl.accel") is not None


@pytest.fixture
def restore_backend(monkeypatch):
    """The active backend, put back after the test (``use`` replaces it)."""
    monkeypatch.setattr(backend, "_active", backend._active)


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


def test_first_use_chooses_the_default(monkeypatch):
    monkeypatch.setattr(backend, "_active", None)
    assert backend.active().name == ("postrl.accel" if HAS_ACCEL else "torch")


def test_pytorchs_backend_keeps_nothing_and_multiplies_every_linear(restore_backend):
    chosen = backend.use("torch")
    x, weights = torch.randn(5, 6), [torch.randn(4, 6), torch.randn(3, 6)]
    outputs = chosen.linears(x, weights, [torch.randn(4), None])
    torch.testing.assert_close(outputs[1], x @ weights[1].T)
    assert chosen.kept_forward(torch.nn.Linear(2, 2), None) is None
    assert chosen.kept(x, weights) is None
    assert all(type(c).__name__ == "nullcontext" for c in chosen.recompute_contexts())


def test_without_a_backend_the_sampler_is_transformers_and_records_nothing(tiny,
                                                                          restore_backend):
    model, tokenizer = tiny
    backend.use("torch")
    engine = HFRolloutEngine(model, tokenizer, record_forward=True)
    assert engine.fast is None
    ids = [tokenizer("What is 2 + 3?", add_special_tokens=False).input_ids]
    rollouts = engine.generate(ids, 2, SamplingParams(temperature=1.0, max_new_tokens=6), 0)
    assert rollouts.kept_rows is None and rollouts.response_ids.shape[0] == 2

"""postrl's native sampling step (``sample.c``): the untruncated draw of
``postrl.rollout.sampling`` by inversion, its log-probability and the entropy, against the
PyTorch path and against exact float64 inverse-CDF draws; and which draws use it."""

import math

import pytest
import torch

from postrl.accel import library, native
from postrl.rollout import SamplingParams
from postrl.rollout.sampling import next_tokens, row_generators, uniforms

needs_native = pytest.mark.skipif(native.native_kernels() is None,
                                  reason=f"no native kernels: {native.unavailable_reason()}")


def pytorch_draw(monkeypatch, logits, params, generators, with_entropy=True):
    with monkeypatch.context() as switched:
        switched.setenv(library.SWITCH, "0")
        return next_tokens(logits, params, generators, with_entropy)


@needs_native
@pytest.mark.parametrize("vocab", [49152, 1007, 16, 7, 1])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("rows", [1, 32])
def test_it_draws_the_tokens_the_pytorch_path_draws(monkeypatch, vocab, temperature, rows):
    """Same tokens from the same per-row generators; log-probs and entropies to float
    rounding (the PyTorch path rounds each probability to float32, this one does not)."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
    params = SamplingParams(temperature=temperature, max_new_tokens=8)
    seed = vocab + rows
    tokens, logprobs, entropies = next_tokens(logits, params, row_generators(seed, 0, rows, 1))
    expected = pytorch_draw(monkeypatch, logits, params, row_generators(seed, 0, rows, 1))
    assert torch.equal(tokens, expected[0])
    torch.testing.assert_close(logprobs, expected[1], rtol=0, atol=2e-5)
    torch.testing.assert_close(entropies, expected[2], rtol=0, atol=2e-5)
    # without the entropy: the same draw, no entropy
    again = next_tokens(logits, params, row_generators(seed, 0, rows, 1), with_entropy=False)
    assert torch.equal(again[0], tokens) and torch.equal(again[1], logprobs)
    assert again[2] is None


def exact_draw(probabilities: list[float], u: float) -> int:
    """The first token whose float64 cumulative probability exceeds ``u``."""
    mass = 0.0
    for token, p in enumerate(probabilities):
        mass += p
        if mass > u:
            return token
    raise AssertionError("u >= 1")


@needs_native
@pytest.mark.parametrize("probabilities", [[0.1, 0.25, 0.0, 0.4, 0.25],
                                          [0.0, 0.0, 0.5, 0.5, 0.0],
                                          [0.05] * 20,
                                          [0.0] * 37 + [1.0] + [0.0] * 10])
def test_it_inverts_the_exact_cumulative_distribution(probabilities):
    """Draws on a grid of uniforms (kept away from the boundaries by 1e-6) and at its ends: the
    exact float64 inverse-CDF token, never one of probability 0; log p of it."""
    logits = torch.tensor([math.log(p) if p else -math.inf for p in probabilities])
    cdf = torch.tensor(probabilities, dtype=torch.float64).cumsum(0)
    grid = [(k + 0.5) / 997 for k in range(997)]
    grid = [u for u in grid if (cdf - u).abs().min() > 1e-6] + [0.0, 1.0 - 1e-15]
    draws = torch.tensor(grid, dtype=torch.float64)
    tokens, logprobs, entropies = native.native_kernels().sample(
        logits.expand(len(grid), -1), 1.0, draws, with_entropy=True)
    assert tokens.tolist() == [exact_draw(probabilities, u) for u in grid]
    assert all(probabilities[t] > 0 for t in tokens.tolist())
    expected = torch.tensor([math.log(probabilities[t]) for t in tokens.tolist()])
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-6)
    entropy = -sum(p * math.log(p) for p in probabilities if p)
    torch.testing.assert_close(entropies, torch.full((len(grid),), entropy), rtol=0, atol=1e-6)


@needs_native
def test_a_row_of_tokens_at_minus_infinity_keeps_a_finite_entropy():
    """Logits of -inf (probability 0) weigh nothing, in the draw and in the entropy."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 300, generator=generator)
    logits[:, ::3] = -math.inf
    draws = torch.rand(4, dtype=torch.float64, generator=generator)
    tokens, logprobs, entropies = native.native_kernels().sample(logits, 0.8, draws, True)
    assert (tokens % 3 != 0).all() and torch.isfinite(logprobs).all()
    finite = (logits[:, 1::3], logits[:, 2::3])
    p = torch.softmax(torch.cat(finite, dim=1).double() / 0.8, dim=-1)
    torch.testing.assert_close(entropies.double(), -(p * p.log()).sum(-1), rtol=0, atol=1e-5)


@needs_native
def test_only_untruncated_draws_use_it(monkeypatch):
    calls = []
    sample = native.NativeKernels.sample
    monkeypatch.setattr(native.NativeKernels, "sample",
                        lambda self, *args: calls.append(args) or sample(self, *args))
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    for params, used in ((SamplingParams(temperature=1.0), True),
                         (SamplingParams(temperature=1.0, top_k=50), True),  # keeps them all
                         (SamplingParams(temperature=1.0, top_k=5), False),
                         (SamplingParams(temperature=1.0, top_p=0.9), False),
                         (SamplingParams(temperature=0.0), False)):
        calls.clear()
        next_tokens(logits, params, row_generators(0, 0, 3, 1))
        assert bool(calls) is used, params


@needs_native
def test_it_refuses_what_it_cannot_draw_from():
    kernels = native.native_kernels()
    draws = uniforms(row_generators(0, 0, 2, 1)).flatten()
    with pytest.raises(ValueError, match="native sample"):
        kernels.sample(torch.randn(2, 10, dtype=torch.float64), 1.0, draws, True)
    with pytest.raises(ValueError, match="native sample"):
        kernels.sample(torch.randn(2, 10), 0.0, draws, True)
    with pytest.raises(ValueError, match="native sample"):
        kernels.sample(torch.randn(3, 10), 1.0, draws, True)

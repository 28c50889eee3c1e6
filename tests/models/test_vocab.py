"""The fused log-prob + entropy of postrl.models.vocab against autograd through the textbook
formulas, and its hand-written backward against finite differences; the native kernel
(``vocab.c``) against the PyTorch path."""

import pytest
import torch

from postrl.models import fused
from postrl.models.vocab import logprob_and_entropy
from postrl.rollout import native

needs_native = pytest.mark.skipif(native.native_kernels() is None,
                                  reason=f"no native kernels: {native.unavailable_reason()}")


def textbook(logits, targets, temperature):
    z = logits.float() / temperature
    log_probs = torch.log_softmax(z, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, targets[:, None]).squeeze(-1), entropy


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_backward_matches_finite_differences(entropy_grad):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, dtype=torch.float64, generator=generator, requires_grad=True)
    targets = torch.randint(0, 11, (5,), generator=generator)

    def outputs(z):
        logp, entropy = logprob_and_entropy(z, targets, 0.7, entropy_grad)
        return (logp, entropy) if entropy_grad else logp

    assert torch.autograd.gradcheck(outputs, (logits,))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_and_gradients_match_autograd_through_log_softmax(temperature):
    generator = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(7, 300, generator=generator)).requires_grad_()
    targets = torch.randint(0, 300, (7,), generator=generator)
    weights = torch.randn(7, generator=generator)
    bonus = torch.randn(7, generator=generator)

    logp, entropy = logprob_and_entropy(logits, targets, temperature, entropy_grad=True)
    (weights * logp + bonus * entropy).sum().backward()
    fused = logits.grad.clone()
    logits.grad = None
    want_logp, want_entropy = textbook(logits, targets, temperature)
    (weights * want_logp + bonus * want_entropy).sum().backward()

    torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused, logits.grad, atol=1e-6, rtol=1e-5)


def test_bf16_logits_reduce_in_float32_and_give_bf16_gradients():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 1000, generator=generator).bfloat16().requires_grad_()
    targets = torch.randint(0, 1000, (4,), generator=generator)
    logp, entropy = logprob_and_entropy(logits, targets)
    assert logp.dtype == entropy.dtype == torch.float32 and not entropy.requires_grad
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    want, _ = textbook(logits.detach(), targets, 1.0)
    torch.testing.assert_close(logp, want, atol=1e-5, rtol=1e-5)


def test_without_entropy_gives_the_same_log_probs_and_gradients_and_no_entropy():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 200, generator=generator).requires_grad_()
    targets = torch.randint(0, 200, (6,), generator=generator)
    logp, entropy = logprob_and_entropy(logits, targets, 0.8, with_entropy=False)
    assert entropy is None
    logp.sum().backward()
    alone = logits.grad.clone()
    logits.grad = None
    both, _ = logprob_and_entropy(logits, targets, 0.8)
    both.sum().backward()
    torch.testing.assert_close(logp, both)
    torch.testing.assert_close(alone, logits.grad)


def pytorch_path(monkeypatch, *args, **kwargs):
    with monkeypatch.context() as switched:
        switched.setattr(fused, "native", lambda *tensors: None)
        return run_with_gradient(*args, **kwargs)


def run_with_gradient(logits, targets, temperature, entropy_grad, weights, bonus):
    logits = logits.detach().clone().requires_grad_()
    logp, entropy = logprob_and_entropy(logits, targets, temperature, entropy_grad)
    loss = (weights * logp).sum() + ((bonus * entropy).sum() if entropy_grad else 0)
    loss.backward()
    return logp, entropy, logits.grad


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_native_kernel_matches_the_pytorch_path(monkeypatch, dtype, temperature, entropy_grad):
    """``vocab.c`` against the float32 PyTorch path: a vocabulary not a multiple of 16, a
    masked (-inf) logit, rows read with a stride (a slice of wider rows)."""
    generator = torch.Generator().manual_seed(4)
    wide = (4 * torch.randn(9, 1030, generator=generator)).to(dtype)
    wide[2, 5] = float("-inf")
    logits = wide[:, :1003]  # rows 1,030 apart
    targets = torch.randint(0, 1003, (9,), generator=generator)
    targets[2] = 6
    weights, bonus = torch.randn(9, generator=generator), torch.randn(9, generator=generator)
    args = (logits, targets, temperature, entropy_grad, weights, bonus)
    logp, entropy, grad = run_with_gradient(*args)
    want_logp, want_entropy, want_grad = pytorch_path(monkeypatch, *args)
    assert grad.dtype == dtype and logp.dtype == torch.float32
    torch.testing.assert_close(logp, want_logp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, atol=2e-5, rtol=1e-5)
    assert grad[2, 5] == 0 and torch.isfinite(grad).all()
    # the kernel scales by 1 / temperature where PyTorch divides (an ulp of z, times the
    # entropy term's z - lse + H); in bf16 it rounds its float32 gradient once, as PyTorch does
    tolerance = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-6,
                                                                            "rtol": 2 ** -7}
    torch.testing.assert_close(grad, want_grad, **tolerance)


@needs_native
def test_native_kernel_takes_an_empty_chunk():
    logits = torch.zeros(0, 50, requires_grad=True)
    logp, entropy = logprob_and_entropy(logits, torch.zeros(0, dtype=torch.long))
    assert logp.shape == entropy.shape == (0,)
    logp.sum().backward()
    assert logits.grad.shape == (0, 50)

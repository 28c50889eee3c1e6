"""The fused log-prob + entropy of postrl.models.vocab against autograd through the textbook
formulas, and its hand-written backward against finite differences (the native kernel's
tests: tests/accel/test_vocab.py)."""

import pytest
import torch

from postrl.models import vocab
from postrl.models.vocab import logprob_and_entropy


def textbook(logits, targets, temperature):
    z = logits.float() / temperature
    log_probs = torch.log_softmax(z, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, targets[:, None]).squeeze(-1), entropy


@pytest.fixture(params=["one block", "blocks of two rows"])
def blocks(request, monkeypatch):
    """The entropy's row blocks: all rows at once, or two at a time (a partial block last)."""
    if request.param != "one block":
        monkeypatch.setattr(vocab, "BLOCK_ELEMENTS", 2 * 300)
    return request.param


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_backward_matches_finite_differences(entropy_grad, blocks):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, dtype=torch.float64, generator=generator, requires_grad=True)
    targets = torch.randint(0, 300, (5,), generator=generator)

    def outputs(z):
        logp, entropy = logprob_and_entropy(z, targets, 0.7, entropy_grad)
        return (logp, entropy) if entropy_grad else logp

    assert torch.autograd.gradcheck(outputs, (logits,))


@pytest.mark.parametrize("consume", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_and_gradients_match_autograd_through_log_softmax(temperature, consume, blocks):
    """``consume``: the gradient written over the probabilities kept for the backward."""
    generator = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(7, 300, generator=generator)).requires_grad_()
    targets = torch.randint(0, 300, (7,), generator=generator)
    weights = torch.randn(7, generator=generator)
    bonus = torch.randn(7, generator=generator)

    logp, entropy = logprob_and_entropy(logits, targets, temperature, entropy_grad=True,
                                        consume_logits=consume)
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


def test_masked_logits_add_nothing_to_the_entropy_or_its_gradient(blocks):
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 300, generator=generator)
    logits[:, :40] = float("-inf")  # tokens a sampler may never draw
    logits.requires_grad_()
    targets = torch.randint(40, 300, (5,), generator=generator)
    logp, entropy = logprob_and_entropy(logits, targets, entropy_grad=True)
    (logp + entropy).sum().backward()
    want_logp, want_entropy = textbook(logits.detach()[:, 40:], targets - 40, 1.0)
    torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-5, rtol=1e-5)
    assert torch.all(logits.grad[:, :40] == 0) and torch.isfinite(logits.grad).all()


def test_a_second_backward_through_consumed_logits_is_refused_and_twice_is_fine_without():
    logits, targets = torch.randn(3, 40, requires_grad=True), torch.tensor([1, 2, 3])
    grads = []
    for consume in (False, True):
        logp, _ = logprob_and_entropy(logits, targets, consume_logits=consume)
        logp.sum().backward(retain_graph=True)
        grads.append(logits.grad.clone())
        if consume:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                logp.sum().backward()
        else:
            logp.sum().backward()
            torch.testing.assert_close(logits.grad, 2 * grads[0])
        logits.grad = None
    torch.testing.assert_close(grads[1], grads[0], atol=0, rtol=0)

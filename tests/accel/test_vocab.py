"""The native kernel of the vocabulary's log-probability and entropy (``vocab.c``) against
PyTorch's path (postrl.models.vocab)."""

import pytest
import torch

from postrl.accel import native, vocab
from postrl.models.vocab import logprob_and_entropy as pytorch_logprob_and_entropy

needs_native = pytest.mark.skipif(native.native_kernels() is None,
                                  reason=f"no native kernels: {native.unavailable_reason()}")


def logprob_and_entropy(logits, targets, temperature=1.0, entropy_grad=False,
                        with_entropy=True):
    assert vocab.serves(logits, targets)
    return vocab.logprob_and_entropy(logits, targets, temperature, entropy_grad, with_entropy)


def pytorch_path(*args):
    return run_with_gradient(*args, function=pytorch_logprob_and_entropy)


def run_with_gradient(logits, targets, temperature, entropy_grad, weights, bonus,
                      function=logprob_and_entropy):
    logits = logits.detach().clone().requires_grad_()
    logp, entropy = function(logits, targets, temperature, entropy_grad)
    loss = (weights * logp).sum() + ((bonus * entropy).sum() if entropy_grad else 0)
    loss.backward()
    return logp, entropy, logits.grad


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_native_kernel_matches_the_pytorch_path(dtype, temperature, entropy_grad):
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
    want_logp, want_entropy, want_grad = pytorch_path(*args)
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


@needs_native
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("strided", [False, True])
def test_overwritten_logits_hold_their_gradient_and_a_view_is_left_alone(entropy_grad, strided):
    """``consume_logits``: the backward writes the gradient over the logits it kept (the
    same values as without), except where the logits are rows of a wider tensor, which the
    kernel's gradient layout does not match: those are left as they are."""
    generator = torch.Generator().manual_seed(5)
    wide = 4 * torch.randn(6, 520 if strided else 517, generator=generator)
    targets = torch.randint(0, 517, (6,), generator=generator)
    weights, bonus = torch.randn(6, generator=generator), torch.randn(6, generator=generator)
    grads, outputs = [], []
    for overwrite in (False, True):
        leaf = wide.clone().requires_grad_()
        logits = (leaf * 1.0)[:, :517]  # a product keeps nothing for its backward
        logp, entropy = vocab.logprob_and_entropy(logits, targets, 0.7, entropy_grad, True,
                                                  overwrite)
        (weights * logp + (bonus * entropy if entropy_grad else 0)).sum().backward()
        grads.append(leaf.grad[:, :517])
        outputs.append(logits.detach())
    torch.testing.assert_close(grads[1], grads[0], atol=0, rtol=0)
    assert torch.equal(outputs[0], wide[:, :517])
    if strided:
        assert torch.equal(outputs[1], wide[:, :517])
    else:
        assert torch.equal(outputs[1], grads[0])


@needs_native
def test_a_second_backward_through_overwritten_logits_is_refused():
    leaf = torch.randn(3, 40, requires_grad=True)
    logp, _ = vocab.logprob_and_entropy(leaf * 1.0, torch.tensor([1, 2, 3]), 1.0, False, False,
                                        True)
    logp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        logp.sum().backward()

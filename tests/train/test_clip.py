"""``postrl.train.update.clip_gradients`` against ``torch.nn.utils.clip_grad_norm_`` on the
gradients of a real backward (the tiny model, real tokens)."""

import copy

import pytest
import torch

from postrl.train.update import clip_gradients


def backward(tiny, dtype=torch.float32):
    """A copy of the tiny model in ``dtype`` after one backward of its language-model loss
    on a sentence."""
    model, tokenizer = tiny
    model = copy.deepcopy(model).to(dtype)
    ids = tokenizer("The cat sat on the mat, and then it slept.", return_tensors="pt").input_ids
    model(input_ids=ids, labels=ids).loss.backward()
    return model


@pytest.fixture
def with_gradients(tiny):
    return backward(tiny)


@pytest.mark.parametrize("max_norm", [1e-3, 0.5, 1e9, float("inf")])
def test_it_is_pytorchs_clip(with_gradients, max_norm):
    """The same norm (to float32 summation order) and the same gradients after; left alone,
    bit for bit, when the norm is within ``max_norm``."""
    ours = [p for p in with_gradients.parameters() if p.requires_grad]
    theirs = [copy.deepcopy(p) for p in ours]
    for mine, other in zip(ours, theirs, strict=True):
        other.grad = mine.grad.clone()
    before = [p.grad.clone() for p in ours]
    norm = clip_gradients(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)
    clipped = float(expected) > max_norm
    assert clipped == (max_norm < 1.0)  # the tiny model's norm lies between the cases
    for mine, other, old in zip(ours, theirs, before, strict=True):
        torch.testing.assert_close(mine.grad, other.grad, rtol=1e-5, atol=1e-12)
        if not clipped:
            assert torch.equal(mine.grad, old)


def test_other_gradients_go_to_pytorchs_clip(tiny):
    """bf16 gradients (and anything else not dense float32 on the CPU) take PyTorch's path,
    with its result."""
    params = [p for p in backward(tiny, torch.bfloat16).parameters() if p.requires_grad]
    theirs = [copy.deepcopy(p) for p in params]
    for mine, other in zip(params, theirs, strict=True):
        other.grad = mine.grad.clone()
    norm = clip_gradients(params, 1e-3)
    assert norm.dtype == torch.bfloat16
    assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(theirs, 1e-3))
    for mine, other in zip(params, theirs, strict=True):
        assert torch.equal(mine.grad, other.grad)


def test_a_non_finite_norm_leaves_the_gradients_for_the_guard(with_gradients):
    params = [p for p in with_gradients.parameters() if p.requires_grad]
    params[0].grad[0, 0] = float("nan")
    before = [p.grad.clone() for p in params[1:]]
    assert not torch.isfinite(clip_gradients(params, 1.0))
    for p, old in zip(params[1:], before, strict=True):  # the update skips this step anyway
        assert torch.equal(p.grad, old)

"""The backend (``postrl.accel.AccelBackend``) hands the training forward's float32 tensors to
postrl's kernels rather than to PyTorch's operations beside them (which compute the same values,
so only the backward graph tells the two apart): each output's backward is the kernel's own,
and its value PyTorch's backend's."""

import pytest
import torch

from postrl import accel
from postrl.accel import fused, native, vocab
from postrl.models.backend import Backend

needs_native = pytest.mark.skipif(native.native_kernels() is None,
                                  reason=f"no native kernels: {native.unavailable_reason()}")


def backward_functions(t: torch.Tensor) -> set[type]:
    """The autograd functions of every node of ``t``'s backward graph (built-in nodes: None)."""
    functions, seen, todo = set(), set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        functions.add(getattr(node, "_forward_cls", None))
        todo.extend(child for child, _ in node.next_functions)
    return functions


@needs_native
def test_the_training_forward_reaches_the_kernels_with_pytorchs_values():
    generator = torch.Generator().manual_seed(0)

    def randn(*shape, grad=False):
        return torch.randn(*shape, generator=generator).requires_grad_(grad)

    x, weight = randn(4, 32, grad=True), randn(32).abs() + 0.5
    gate, up = randn(4, 64, grad=True), randn(4, 64, grad=True)
    query, keys, values = randn(2, 4, 3, 8, grad=True), randn(2, 2, 5, 8), randn(2, 2, 5, 8)
    bias = torch.zeros(2, 1, 3, 5)
    bias[1, :, :, :2] = torch.finfo(torch.float32).min  # left padding, masked out
    angles = torch.rand(2, 1, 3, 8, generator=generator) * 6
    logits, targets = randn(3, 40, grad=True), torch.tensor([1, 2, 3])
    outputs = [  # the kernel's autograd function, and the backend's call that should reach it
        (fused._RMSNorm, lambda b: b.rms_norm(x, weight, 1e-5)),
        (fused._SwiGLU, lambda b: b.swiglu(gate, up)),
        (fused._Rotate, lambda b: b.rotate(query, angles.cos(), angles.sin())),
        (fused._Softmax, lambda b: b.attention(query, keys, values, bias, 8 ** -0.5)),
        (vocab._LogProbEntropy,
         lambda b: b.logprob_and_entropy(logits, targets, 0.7, False, True)[0]),
    ]
    ours, pytorchs = accel.backend(), Backend()
    for kernel, output in outputs:
        got, expected = output(ours), output(pytorchs)
        assert kernel in backward_functions(got), kernel
        assert kernel not in backward_functions(expected), kernel
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=kernel.__name__)

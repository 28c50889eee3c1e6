"""The vocabulary's log-probability and entropy by ``vocab.c``, forward and backward: two
reading passes forward that keep only each row's log-sum-exp (not the probabilities), one
pass backward that recomputes the probabilities and writes the gradient. The same values as
:func:`postrl.models.vocab.logprob_and_entropy`, up to float rounding, for float32 and bf16
CPU logits."""

from __future__ import annotations

import torch
from torch import Tensor

from postrl.accel.fused import native
from postrl.models import vocab


def serves(logits: Tensor, targets: Tensor) -> bool:
    return logits.dim() == 2 and targets.dtype == torch.int64 and native(logits) is not None


def logprob_and_entropy(logits: Tensor, targets: Tensor, temperature: float,
                        entropy_grad: bool, with_entropy: bool, consume_logits: bool = False
                        ) -> tuple[Tensor, Tensor | None]:
    """As :func:`postrl.models.vocab.logprob_and_entropy`, where :func:`serves` says so;
    with ``consume_logits`` the backward writes the gradient over the logits it kept."""
    return vocab.logprob_and_entropy(logits, targets, temperature, entropy_grad, with_entropy,
                                     _LogProbEntropy, consume_logits)


class _LogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, entropy_grad: bool,
                with_entropy: bool, consume_logits: bool) -> tuple[Tensor, Tensor | None]:
        ctx.temperature, ctx.entropy_grad = temperature, entropy_grad
        ctx.native, ctx.consume = native(logits), consume_logits
        return _native_forward(ctx, logits, targets, with_entropy)

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor):
        return _native_backward(ctx, grad_logp, grad_entropy), None, None, None, None, None


def _native_forward(ctx, logits: Tensor, targets: Tensor, with_entropy: bool
                    ) -> tuple[Tensor, Tensor | None]:
    """``vocab.c``'s forward; keeps the logits (their rows contiguous) and each row's lse."""
    rows = logits if logits.stride(-1) == 1 else logits.contiguous()
    targets = targets.contiguous()
    count = rows.shape[0]
    logp, lse = torch.empty(count), torch.empty(count)
    entropy = torch.empty(count) if with_entropy else None
    ctx.native.logprob_forward(
        rows.data_ptr(), count, rows.shape[1], rows.stride(0) if count > 1 else rows.shape[1],
        targets.data_ptr(), 1.0 / ctx.temperature, logp.data_ptr(), lse.data_ptr(),
        0 if entropy is None else entropy.data_ptr(), int(rows.dtype == torch.bfloat16),
        torch.get_num_threads())
    saved = (rows, targets, lse, entropy) if ctx.entropy_grad else (rows, targets, lse)
    ctx.save_for_backward(*saved)
    return logp, entropy


def _native_backward(ctx, grad_logp: Tensor, grad_entropy: Tensor | None) -> Tensor:
    """``vocab.c``'s backward: the logits' gradient, in their dtype."""
    rows, targets, lse = ctx.saved_tensors[:3]
    entropy = ctx.saved_tensors[3] if ctx.entropy_grad else None
    count, vocab = rows.shape
    grad_logp = (torch.zeros(count) if grad_logp is None else grad_logp.float().contiguous())
    use_entropy = ctx.entropy_grad and grad_entropy is not None
    grad_entropy = grad_entropy.float().contiguous() if use_entropy else None
    # vocab.c reads each logit once, before writing its gradient at the same place
    overwrite = ctx.consume and (count < 2 or rows.stride(0) == vocab)
    grad = rows if overwrite else torch.empty((count, vocab), dtype=rows.dtype)
    ctx.native.logprob_backward(
        rows.data_ptr(), count, vocab, rows.stride(0) if count > 1 else vocab,
        targets.data_ptr(), 1.0 / ctx.temperature, lse.data_ptr(),
        entropy.data_ptr() if use_entropy else 0, grad_logp.data_ptr(),
        grad_entropy.data_ptr() if use_entropy else 0, grad.data_ptr(),
        int(rows.dtype == torch.bfloat16), torch.get_num_threads())
    if overwrite:  # written through a pointer: tell autograd, so a second backward fails
        torch.autograd.graph.increment_version(rows)
    return grad

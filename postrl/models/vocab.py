"""Log-probability of the sampled token and entropy of the next-token distribution, from
logits over the whole vocabulary, in one pass and with a hand-written backward.

Autograd through ``gather - logsumexp`` and a separate entropy would sweep the
``[tokens, vocab]`` logits about ten times (the log-softmax, the softmax, the products, the
zero-filled gradient of the gather, the gradient of the logsumexp). Here the forward makes the
probabilities once and reuses them for the entropy; the backward writes the gradient in closed
form (``z`` are the temperature-scaled logits, ``p = softmax(z)``, ``H = -sum p log p``):

    d log p_y / d z = onehot(y) - p
    d H / d z       = -p * (log p + H)

The vocabulary dimension is reduced in float32 whatever the logits' dtype (float64 stays
float64, which lets ``torch.autograd.gradcheck`` check the backward). On a CPU with postrl's
native kernels, float32 and bf16 logits go through ``vocab.c`` instead: two reading passes
forward, keeping only each row's log-sum-exp (not the probabilities), and one pass backward
that recomputes the probabilities and writes the gradient (docs/performance.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from postrl.models import fused


def logprob_and_entropy(logits: Tensor, targets: Tensor, temperature: float = 1.0,
                        entropy_grad: bool = False, with_entropy: bool = True,
                        ) -> tuple[Tensor, Tensor | None]:
    """``(log p(target), entropy)`` per row of ``logits [n, V]`` at ``temperature``; the
    entropy carries a gradient only with ``entropy_grad``, and is not computed (None) without
    ``with_entropy`` (which ``entropy_grad`` implies)."""
    with_entropy = with_entropy or entropy_grad
    logp, entropy = _LogProbEntropy.apply(logits, targets, temperature, entropy_grad,
                                          with_entropy)
    return logp, entropy if entropy_grad or entropy is None else entropy.detach()


class _LogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, entropy_grad: bool,
                with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        ctx.temperature, ctx.dtype = temperature, logits.dtype
        ctx.entropy_grad = entropy_grad
        # the native kernels' bindings, which the backward then uses too (None: PyTorch's path)
        ctx.native = (fused.native(logits) if logits.dim() == 2 and targets.dtype == torch.int64
                      else None)
        if ctx.native is not None:
            return _native_forward(ctx, logits, targets, with_entropy)
        z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        if temperature != 1.0:
            z = z / temperature
        top = z.amax(dim=-1, keepdim=True)
        probs = (z - top).exp_()
        total = probs.sum(dim=-1, keepdim=True)
        probs.div_(total)
        lse = (top + total.log()).squeeze(-1)
        # vecdot, not bmm: on the CPU bmm's float32 sum over the vocabulary is ~20x less exact
        entropy = lse - torch.linalg.vecdot(probs, _finite(z)) if with_entropy else None
        logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        if entropy_grad:
            ctx.save_for_backward(probs, targets, z, lse, entropy)
        else:
            ctx.save_for_backward(probs, targets)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor):
        if ctx.native is not None:
            return _native_backward(ctx, grad_logp, grad_entropy), None, None, None, None
        probs, targets = ctx.saved_tensors[:2]
        grad = probs * grad_logp.neg().unsqueeze(-1)
        grad.scatter_add_(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1))
        if ctx.entropy_grad and grad_entropy is not None:
            _, _, z, lse, entropy = ctx.saved_tensors
            # -p * (log p + H) * g, with log p = z - lse
            spread = (_finite(z) - (lse - entropy).unsqueeze(-1)).mul_(probs)
            grad.sub_(spread.mul_(grad_entropy.unsqueeze(-1)))
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad.to(ctx.dtype), None, None, None, None


def _finite(z: Tensor) -> Tensor:
    """``z`` with -inf (a masked logit, of probability 0) as the dtype's lowest finite value,
    so that it adds 0 to sums weighted by the probabilities, not 0 * -inf = NaN."""
    return z.clamp(min=torch.finfo(z.dtype).min)


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
    grad = torch.empty((count, vocab), dtype=rows.dtype)
    ctx.native.logprob_backward(
        rows.data_ptr(), count, vocab, rows.stride(0) if count > 1 else vocab,
        targets.data_ptr(), 1.0 / ctx.temperature, lse.data_ptr(),
        entropy.data_ptr() if use_entropy else 0, grad_logp.data_ptr(),
        grad_entropy.data_ptr() if use_entropy else 0, grad.data_ptr(),
        int(rows.dtype == torch.bfloat16), torch.get_num_threads())
    return grad

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
float64, which lets ``torch.autograd.gradcheck`` check the backward). A backend may compute
it its own way (``postrl.models.backend``: ``Backend.logprob_and_entropy``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def logprob_and_entropy(logits: Tensor, targets: Tensor, temperature: float = 1.0,
                        entropy_grad: bool = False, with_entropy: bool = True,
                        function: type[torch.autograd.Function] | None = None,
                        consume_logits: bool = False) -> tuple[Tensor, Tensor | None]:
    """``(log p(target), entropy)`` per row of ``logits [n, V]`` at ``temperature``; the
    entropy carries a gradient only with ``entropy_grad``, and is not computed (None) without
    ``with_entropy`` (which ``entropy_grad`` implies). ``function``: a backend's autograd
    function of the same arguments and results (default: this module's).

    ``consume_logits``: the logits are this call's alone (nothing reads them after the
    backward, nor keeps them for its own) and the graph is back-propagated once, so the
    backward may write the gradient over what it kept (here the probabilities; a backend's
    may keep the logits themselves): one ``[n, V]`` tensor fewer. A second backward through
    the graph then fails on the overwritten tensor's version."""
    with_entropy = with_entropy or entropy_grad
    logp, entropy = (function or _LogProbEntropy).apply(logits, targets, temperature,
                                                        entropy_grad, with_entropy,
                                                        consume_logits)
    return logp, entropy if entropy_grad or entropy is None else entropy.detach()


class _LogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, entropy_grad: bool,
                with_entropy: bool, consume_logits: bool) -> tuple[Tensor, Tensor | None]:
        ctx.temperature, ctx.dtype = temperature, logits.dtype
        ctx.entropy_grad, ctx.consume = entropy_grad, consume_logits
        z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        if temperature != 1.0:
            z = z / temperature
        top = z.amax(dim=-1, keepdim=True)
        probs = (z - top).exp_()
        total = probs.sum(dim=-1, keepdim=True)
        probs.div_(total)
        lse = (top + total.log()).squeeze(-1)
        entropy = lse - _expected(probs, z) if with_entropy else None
        logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        if entropy_grad:
            ctx.save_for_backward(probs, targets, z, lse, entropy)
        else:
            ctx.save_for_backward(probs, targets)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor):
        probs, targets = ctx.saved_tensors[:2]
        probs = probs if ctx.consume else probs.clone()  # the gradient is written over it
        if ctx.entropy_grad and grad_entropy is not None:
            _, _, z, lse, entropy = ctx.saved_tensors
            # -p * (log p + H) * g, with log p = z - lse, before p is overwritten
            shift, scale = (lse - entropy).unsqueeze(-1), grad_entropy.unsqueeze(-1)
            for rows in _blocks(z):
                spread = (_finite(z[rows]) - shift[rows]).mul_(probs[rows]).mul_(scale[rows])
                probs[rows].mul_(grad_logp[rows].neg().unsqueeze(-1)).sub_(spread)
        else:
            probs.mul_(grad_logp.neg().unsqueeze(-1))
        grad = probs.scatter_add_(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1))
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad.to(ctx.dtype), None, None, None, None, None


# Elements of a [rows, vocabulary] temporary made at a time on the CPU: a few megabytes,
# where the whole chunk's would be new pages of hundreds (bench/log.md, "The update's own
# time at 256 tokens")
BLOCK_ELEMENTS = 2**20


def _blocks(z: Tensor) -> list[slice]:
    """Slices of ``z``'s rows, each of at most :data:`BLOCK_ELEMENTS` elements (one row at
    least) on the CPU; all rows at once elsewhere (a GPU's allocator keeps freed memory, and
    each block would be another kernel launch)."""
    if z.device.type != "cpu":
        return [slice(0, z.shape[0])]
    step = max(1, BLOCK_ELEMENTS // max(z.shape[-1], 1))
    return [slice(start, start + step) for start in range(0, z.shape[0], step)]


def _expected(probs: Tensor, z: Tensor) -> Tensor:
    """``sum_v p_v z_v`` per row, a block of rows at a time (:func:`_blocks`)."""
    out = z.new_empty(z.shape[:-1])
    for rows in _blocks(z):
        # vecdot, not bmm: on the CPU bmm's float32 sum over the vocabulary is ~20x less exact
        torch.linalg.vecdot(probs[rows], _finite(z[rows]), out=out[rows])
    return out


def _finite(z: Tensor) -> Tensor:
    """``z`` with -inf (a masked logit, of probability 0) as the dtype's lowest finite value,
    so that it adds 0 to sums weighted by the probabilities, not 0 * -inf = NaN."""
    return z.clamp(min=torch.finfo(z.dtype).min)


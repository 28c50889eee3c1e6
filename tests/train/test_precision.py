"""bf16 autocast must not change the maths beyond a documented tolerance (docs/performance.md):
one step's loss and gradients in bf16 against fp32, on the tiny model."""

import torch

from postrl.models import load_policy
from postrl.models.logprobs import SequenceBatch, response_logprobs
from postrl.models.precision import autocast
from postrl.objectives import BatchCounts, PolicyLossConfig, PolicyLossInputs, policy_loss

LOSS_TOLERANCE = 1e-3  # relative, on the loss (measured: 6.5e-5)
GRADIENT_COSINE = 0.999  # cosine of the full parameter gradients (measured: 1.0000)


def one_step(model, batch, mask, advantages, old, precision):
    model.zero_grad(set_to_none=True)
    with autocast(precision):
        logp, _ = response_logprobs(model, batch)
    cfg = PolicyLossConfig(ratio="token", clip_low=0.2, clip_high=0.28, aggregation="token_mean")
    out = policy_loss(PolicyLossInputs(logp, old, advantages, mask), cfg, BatchCounts.of(mask))
    out.loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return out.loss.item(), grads, logp.detach()


def test_bf16_autocast_matches_fp32_within_tolerance():
    model, tokenizer = load_policy("tiny", seed=3)
    generator = torch.Generator().manual_seed(0)
    prompts = [tokenizer(f"What is {i} + {i}?", add_special_tokens=False).input_ids
               for i in range(6)]
    responses = torch.randint(100, 5000, (6, 10), generator=generator)
    mask = torch.arange(10) < torch.tensor([10, 7, 3, 10, 1, 5]).unsqueeze(1)
    batch = SequenceBatch.build(prompts, responses, mask, tokenizer.pad_token_id)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    with torch.no_grad():  # the same old log-probs for both: a slightly off-policy batch
        logp, _ = response_logprobs(model, batch)
    old = logp + 0.05 * torch.sin(torch.arange(logp.numel()).view_as(logp).float())
    loss32, grad32, logp32 = one_step(model, batch, mask, advantages, old, "fp32")
    loss16, grad16, logp16 = one_step(model, batch, mask, advantages, old, "bf16")
    assert logp16.dtype == torch.float32  # log-softmax stays in float32
    assert abs(loss16 - loss32) <= LOSS_TOLERANCE * abs(loss32)
    assert (logp16 - logp32)[mask].abs().max() < 1e-2  # measured: 1.3e-3
    cosine = torch.nn.functional.cosine_similarity(grad16, grad32, dim=0)
    assert cosine > GRADIENT_COSINE
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights

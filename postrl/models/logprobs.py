"""Per-token log-probabilities (and entropies) of responses under a causal LM.

The batch layout matches the rollout engine: left-padded prompts followed by right-padded
responses, so one forward pass scores every response. Only the response tokens go through the
LM head (not the prompt, not the padding), and the log-softmax is never materialised over the
whole vocabulary for the whole batch at once: tokens are processed in chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from postrl.objectives import entropy_from_logits


@dataclass
class SequenceBatch:
    """Prompt + response token ids of ``N`` rows, ready for one forward pass."""

    input_ids: Tensor  # [N, P + T]
    attention_mask: Tensor  # [N, P + T]
    position_ids: Tensor  # [N, P + T]
    prompt_width: int  # P: responses start at this column

    @classmethod
    def build(cls, prompt_ids: list[list[int]], response_ids: Tensor, response_mask: Tensor,
              pad_id: int) -> SequenceBatch:
        rows, width = len(prompt_ids), max(len(p) for p in prompt_ids)
        prompts = torch.full((rows, width), pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((rows, width), dtype=torch.long)
        for i, prompt in enumerate(prompt_ids):
            prompts[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            prompt_mask[i, width - len(prompt):] = 1
        input_ids = torch.cat([prompts, response_ids.long()], dim=1)
        attention = torch.cat([prompt_mask, response_mask.long()], dim=1)
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        return cls(input_ids, attention, positions, width)


def response_logprobs(
    model, batch: SequenceBatch, temperature: float = 1.0, with_entropy: bool = False,
    chunk_rows: int = 8, entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``(logp [N, T], entropy [N, T] or None)`` of the response tokens, temperature-scaled.

    Gradients flow into ``logp`` when called outside ``torch.no_grad``; the entropy carries a
    gradient only with ``entropy_grad`` (an entropy bonus or entropy-guided mixing), otherwise
    it is a detached diagnostic. Positions outside the response mask hold 0.
    """
    response_width = batch.input_ids.shape[1] - batch.prompt_width
    hidden = model.model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask,
        position_ids=batch.position_ids, use_cache=False,
    ).last_hidden_state
    # the hidden state at column c predicts the token at c + 1; only response tokens (the
    # attention mask's response part) go through the LM head, chunk_rows * T at a time
    hidden = hidden[:, batch.prompt_width - 1 : batch.prompt_width - 1 + response_width]
    scored = batch.attention_mask[:, batch.prompt_width:].bool()
    hidden, targets = hidden[scored], batch.input_ids[:, batch.prompt_width:][scored]
    chunk = chunk_rows * max(response_width, 1)
    logps, entropies = [], []
    # at least one (possibly empty) chunk, so that a batch without a scored token still gives
    # a result attached to the graph (a zero loss that can be back-propagated)
    for start in range(0, max(hidden.shape[0], 1), chunk):
        logits = model.lm_head(hidden[start : start + chunk]).float()
        if temperature != 1.0:
            logits = logits / temperature
        picked = logits.gather(-1, targets[start : start + chunk, None]).squeeze(-1)
        logps.append(picked - torch.logsumexp(logits, dim=-1))
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropies.append(entropy_from_logits(logits))
    return _unflatten(logps, scored), _unflatten(entropies, scored) if with_entropy else None


def _unflatten(parts: list[Tensor], scored: Tensor) -> Tensor:
    """``[N, T]`` with the scored positions filled from ``parts`` (in order), 0 elsewhere."""
    flat = torch.cat(parts)
    return torch.zeros(scored.shape, dtype=flat.dtype, device=flat.device).masked_scatter(
        scored, flat)

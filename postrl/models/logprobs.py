"""Per-token log-probabilities (and entropies) of responses under a causal LM.

The batch layout matches the rollout engine: left-padded prompts followed by right-padded
responses, so one forward pass scores every response. Only the response positions go through
the LM head, and the log-softmax is never materialised over the whole vocabulary for the whole
batch at once: rows are processed in chunks.
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
    it is a detached diagnostic. Positions past each response are meaningless (mask them).
    """
    response_width = batch.input_ids.shape[1] - batch.prompt_width
    hidden = model.model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask,
        position_ids=batch.position_ids, use_cache=False,
    ).last_hidden_state
    # the hidden state at column c predicts the token at c + 1
    hidden = hidden[:, batch.prompt_width - 1 : batch.prompt_width - 1 + response_width]
    targets = batch.input_ids[:, batch.prompt_width:]
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_rows):
        logits = model.lm_head(hidden[start : start + chunk_rows]).float()
        if temperature != 1.0:
            logits = logits / temperature
        picked = logits.gather(-1, targets[start : start + chunk_rows, :, None]).squeeze(-1)
        logps.append(picked - torch.logsumexp(logits, dim=-1))
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropies.append(entropy_from_logits(logits))
    return torch.cat(logps), torch.cat(entropies) if with_entropy else None

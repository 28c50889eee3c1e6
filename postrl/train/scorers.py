"""The forwards an update differentiates, as ``nn.Module``s: a data-parallel wrapper (DDP,
FSDP2) synchronises through the forward it wraps."""

from __future__ import annotations

from contextlib import nullcontext

from torch import Tensor, nn

from postrl.models.logprobs import SequenceBatch, response_logprobs, sparse_embedding_grad


class TokenScorer(nn.Module):
    """Per-token log-probs and entropies of a causal LM as a module's ``forward``: a
    data-parallel wrapper (DDP) synchronises through the forward it wraps. ``share_prompts``
    off runs every row's prompt (FSDP2 needs the same forward calls on every rank);
    ``tied_grads_in_place`` builds a tied embedding/LM-head weight's gradient without
    vocabulary-sized temporaries: the lookup's gradient sparse, the head's chunk gradients
    added in place (one process only: the data-parallel wrappers watch each parameter's own
    gradient accumulator); ``compile_layers`` compiles postrl's own decoder layers
    (``torch_compile``)."""

    def __init__(self, lm, share_prompts: bool = True, tied_grads_in_place: bool = False,
                 compile_layers: bool = False) -> None:
        super().__init__()
        self.lm, self.share_prompts = lm, share_prompts
        self.tied_grads_in_place, self.compile_layers = tied_grads_in_place, compile_layers

    def forward(self, sequences: SequenceBatch, temperature: float, entropy_grad: bool):
        with sparse_embedding_grad(self.lm) if self.tied_grads_in_place else nullcontext():
            return response_logprobs(self.lm, sequences, temperature, with_entropy=True,
                                     entropy_grad=entropy_grad, share_prompts=self.share_prompts,
                                     head_grad_in_place=self.tied_grads_in_place,
                                     compile_layers=self.compile_layers)


class ValueScorer(nn.Module):
    """PPO's critic values as a module's ``forward`` (see :class:`TokenScorer` for
    ``share_prompts`` and ``compile_layers``)."""

    def __init__(self, critic, share_prompts: bool = True, compile_layers: bool = False) -> None:
        super().__init__()
        self.critic, self.share_prompts, self.compile_layers = critic, share_prompts, compile_layers

    def forward(self, sequences: SequenceBatch) -> Tensor:
        return self.critic.values(sequences, self.share_prompts, self.compile_layers)

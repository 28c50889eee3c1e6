"""The update's LM-head chunks: their logits' gradient written over what the vocabulary's
log-softmax kept of them (one [tokens, vocabulary] tensor fewer per chunk), the gradients
still autograd's; a head that keeps its own output for its backward is left alone."""

import copy
import importlib.util

import pytest
import torch
from torch import nn

from postrl.models import backend
from postrl.models.logprobs import response_logprobs, sparse_embedding_grad
from postrl.train.setup import checkpoint_layers
from tests.models.test_models import batch_of

BACKENDS = ["torch"] + (["postrl.accel"] if importlib.util.find_spec("postrl.accel") else [])


@pytest.fixture(params=BACKENDS)
def chosen(request, monkeypatch):
    monkeypatch.setattr(backend, "_active", backend._active)  # put back after the test
    return backend.use(request.param)


class TanhHead(nn.Linear):
    """``tanh(x W^T)``: tanh keeps its output, the logits, for its own backward."""

    def forward(self, x):
        return torch.tanh(super().forward(x))


def gradients(model, logp, batch) -> dict:
    (logp * torch.arange(1.0, 1.0 + logp.shape[1]) * batch.scored).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def reference(model, batch) -> dict:
    """The same weighted sum of log-probs through transformers' forward and a textbook
    log-softmax over every position."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids).logits
    width = batch.prompt_width
    logp = logits[:, width - 1 : -1].log_softmax(-1).gather(
        -1, batch.input_ids[:, width:, None]).squeeze(-1)
    return gradients(model, logp, batch)


def scored(model, batch, chosen, in_place: bool) -> tuple[dict, list[bool]]:
    """Gradients by ``response_logprobs`` (3-token chunks, the embedding sparse as in the
    trainer), and for each chunk (each call again when its logits are made again in the
    backward) whether the vocabulary's log-softmax was allowed to overwrite its logits."""
    consumed, plain = [], chosen.logprob_and_entropy

    def spy(*args, consume_logits=False):
        consumed.append(consume_logits)
        return plain(*args, consume_logits=consume_logits)

    chosen.logprob_and_entropy = spy
    try:
        with sparse_embedding_grad(model):
            logp, _ = response_logprobs(model, batch, chunk_tokens=3,
                                        head_grad_in_place=in_place)
        return gradients(model, logp, batch), consumed
    finally:
        del chosen.logprob_and_entropy


def assert_same(grads: dict, want: dict) -> None:
    """Equal up to float32 sums in another order (a tolerance scaled to each gradient)."""
    assert grads.keys() == want.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want[name], atol=2e-5 * float(want[name].abs().max()),
                                   rtol=1e-5, msg=name)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_linear_heads_logits_are_overwritten_by_their_gradient(tiny, chosen, in_place,
                                                                 checkpointed):
    model, tokenizer = tiny
    model = copy.deepcopy(model)
    batch = batch_of(tokenizer)
    want = reference(model, batch)
    if checkpointed:
        checkpoint_layers(model, "tiny")
    grads, consumed = scored(model, batch, chosen, in_place)
    assert_same(grads, want)
    # two chunks of 3 and 2 tokens, made again in the backward when checkpointed
    assert consumed == [True] * (4 if checkpointed else 2)


def test_a_head_that_keeps_its_logits_for_its_backward_is_not_overwritten(tiny, chosen):
    model, tokenizer = tiny
    model = copy.deepcopy(model)
    head = TanhHead(model.config.hidden_size, model.config.vocab_size, bias=False)
    head.weight = model.lm_head.weight  # still tied to the input embedding
    model.lm_head = head
    batch = batch_of(tokenizer)
    want = reference(model, batch)
    grads, consumed = scored(model, batch, chosen, in_place=True)
    assert_same(grads, want)
    assert consumed == [False, False]

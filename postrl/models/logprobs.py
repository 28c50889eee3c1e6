"""Per-token log-probabilities (and entropies) of responses under a causal LM.

The batch layout matches the rollout engine: left-padded prompts followed by right-padded
responses, so one forward pass scores every response. Only the response tokens go through the
LM head (not the prompt, not the padding), and the log-softmax is never materialised over the
whole vocabulary for the whole batch at once: tokens are processed in chunks.

Rows that share a prompt (the G samples of a group) share its forward: each distinct prompt
runs once, and its keys and values are repeated for its rows' responses (the result is the
full forward's, up to the order of float sums). With a 45-token chat prompt and G = 8, that
is most of a group's prompt tokens not recomputed, forward and backward. Their responses are
then packed into fewer rows where they fit (``postrl/models/packing.py``), so the padding of
short responses is not computed either. Llama-style models run postrl's own decoder layers
(``postrl/models/layers.py``: the prompt's keys and values passed in, no repeated key/value
heads); other models, and any model under FSDP2, run transformers' forward with a cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from postrl.models import backend, layers
from postrl.models.backend import KeptForward, KeptRows
from postrl.models.packing import Packing, attention_bias, pack_responses

# Scored tokens per pass through the LM head and the vocabulary's log-softmax (when the
# caller does not say): a pass keeps its [tokens, vocabulary] probabilities for the backward
# and makes its logits and their gradient as large, whatever the responses' length; smaller
# passes measured no faster (bench/log.md, "The update's own time at 256 tokens")
HEAD_CHUNK_TOKENS = 2048


@dataclass
class SequenceBatch:
    """Prompt + response token ids of ``N`` rows, ready for one forward pass."""

    input_ids: Tensor  # [N, P + T]
    attention_mask: Tensor  # [N, P + T]
    position_ids: Tensor  # [N, P + T]
    prompt_width: int  # P: responses start at this column
    # [N, T] the response tokens to score, when not every attended one is (a multi-turn
    # episode's environment tokens are context only); None: all of them
    score_mask: Tensor | None = None
    # these rows' share of what the backend kept of sampling them: its record of the
    # sampler's forward may stand in for this one (``Backend.kept_forward``); opaque here
    kept_rows: KeptRows | None = None

    @classmethod
    def build(cls, prompt_ids: list[list[int]], response_ids: Tensor, response_mask: Tensor,
              pad_id: int, score_mask: Tensor | None = None) -> SequenceBatch:
        """``response_mask`` is what the forward attends to; ``score_mask`` (within it) what
        is scored, when that is less."""
        rows, width = len(prompt_ids), max(len(p) for p in prompt_ids)
        prompts = torch.full((rows, width), pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((rows, width), dtype=torch.long)
        for i, prompt in enumerate(prompt_ids):
            prompts[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            prompt_mask[i, width - len(prompt):] = 1
        input_ids = torch.cat([prompts, response_ids.long()], dim=1)
        attention = torch.cat([prompt_mask, response_mask.long()], dim=1)
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        return cls(input_ids, attention, positions, width,
                   None if score_mask is None else score_mask.bool())

    @property
    def scored(self) -> Tensor:
        """[N, T] bool: the response tokens whose log-probs (or values) are wanted."""
        attended = self.attention_mask[:, self.prompt_width:].bool()
        return attended if self.score_mask is None else attended & self.score_mask

    def to(self, device: torch.device | str) -> SequenceBatch:
        """These rows on ``device`` (what the backend kept stays where it is)."""
        if torch.device(device) == self.input_ids.device:
            return self
        return dataclasses.replace(self, input_ids=self.input_ids.to(device),
                                   attention_mask=self.attention_mask.to(device),
                                   position_ids=self.position_ids.to(device),
                                   score_mask=None if self.score_mask is None
                                   else self.score_mask.to(device))


def response_logprobs(
    model, batch: SequenceBatch, temperature: float = 1.0, with_entropy: bool = False,
    chunk_tokens: int | None = None, entropy_grad: bool = False, share_prompts: bool = True,
    head_grad_in_place: bool = False, compile_layers: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``(logp [N, T], entropy [N, T] or None)`` of the response tokens, temperature-scaled.

    Gradients flow into ``logp`` when called outside ``torch.no_grad``; the entropy carries a
    gradient only with ``entropy_grad`` (an entropy bonus or entropy-guided mixing), otherwise
    it is a detached diagnostic. Positions outside the response mask hold 0. Rows with the
    same prompt share its forward unless ``share_prompts`` is off. ``head_grad_in_place``:
    see :func:`lm_head_chunks` (one process only). ``compile_layers``: postrl's own decoder
    layers run compiled (``torch_compile``; :func:`postrl.models.layers.body`). Where the
    model's layers are checkpointed (``gradient_checkpointing``), each chunk's logits are
    made again in the backward too, not kept (unless the backend serves them from what it
    kept of the sampler's forward). The graph is for one backward: a plain linear head's
    logits are overwritten by their gradient there (``consume_logits``), so a second backward
    through it raises.
    """
    kept = backend.active().kept_forward(model, batch.kept_rows)
    hidden, kept = response_hidden(model, batch, share_prompts, compile_layers, kept)
    # only the scored response tokens go through the LM head, chunk_tokens at a time
    scored = batch.scored
    hidden, targets = hidden[scored], batch.input_ids[:, batch.prompt_width:][scored]
    chunk = chunk_tokens or HEAD_CHUNK_TOKENS
    head = lm_head_chunks(model) if head_grad_in_place else model.lm_head
    head = _plain_head(head, kept is not None) if isinstance(head, nn.Module) else head
    score = functools.partial(_score_chunk, head, temperature=temperature,
                              entropy_grad=entropy_grad and torch.is_grad_enabled(),
                              with_entropy=with_entropy, consume_logits=kept is None
                              and type(model.lm_head) is nn.Linear)
    if kept is None and layers.checkpointed(model):  # logits again in the backward
        score = functools.partial(checkpoint, score, use_reentrant=False)
    logps, entropies = [], []
    with contextlib.nullcontext() if kept is None else kept.head(*scored.nonzero().unbind(1)):
        # at least one (possibly empty) chunk, so that a batch without a scored token still
        # gives a result attached to the graph (a zero loss that can be back-propagated)
        for start in range(0, max(hidden.shape[0], 1), chunk):
            logp, entropy = score(hidden[start : start + chunk], targets[start : start + chunk])
            logps.append(logp)
            entropies.append(entropy)
    return _unflatten(logps, scored), _unflatten(entropies, scored) if with_entropy else None


def response_hidden(model, batch: SequenceBatch, share_prompts: bool = True,
                    compile_layers: bool = False, kept: KeptForward | None = None
                    ) -> tuple[Tensor, KeptForward | None]:
    """``([N, T, H], kept or None)``: the last hidden states that predict each response
    token (the one at column ``c`` predicts the token at ``c + 1``), and ``kept`` if the
    layers read it (see below). Llama-style models run postrl's own layers when prompts are
    shared (each distinct prompt once; with packed responses, the prompts' and the responses'
    tokens go through each layer's linears together); other models, and whole rows
    (``share_prompts`` off: FSDP2), run transformers' forward. ``kept`` (what the backend
    kept of the sampler's forward of these rows, ``Backend.kept_forward``) serves the linears
    of the packed path of postrl's layers, which then run eagerly (compiled layers serving
    it measured slower than eager ones, docs/performance.md); any other path leaves it
    unread."""
    width, response_width = batch.prompt_width, batch.input_ids.shape[1] - batch.prompt_width
    own = share_prompts and layers.unsupported_reason(model) is None
    # transformers' checkpointed layers drop the prompts' cache: whole rows there instead
    share_prompts = share_prompts and (own or not layers.checkpointed(model))
    body = _OwnLayers(model, compile_layers) if own else _Transformers(model)
    prompts, rows = (shared_prompts(batch.input_ids[:, :width], batch.attention_mask[:, :width])
                     if share_prompts else (None, None))
    if prompts is None or len(prompts) == len(rows):  # one plain forward
        hidden, _ = body.forward(batch.input_ids, batch.position_ids, batch.attention_mask)
        return hidden[:, width - 1 : width - 1 + response_width], None
    # each distinct prompt once (equal ids and masks: equal positions too)
    prompt_ids, prompt_positions, prompt_mask = (
        t[prompts, :width] for t in (batch.input_ids, batch.position_ids, batch.attention_mask))
    packing = (pack_responses(batch.input_ids[:, width:], batch.attention_mask[:, width:],
                              batch.position_ids[:, width:], rows)
               if response_width > 1 else None)
    if packing is not None:
        if own:  # the prompts' and the responses' tokens through each linear together
            bias = attention_bias(packing, prompt_mask, body.dtype)  # the residual stream's
            with (contextlib.nullcontext() if kept is None else
                  kept.layers(batch, prompts, prompt_mask, packing)):
                prompt, packed = body.forward_with_prompts(prompt_ids, prompt_positions,
                                                           prompt_mask, packing, bias,
                                                           eager=kept is not None)
        else:
            kept = None
            prompt, past = body.forward(prompt_ids, prompt_positions, prompt_mask, keep=True)
            bias = attention_bias(packing, prompt_mask, prompt.dtype)
            packed, _ = body.forward(packing.input_ids, packing.position_ids, bias,
                                     body.select(past, packing.prompts))
        hidden = torch.cat([prompt[:, -1], packed.flatten(0, 1)]).index_select(0, packing.source)
        return hidden.view(*batch.input_ids[:, width:].shape, -1), kept
    prompt, past = body.forward(prompt_ids, prompt_positions, prompt_mask, keep=True)
    if response_width == 1:
        return prompt[rows, -1:], None  # predicts the first response token
    # each row gets its prompt's keys and values (a differentiable index_select: their
    # gradients add up over the rows of the prompt)
    responses, _ = body.forward(batch.input_ids[:, width:-1], batch.position_ids[:, width:-1],
                                batch.attention_mask[:, :-1], body.select(past, rows))
    return torch.cat([prompt[rows, -1:], responses], dim=1), None


def _score_chunk(head, hidden: Tensor, targets: Tensor, temperature: float, entropy_grad: bool,
                 with_entropy: bool, consume_logits: bool) -> tuple[Tensor, Tensor | None]:
    """One chunk's log-probs and entropies: ``head`` over its hidden states, then the
    vocabulary's log-softmax. ``consume_logits``: the head is a plain linear that made its
    logits here (not the backend's kept ones), whose backward does not read them, so they may
    be overwritten by their gradient."""
    return backend.active().logprob_and_entropy(
        head(hidden), targets, temperature, entropy_grad, with_entropy,
        consume_logits=consume_logits)


def _plain_head(head: nn.Module, served: bool) -> Callable[[Tensor], Tensor]:
    """``head`` for one chunk; ``served``: by the backend's linears, which serve its logits
    from what they kept of the sampler's forward (:class:`KeptForward`)."""
    if not served:
        return head
    return lambda hidden: backend.active().linears(hidden, [head.weight], [head.bias])[0]


class _OwnLayers:
    """:func:`response_hidden`'s forward through :func:`postrl.models.layers.body`
    (Llama-style models; not under FSDP2, whose parameters exist only inside their modules'
    forward). Past keys and values are :class:`postrl.models.layers.KeysValues`."""

    def __init__(self, model, compiled: bool) -> None:
        self.model, self.compiled = model, compiled
        self.dtype = model.get_input_embeddings().weight.dtype  # the residual stream's

    def forward(self, input_ids: Tensor, position_ids: Tensor, mask: Tensor,
                past: layers.KeysValues | None = None, keep: bool = False):
        """``(last hidden states, keys and values)`` over ``input_ids`` after ``past``;
        ``mask`` is the 2-D attention mask of all the columns (causal) or a 4-D bias."""
        if mask.dim() == 2:
            mask = layers.causal_bias(mask, self.dtype, queries=input_ids.shape[1])
        return layers.body(self.model, input_ids, position_ids, mask, past, self.compiled)

    def forward_with_prompts(self, prompt_ids: Tensor, prompt_positions: Tensor,
                             prompt_mask: Tensor, packing: Packing, bias: Tensor,
                             eager: bool = False):
        """``(prompt hidden states, packed rows' hidden states)``: the two forwards of
        :meth:`forward` (the prompts, then the packed rows after them) in one pass; ``eager``:
        not compiled, whatever ``compiled`` says."""
        prompt_bias = layers.causal_bias(prompt_mask, self.dtype)
        return layers.body_with_prompts(self.model, prompt_ids, prompt_positions, prompt_bias,
                                        packing.input_ids, packing.position_ids, bias,
                                        packing.prompts, self.compiled and not eager)

    @staticmethod
    def select(past: layers.KeysValues, rows: Tensor) -> layers.KeysValues:
        return past.select(rows)


class _Transformers:
    """The same through transformers' forward; past keys and values are its cache, kept
    only when asked (``keep``)."""

    def __init__(self, model) -> None:
        self.body = model.model
        self.config, self.keyword = model.config, cache_keyword(model.model)

    def forward(self, input_ids: Tensor, position_ids: Tensor, mask: Tensor,
                past: DynamicCache | None = None, keep: bool = False):
        if past is None and keep:
            past = DynamicCache(config=self.config)
        cache = {"use_cache": False} if past is None else {"use_cache": True, self.keyword: past}
        out = self.body(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                        **cache)
        return out.last_hidden_state, past

    @staticmethod
    def select(past: DynamicCache, rows: Tensor) -> DynamicCache:
        past.reorder_cache(rows)
        return past


def lm_head_chunks(model) -> Callable[..., Tensor]:
    """The LM head for one chunk of tokens at a time, each chunk's weight gradient added in
    place into the weight's ``.grad`` by the matmul that computes it (its logits those the
    backend kept of the sampler's forward, where it serves them: ``Backend.kept``).

    Through autograd, the chunks' weight gradients (one vocabulary-sized tensor each, 113 MB
    for SmolLM2 in float32) are summed out of place, and so is their sum with the input
    embedding's gradient when the weights are tied: a new vocabulary-sized tensor at every
    addition. Here the first chunk of a backward (in backward order) writes the weight's
    ``.grad`` and each later one accumulates into it (``addmm_``: no vocabulary-sized
    temporary, and one rounding per chunk, not two). Only for a trained LM head tied to the
    input embedding: the embedding lookup then still reaches the weight's own gradient
    accumulator after every chunk (the lookup comes first in the forward, last in the
    backward), so hooks on the weight, such as ``bf16-master``'s, still see the whole
    gradient. Not under data-parallel wrappers, which watch the weight's own accumulator, nor
    for ``torch.autograd.grad`` (the chunks write ``.grad`` as ``backward()`` does). Anything
    else gets the plain head.
    """
    head = model.lm_head
    if not (_trained_tied_embedding(model) and type(head) is nn.Linear and head.bias is None
            and torch.is_grad_enabled()):
        return head

    def chunk_logits(hidden: Tensor) -> Tensor:
        return _HeadChunk.apply(hidden, head)

    return chunk_logits


class _HeadChunk(torch.autograd.Function):
    """``hidden W^T`` for the head ``head`` (or the value the backend kept of it); the
    backward adds ``dy^T hidden`` into ``W.grad`` itself and returns only ``dy W``. Under
    autocast both multiply in autocast's dtype, as ``F.linear`` would, and the weight's
    gradient is added into its float32 ``.grad`` from there."""

    @staticmethod
    def forward(ctx, hidden: Tensor, head: nn.Linear) -> Tensor:
        kept = backend.active().kept(hidden, [head.weight])
        weight = head.weight.detach()  # shares the version counter: in-place edits are caught
        device = hidden.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
        ctx.save_for_backward(hidden, weight)
        ctx.head = head
        return F.linear(hidden, weight) if kept is None else kept[0].view_as(kept[0])

    @staticmethod
    def backward(ctx, grad: Tensor):
        hidden, weight = ctx.saved_tensors
        parameter = ctx.head.weight
        grad = grad.to(weight.dtype)
        flat = grad.reshape(-1, grad.shape[-1]).t()
        inputs = hidden.reshape(-1, hidden.shape[-1])
        if parameter.grad is None:
            parameter.grad = (flat @ inputs).to(parameter.dtype)
        elif parameter.dtype == flat.dtype:
            parameter.grad.addmm_(flat, inputs)
        else:  # autocast: the product in its dtype, the sum in the weight's
            parameter.grad.add_(flat @ inputs)
        return backend.active().input_grad(grad, weight), None


def cache_keyword(module) -> str:
    """transformers renamed the ``past_key_values`` argument to ``cache`` (5.2x)."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else (
        "past_key_values")


def shared_prompts(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(first, rows)``: the index of the first row of each distinct prompt, and for every
    row the position of its prompt in ``first``. Rows are the same prompt when their ids AND
    masks are (a prompt may begin with the padding token)."""
    _, rows = torch.unique(torch.cat([prompt_ids, prompt_mask.long()], dim=1), dim=0,
                           return_inverse=True)
    first = torch.full((int(rows.max()) + 1,), len(rows), dtype=torch.long,
                       device=rows.device).scatter_reduce(
        0, rows, torch.arange(len(rows), device=rows.device), reduce="amin")
    return first, rows


def _unflatten(parts: list[Tensor], scored: Tensor) -> Tensor:
    """``[N, T]`` with the scored positions filled from ``parts`` (in order), 0 elsewhere."""
    flat = torch.cat(parts)
    return torch.zeros(scored.shape, dtype=flat.dtype, device=flat.device).masked_scatter(
        scored, flat)


@contextmanager
def sparse_embedding_grad(model) -> Iterator[None]:
    """Forwards inside make the input embedding's gradient sparse (the rows of the tokens
    used) when the embedding is tied to the LM head and trained: the dense gradient then
    comes from the head alone, and the embedding lookup no longer fills and adds a
    vocabulary-sized tensor in every forward (about 113 MB each for SmolLM2 in float32).
    The tied parameter's ``.grad`` stays dense (dense + sparse), so clipping and fused AdamW
    see what they always do. Untied embeddings keep dense gradients."""
    if not _trained_tied_embedding(model):
        yield
        return
    embedding = model.get_input_embeddings()
    before, embedding.sparse = embedding.sparse, True
    try:
        yield
    finally:
        embedding.sparse = before


def _trained_tied_embedding(model) -> bool:
    """The input embedding is a plain lookup whose weight is the LM head's, and is trained."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    return (isinstance(embedding, nn.Embedding) and head is not None
            and embedding.weight is head.weight and embedding.weight.requires_grad)

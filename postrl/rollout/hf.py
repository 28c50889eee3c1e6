"""The default rollout engine: a lean sampling loop over a transformers causal LM.

All ``P*G`` rows are generated together (in chunks of ``batch_size`` rows) with a KV cache:
one prefill over the left-padded prompts — each prompt once, its cache then shared by its G
samples — then one forward per new token over the rows still generating: finished rows are
dropped from the batch (and the cache) as they accumulate, so a batch with a few long answers
does not pay for the short ones.

Where the backend (``postrl.models.backend``) has a faster sampling forward for the model on
the CPU, it runs each step (``postrl.accel``'s: fused, packed weights snapshotted at every
``generate`` call, a preallocated cache, native kernels where the CPU has them); any other
model, any model on a GPU, and every model without a backend, by transformers' own forward.
The sampling loop runs on the model's device; the per-response generators stay on the CPU
(the same draws on any device), and the rollouts come back on the CPU. With
``precision="bf16"`` or ``"bf16-master"`` both sample in bfloat16 from a copy of the current
weights (autocast would re-cast every weight at every token); otherwise in the policy's
dtype. With ``record_forward``, the backend's forward may also write down every
linear layer's output, for an update that then need not recompute them: in float32, or in
bf16 from ``scoring_model``, ``bf16-master``'s working copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn
from transformers import DynamicCache

from postrl.models import backend
from postrl.models.backend import Past
from postrl.models.logprobs import cache_keyword
from postrl.models.precision import bf16_copy, sampling_dtype
from postrl.rollout.base import Rollouts, SamplingParams, cat_right_padded
from postrl.rollout.kept_turns import KeptRow, TurnCache, prefill_inputs
from postrl.rollout.sampling import next_tokens, row_generators

COMPACT_FRACTION = 0.25  # drop finished rows once they are this share of the running batch


class HFRolloutEngine:
    def __init__(self, model, tokenizer, batch_size: int | None = None,
                 precision: str = "fp32", lean: bool = True, entropies: bool = False,
                 record_forward: bool = False) -> None:
        """``lean=False`` samples with transformers' forward even where the backend's applies;
        ``entropies`` records the policy's entropy at every position (``Rollouts.entropies``;
        a pass over the vocabulary per token); ``record_forward`` records the
        sampler's linear outputs for the update (the backend keeps the record, the rollouts
        carry their rows' share, ``Rollouts.kept_rows``; only where the backend's decoding
        samples, all rows in one chunk, and it agrees: its ``recorder``)."""
        self.model = model
        # the model whose forward the update runs: ``model``, or bf16-master's working copy
        # (bf16 weights equal to ``model``'s, rounded), which the fast forward then samples
        # from, so that a record in bf16 is that copy's own forward
        self.scoring_model = model
        self.entropies = entropies
        self.record_forward = record_forward
        # the backend's faster sampling forward for this model (None: transformers')
        self.fast = backend.active().decoding(model) if lean else None
        self.precision = precision
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        eos = {tokenizer.eos_token_id}
        generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos |= set(generation_eos) if isinstance(generation_eos, list) else {generation_eos}
        self.eos_ids = torch.tensor(sorted(e for e in eos if e is not None), dtype=torch.long)
        self.cache_keyword = cache_keyword(model)
        self._copy = None  # the bf16 sampling copy, made on first use
        self._turns: TurnCache | None = None  # within keeping_turns(): the last call's rows

    @contextmanager
    def keeping_turns(self) -> Iterator[None]:
        """Within it, each call keeps the keys and values of its rows that end a turn (EOS
        or a stop string), and the next call prefills a prompt that extends one of them
        from there (``postrl.rollout.kept_turns``): an episode's later turns feed only what
        is new. The weights must not change inside."""
        self._turns = TurnCache()
        try:
            yield
        finally:
            self._turns = None

    def generate(self, prompt_ids: list[list[int]], group_size: int, params: SamplingParams,
                 seed: int, first_prompt: int = 0) -> Rollouts:
        """G samples of each prompt; prompt ``i`` is sampled with the key
        ``(seed, first_prompt + i)`` whatever else is in the call."""
        rows = [list(p) for p in prompt_ids for _ in range(group_size)]
        prompts = [list(p) for p in prompt_ids]
        generators = row_generators(seed, first_prompt, len(prompts), group_size)
        chunk = max((self.batch_size or len(rows)) // group_size, 1)  # prompts per chunk
        columns = max(map(len, prompts)) + params.max_new_tokens
        model = self._sampling_model(min(chunk * group_size, len(rows)), columns)
        # a kept row continues one episode: only calls of one sample per prompt start from one
        matched = [None] * len(prompts)
        if self._turns is not None:
            taken = self._turns.take(prompts)
            matched = taken if group_size == 1 else matched
        record = (self.fast.recorder(self.scoring_model, model, [len(p) for p in prompts],
                                     group_size, params.max_new_tokens)
                  if self.record_forward and _is_snapshot(model) and chunk >= len(prompts)
                  and not any(matched) else None)
        parts = [self._generate_rows(model, prompts[i : i + chunk], group_size, params,
                                     generators[i * group_size : (i + chunk) * group_size],
                                     record, matched[i : i + chunk])
                 for i in range(0, len(prompts), chunk)]
        response_ids, mask, logprobs = (cat_right_padded([p[i] for p in parts], fill)
                                        for i, fill in enumerate((self.pad_id, False, 0.0)))
        entropies = cat_right_padded([p[3] for p in parts], 0.0) if self.entropies else None
        reasons = [r for p in parts for r in p[4]]
        lengths = mask.sum(dim=1)
        generated = [ids[:n].tolist() for ids, n in zip(response_ids, lengths, strict=True)]
        texts = self.tokenizer.batch_decode(generated, skip_special_tokens=True)
        return Rollouts(rows, response_ids, mask, logprobs, lengths, reasons, texts, group_size,
                        entropies,
                        None if record is None else self.fast.kept_rows(record),
                        prefill_lengths=torch.cat([p[5] for p in parts]))

    @torch.no_grad()
    def _sampling_model(self, rows: int, columns: int):
        """What samples this call (``rows`` rows of at most ``columns`` tokens): the backend's
        snapshot of the weights where it fits, else the policy itself or its bf16 copy."""
        dtype = sampling_dtype(self.precision, self.model.dtype)
        if self.fast is not None and model_device(self.model).type == "cpu":
            # the scoring model's weights, in the sampling dtype: the policy's, or those of its
            # bf16 working copy (the same bf16 values, the copy refreshed at every step)
            snapshot = self.fast.snapshot(self.scoring_model, dtype, rows, columns)
            if snapshot is not None:
                return snapshot
        if self.precision == "fp32":
            return self.model
        if self._copy is None:  # bf16 parameters from the start: no float32 copy, no grads
            self._copy = bf16_copy(self.model)
        for mine, theirs in zip(self._copy.parameters(), self.model.parameters(), strict=True):
            mine.copy_(theirs)
        return self._copy

    @torch.inference_mode()
    def _generate_rows(self, model, prompts, group_size, params, generators, record, matched):
        if _is_snapshot(model):
            return self._sample(partial(self.fast.prefill, record=record), model, prompts,
                                group_size, params, (generators, matched))
        was_training = model.training
        model.eval()
        try:
            return self._sample(self._prefill_transformers, model, prompts, group_size, params,
                                (generators, matched))
        finally:
            model.train(was_training)

    def _prefill_transformers(self, model, input_ids, attention, positions, group_size, steps,
                              past: Past | None = None):
        cache = DynamicCache(config=model.config)
        for layer in range(0 if past is None else len(past.keys)):
            cache.update(past.keys[layer], past.values[layer], layer)
        out = model(input_ids=input_ids, attention_mask=attention,
                    position_ids=positions[:, -input_ids.shape[1]:], use_cache=True,
                    logits_to_keep=1, **{self.cache_keyword: cache})
        # the G samples of a prompt share its prefill: repeat the cache, not the computation
        cache.batch_repeat_interleave(group_size)
        logits = out.logits[:, -1].repeat_interleave(group_size, dim=0)
        valid = attention.repeat_interleave(group_size, dim=0)
        return logits, TransformersDecoder(model, cache, valid, self.cache_keyword)

    def _sample(self, prefill, model, prompts: list[list[int]], group_size: int,
                params: SamplingParams, streams: tuple[list[torch.Generator], list]):
        """``streams``: each row's generator, and each prompt's kept row (or None)."""
        generators, matched = streams
        device = model_device(model)  # the loop's tensors live with the weights (CPU or GPU)
        past, *inputs = prefill_inputs(prompts, matched, self.pad_id)
        input_ids, attention, positions = (t.to(device) for t in inputs)
        if past is not None:
            past = Past(past.keys.to(device), past.values.to(device))
        # tokens each prompt fed through the prefill, counted at its first row
        prefilled = torch.zeros(len(prompts) * group_size, dtype=torch.long)
        prefilled[::group_size] = attention[:, -input_ids.shape[1]:].sum(dim=1).cpu()
        eos_ids = self.eos_ids.to(device)
        steps = params.max_new_tokens
        logits, decoder = prefill(model, input_ids, attention, positions, group_size, steps,
                                  past=past)
        next_position = positions[:, -1].repeat_interleave(group_size, dim=0) + 1
        rows = len(next_position)
        tokens = torch.full((rows, steps), self.pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((rows, steps), device=device)
        entropies = torch.zeros((rows, steps), device=device)
        valid = torch.zeros((rows, steps), dtype=torch.bool, device=device)
        reasons = ["length"] * rows
        running = torch.arange(rows, device=device)  # original row of each running row
        alive = torch.ones(rows, dtype=torch.bool, device=device)  # by running position

        def keep_ended() -> None:  # the rows that ended a turn, before they leave the cache
            for i in ([] if self._turns is None else (~alive).nonzero().flatten().tolist()):
                row = int(running[i])
                if reasons[row] != "length":
                    prompt, fed = prompts[row // group_size], int(valid[row].sum()) - 1
                    tokens_fed = tuple(prompt) + tuple(tokens[row, :fed].tolist())
                    self._turns.keep(KeptRow(tokens_fed, *decoder.kept(i, len(prompt), fed)))

        for step in range(steps):
            token, logprob, entropy = next_tokens(
                logits, params, [generators[r] for r in running.tolist()], self.entropies)
            token = token.masked_fill(~alive, self.pad_id)
            tokens[running, step] = token
            logprobs[running, step] = logprob.masked_fill(~alive, 0.0)
            if entropy is not None:
                entropies[running, step] = entropy.masked_fill(~alive, 0.0)
            valid[running, step] = alive  # a token is part of the response iff its row was alive
            ended = alive & torch.isin(token, eos_ids)
            for i in ended.nonzero().flatten().tolist():
                reasons[int(running[i])] = "eos"
            alive &= ~ended
            if params.stop:
                self._apply_stop_strings(tokens[running, : step + 1], alive, running, reasons,
                                         params.stop)
            if not alive.any() or step == steps - 1:
                keep_ended()
                break
            if (~alive).sum() >= COMPACT_FRACTION * len(alive):
                keep_ended()
                keep = alive.nonzero().flatten()
                decoder.select(keep)
                running, next_position, token = running[keep], next_position[keep], token[keep]
                alive = alive[keep]
            logits = decoder.step(token, next_position)
            next_position = next_position + 1
        width = max(int(valid.sum(dim=1).max()), 1)
        return (tokens[:, :width].cpu(), valid[:, :width].cpu(), logprobs[:, :width].cpu(),
                entropies[:, :width].cpu(), reasons, prefilled)

    def _apply_stop_strings(self, generated, alive, running, reasons, stop) -> None:
        """End (in place) every live row whose decoded text now contains a stop string."""
        for i in alive.nonzero().flatten().tolist():
            text = self.tokenizer.decode(generated[i].tolist(), skip_special_tokens=True)
            if any(s in text for s in stop):
                alive[i] = False
                reasons[int(running[i])] = "stop"


def left_padded(prompts: list[list[int]], pad_id: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention, positions)`` ``[prompts, P]`` of prompts padded on the left,
    which keeps every prompt's last token in the last column."""
    return prefill_inputs(prompts, [None] * len(prompts), pad_id)[1:]


def model_device(model) -> torch.device:
    """Where ``model`` computes: a backend's snapshot of the weights on the CPU; a
    transformers model (the fallback, e.g. on a GPU) wherever its parameters are."""
    if _is_snapshot(model):
        return torch.device("cpu")
    return next(model.parameters()).device


def _is_snapshot(model) -> bool:
    """Whether ``model`` is a backend's snapshot of weights (not a module to call)."""
    return not isinstance(model, nn.Module)


class TransformersDecoder:
    """transformers' own forward at every token over its dynamic cache (any causal LM)."""

    def __init__(self, model, cache, valid: torch.Tensor, cache_keyword: str) -> None:
        self.model, self.cache, self.valid, self.cache_keyword = model, cache, valid, cache_keyword
        self.prompt_columns = valid.shape[1]

    def kept(self, row: int, prompt: int, fed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Running row ``row``'s keys and values of its ``prompt`` tokens and the ``fed``
        response tokens after them, ``[layers, kv_heads, prompt + fed, dim]``."""
        start, stop = self.prompt_columns - prompt, self.prompt_columns + fed
        return tuple(torch.stack([getattr(layer, name)[row, :, start:stop]
                                  for layer in self.cache.layers])
                     for name in ("keys", "values"))

    def select(self, keep: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep)
        self.valid = self.valid[keep]

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.valid = torch.cat([self.valid, self.valid.new_ones((len(tokens), 1))], dim=1)
        out = self.model(input_ids=tokens[:, None], attention_mask=self.valid,
                         position_ids=positions[:, None], use_cache=True,
                         **{self.cache_keyword: self.cache})
        return out.logits[:, -1]

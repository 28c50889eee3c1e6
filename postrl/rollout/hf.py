"""The default rollout backend: a lean sampling loop over a transformers causal LM.

All ``P*G`` rows are generated together (in chunks of ``batch_size`` rows) with a KV cache:
one prefill over the left-padded prompts — each prompt once, its cache then shared by its G
samples — then one forward per new token. The engine shares
the policy's module, so it always samples from the current weights.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from postrl.models.precision import autocast
from postrl.rollout.base import Rollouts, SamplingParams, cat_right_padded
from postrl.rollout.sampling import next_tokens


class HFRolloutEngine:
    def __init__(self, model, tokenizer, batch_size: int | None = None,
                 precision: str = "fp32") -> None:
        self.model = model
        self.precision = precision
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        eos = {tokenizer.eos_token_id}
        generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos |= set(generation_eos) if isinstance(generation_eos, list) else {generation_eos}
        self.eos_ids = torch.tensor(sorted(e for e in eos if e is not None), dtype=torch.long)
        # transformers renamed `past_key_values` to `cache` (5.2x); use whichever it takes
        parameters = inspect.signature(model.forward).parameters
        self.cache_keyword = "cache" if "cache" in parameters else "past_key_values"

    def generate(
        self, prompt_ids: list[list[int]], group_size: int, params: SamplingParams, seed: int
    ) -> Rollouts:
        rows = [list(p) for p in prompt_ids for _ in range(group_size)]
        generator = torch.Generator().manual_seed(seed)
        prompts = [list(p) for p in prompt_ids]
        chunk = max((self.batch_size or len(rows)) // group_size, 1)  # prompts per chunk
        parts = [self._generate_rows(prompts[i : i + chunk], group_size, params, generator)
                 for i in range(0, len(prompts), chunk)]
        response_ids, mask, logprobs = (cat_right_padded([p[i] for p in parts], fill)
                                        for i, fill in enumerate((self.pad_id, False, 0.0)))
        reasons = [r for p in parts for r in p[3]]
        lengths = mask.sum(dim=1)
        generated = [ids[:n].tolist() for ids, n in zip(response_ids, lengths, strict=True)]
        texts = self.tokenizer.batch_decode(generated, skip_special_tokens=True)
        return Rollouts(rows, response_ids, mask, logprobs, lengths, reasons, texts, group_size)

    @torch.inference_mode()
    def _generate_rows(self, prompts: list[list[int]], group_size: int, params: SamplingParams,
                       generator):
        was_training = self.model.training
        self.model.eval()
        try:
            with autocast(self.precision):
                return self._sample(prompts, group_size, params, generator)
        finally:
            self.model.train(was_training)

    def _sample(self, prompts: list[list[int]], group_size: int, params: SamplingParams,
                generator):
        prompt_len = max(len(r) for r in prompts)
        input_ids = torch.full((len(prompts), prompt_len), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), prompt_len), dtype=torch.long)
        for i, row in enumerate(prompts):  # left padding keeps every row's last token aligned
            input_ids[i, prompt_len - len(row):] = torch.tensor(row)
            attention[i, prompt_len - len(row):] = 1
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                         use_cache=True, logits_to_keep=1, **{self.cache_keyword: cache})
        # the G samples of a prompt share its prefill: repeat the cache, not the computation
        cache.batch_repeat_interleave(group_size)
        out.logits = out.logits.repeat_interleave(group_size, dim=0)
        attention = attention.repeat_interleave(group_size, dim=0)
        positions = positions.repeat_interleave(group_size, dim=0)
        batch = attention.shape[0]
        tokens, logprobs, valid = [], [], []
        alive = torch.ones(batch, dtype=torch.bool)
        reasons = ["length"] * batch
        next_position = positions[:, -1:] + 1
        for step in range(params.max_new_tokens):
            token, logprob = next_tokens(out.logits[:, -1], params, generator)
            tokens.append(token.masked_fill(~alive, self.pad_id))
            logprobs.append(logprob.masked_fill(~alive, 0.0))
            valid.append(alive.clone())  # a token is part of the response iff its row was alive
            ended = alive & torch.isin(token, self.eos_ids)
            for i in ended.nonzero().flatten().tolist():
                reasons[i] = "eos"
            alive &= ~ended
            if params.stop:
                self._apply_stop_strings(tokens, alive, reasons, params.stop)
            if not alive.any() or step == params.max_new_tokens - 1:
                break
            attention = torch.cat([attention, torch.ones((batch, 1), dtype=torch.long)], dim=1)
            out = self.model(input_ids=tokens[-1].unsqueeze(1), attention_mask=attention,
                             position_ids=next_position, use_cache=True,
                             **{self.cache_keyword: cache})
            next_position = next_position + 1
        return (torch.stack(tokens, dim=1), torch.stack(valid, dim=1),
                torch.stack(logprobs, dim=1), reasons)

    def _apply_stop_strings(self, tokens, alive, reasons, stop) -> None:
        """End (in place) every live row whose decoded text now contains a stop string."""
        generated = torch.stack(tokens, dim=1)
        for i in alive.nonzero().flatten().tolist():
            text = self.tokenizer.decode(generated[i].tolist(), skip_special_tokens=True)
            if any(s in text for s in stop):
                alive[i] = False
                reasons[i] = "stop"

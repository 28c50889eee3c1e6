"""The ``vllm`` rollout backend, for GPU machines (``pip install 'postrl[vllm]'``).

The same ``RolloutEngine`` protocol as the ``hf`` backend, over ``vllm.LLM``: each of the G
samples of prompt ``i`` is one request with its own seed, keyed by ``(seed, first_prompt + i,
sample)``, so a round split over several engines samples what one engine would (vLLM's
samples differ from the ``hf`` backend's: another sampler). Prompts share their KV cache
through vLLM's prefix caching. After each training step ``load_weights`` copies the new
weights into the engine (``LLM.collective_rpc`` into its workers) and drops cached prefixes.

The recorded log-probs are vLLM's ``processed_logprobs``: after temperature, and after
top-k/top-p when those are on (the ``hf`` backend records them before truncation): the
distribution vLLM actually drew from, which the mismatch correction weighs against
(``postrl.objectives.mismatch``; docs/recipes.md).
vLLM is imported when an engine is built, never at import time.
"""

from __future__ import annotations

import os
import tempfile

import torch

from postrl.errors import ConfigError
from postrl.rollout.base import Rollouts, SamplingParams, cat_right_padded

FINISH = {"length": "length", "abort": "length"}


def sample_seed(seed: int, prompt: int, sample: int) -> int:
    """The seed of one sample: a function of the round's seed and the prompt's index in the
    round, never of the engine that draws it."""
    return hash((seed, prompt, sample)) % (2**31)


def _load_weights(worker, named: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside each vLLM worker (``collective_rpc``): Hugging Face names, vLLM's loader
    fuses them (q/k/v, gate/up) into its own layout."""
    worker.model_runner.model.load_weights(weights=named)


class VLLMRolloutEngine:
    def __init__(self, model_dir: str, tokenizer, precision: str = "fp32",
                 gpu_memory_utilization: float = 0.8) -> None:
        try:
            from vllm import LLM
        except ImportError as err:
            raise ConfigError("rollout_backend=vllm needs vLLM: pip install 'postrl[vllm]' on "
                              f"a machine with an NVIDIA GPU ({err})") from None
        # weights travel to the engine's workers as pickled tensors (collective_rpc)
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.llm = LLM(model=model_dir, dtype="bfloat16" if precision == "bf16" else "float32",
                       enable_prefix_caching=True, gpu_memory_utilization=gpu_memory_utilization,
                       logprobs_mode="processed_logprobs")

    @classmethod
    def from_policy(cls, lm, tokenizer, precision: str = "fp32") -> VLLMRolloutEngine:
        """An engine over the current weights of ``lm`` (saved once to a scratch directory,
        which also serves models without one of their own, like ``tiny``)."""
        scratch = tempfile.mkdtemp(prefix="postrl-vllm-")
        lm.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        return cls(scratch, tokenizer, precision)

    def generate(self, prompt_ids: list[list[int]], group_size: int, params: SamplingParams,
                 seed: int, first_prompt: int = 0) -> Rollouts:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        requests, settings = [], []
        for i, prompt in enumerate(prompt_ids):
            for sample in range(group_size):
                requests.append(TokensPrompt(prompt_token_ids=list(prompt)))
                settings.append(VLLMSamplingParams(
                    n=1, temperature=params.temperature, top_p=params.top_p,
                    top_k=params.top_k or -1, max_tokens=params.max_new_tokens,
                    stop=list(params.stop) or None, include_stop_str_in_output=True,
                    seed=sample_seed(seed, first_prompt + i, sample), logprobs=0))
        outputs = self.llm.generate(requests, settings, use_tqdm=False)
        return self._rollouts(prompt_ids, group_size, [o.outputs[0] for o in outputs])

    def _rollouts(self, prompt_ids, group_size: int, completions) -> Rollouts:
        ids = [torch.tensor(list(c.token_ids), dtype=torch.long).reshape(1, -1)
               for c in completions]
        logprobs = [torch.tensor([_sampled_logprob(step, token)
                                  for step, token in zip(c.logprobs or [], c.token_ids,
                                                         strict=False)],
                                 dtype=torch.float32).reshape(1, -1) for c in completions]
        lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.long)
        response_ids = cat_right_padded(ids, self.pad_id)
        mask = torch.arange(response_ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
        reasons = [FINISH.get(c.finish_reason) or ("stop" if isinstance(c.stop_reason, str)
                                                   else "eos") for c in completions]
        return Rollouts(
            prompt_ids=[list(p) for p in prompt_ids for _ in range(group_size)],
            response_ids=response_ids, response_mask=mask,
            logprobs=cat_right_padded(logprobs, 0.0, width=response_ids.shape[1]),
            lengths=lengths, finish_reasons=reasons, texts=[c.text for c in completions],
            group_size=group_size)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """New trainable weights (Hugging Face names) into the engine; cached prefixes, which
        the old weights computed, are dropped."""
        self.llm.collective_rpc(_load_weights, args=(list(weights.items()),))
        self.llm.reset_prefix_cache()


def _sampled_logprob(step: dict, token: int) -> float:
    return float(step[token].logprob) if step and token in step else 0.0

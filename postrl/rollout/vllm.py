"""The ``vllm`` rollout backend, for GPU machines (``pip install 'postrl[vllm]'``).

The same ``RolloutEngine`` protocol as the ``hf`` backend, over ``vllm.LLM``: each of the G
samples of prompt ``i`` is one request with its own seed, keyed by ``(seed, first_prompt + i,
sample)``, so a round split over several engines samples what one engine would (vLLM's
samples differ from the ``hf`` backend's: another sampler). Prompts share their KV cache
through vLLM's prefix caching. The engine runs in bf16 for either bf16 precision (``bf16``,
``bf16-master``) and in float32 only for ``fp32``; its share of the GPU's memory, its longest
sequence and whether it captures CUDA graphs come from the run's ``vllm_*`` options
(:class:`VLLMOptions`). After each training step ``load_weights`` copies the new weights,
cast to the engine's dtype, into the engine's workers (``LLM.collective_rpc``, one call per
bucket of bounded size, so no copy of the whole model is pickled at once) and then drops
cached prefixes.

The recorded log-probs are vLLM's ``processed_logprobs``: after temperature, and after
top-k/top-p when those are on (the ``hf`` backend records them before truncation): the
distribution vLLM actually drew from, which the mismatch correction weighs against
(``postrl.objectives.mismatch``; docs/recipes.md).
vLLM is imported when an engine is built, never at import time.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from postrl.buckets import consecutive_buckets
from postrl.errors import ConfigError
from postrl.models.precision import sampling_dtype
from postrl.rollout.base import Rollouts, SamplingParams, cat_right_padded

FINISH = {"length": "length", "abort": "length"}
VLLM_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
BUCKET_BYTES = 256 * 2**20  # per collective_rpc: bounds the pickled copy, not the call count


@dataclass(frozen=True)
class VLLMOptions:
    """The run's settings for ``vllm.LLM`` (``vllm_*`` in :class:`postrl.config.TrainConfig`,
    with the same defaults)."""

    gpu_memory_utilization: float = 0.5
    max_model_len: int | None = None  # None: the model's context
    enforce_eager: bool = False

    @classmethod
    def from_config(cls, cfg) -> VLLMOptions:
        return cls(gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                   max_model_len=cfg.vllm_max_model_len, enforce_eager=cfg.vllm_enforce_eager)


def engine_dtype(precision: str) -> torch.dtype:
    """bf16 for either bf16 precision, float32 for ``fp32`` (which also rules out vLLM's
    fastest attention kernels): the rule the ``hf`` sampler follows."""
    return sampling_dtype(precision, torch.float32)


def sample_seed(seed: int, prompt: int, sample: int) -> int:
    """The seed of one sample: a function of the round's seed and the prompt's index in the
    round, never of the engine that draws it."""
    return hash((seed, prompt, sample)) % (2**31)


def weight_buckets(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                   limit: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``weights`` cast to ``dtype``, in order, grouped into consecutive buckets of at most
    ``limit`` bytes; a tensor larger than ``limit`` goes alone. Each tensor is cast as its
    bucket fills, so at most one bucket's cast copies exist at a time."""
    cast = ((name, tensor.detach().to(dtype)) for name, tensor in weights)
    yield from consecutive_buckets(cast, lambda item: item[1].numel() * item[1].element_size(),
                                   limit)


def _load_weights(worker, named: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside each vLLM worker (``collective_rpc`` pickles it by reference, so it stays
    at module level): Hugging Face names, which vLLM's loader fuses (q/k/v, gate/up) into its
    own layout, one tensor at a time, so a bucket may hold part of a fused weight."""
    worker.model_runner.get_model().load_weights(weights=named)


class VLLMRolloutEngine:
    def __init__(self, model_dir: str, tokenizer, precision: str = "fp32",
                 options: VLLMOptions = VLLMOptions()) -> None:
        try:
            from vllm import LLM
        except ImportError as err:
            raise ConfigError("rollout_backend=vllm needs vLLM: pip install 'postrl[vllm]' on "
                              f"a machine with an NVIDIA GPU ({err})") from None
        # weights travel to the engine's workers as pickled tensors (collective_rpc)
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.dtype = engine_dtype(precision)
        self.llm = LLM(model=model_dir, dtype=VLLM_DTYPES[self.dtype], enable_prefix_caching=True,
                       gpu_memory_utilization=options.gpu_memory_utilization,
                       max_model_len=options.max_model_len, enforce_eager=options.enforce_eager,
                       logprobs_mode="processed_logprobs")

    @classmethod
    def from_policy(cls, lm, tokenizer, precision: str = "fp32",
                    options: VLLMOptions = VLLMOptions()) -> VLLMRolloutEngine:
        """An engine over the current weights of ``lm`` (saved once to a scratch directory,
        which also serves models without one of their own, like ``tiny``)."""
        scratch = tempfile.mkdtemp(prefix="postrl-vllm-")
        lm.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        return cls(scratch, tokenizer, precision, options)

    @classmethod
    def from_config(cls, lm, tokenizer, cfg) -> VLLMRolloutEngine:
        """:meth:`from_policy` in the run's sampling precision, with its ``vllm_*`` options."""
        return cls.from_policy(lm, tokenizer, cfg.sampling_precision, VLLMOptions.from_config(cfg))

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

    def load_weights(self, weights: dict[str, torch.Tensor],
                     bucket_bytes: int = BUCKET_BYTES) -> None:
        """New trainable weights (Hugging Face names, any dtype: float32 masters too) into the
        engine, cast to its dtype, one ``collective_rpc`` per bucket of at most
        ``bucket_bytes``; then the cached prefixes, which the old weights computed, are
        dropped."""
        for bucket in weight_buckets(weights.items(), self.dtype, bucket_bytes):
            self.llm.collective_rpc(_load_weights, args=(bucket,))
        self.llm.reset_prefix_cache()


def _sampled_logprob(step: dict, token: int) -> float:
    return float(step[token].logprob) if step and token in step else 0.0

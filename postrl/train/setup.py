"""What a run is built from, shared by the trainer and the Ray workers (which import this
module, never the trainer): the policy as configured, its optimizers, where it computes, and
what the sampler records for the update."""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from postrl.config import TrainConfig
from postrl.envs import is_environment_task
from postrl.errors import ConfigError
from postrl.models import backend, load_policy
from postrl.models.policy import apply_lora, causal_lm
from postrl.recipes import Recipe
from postrl.rollout.episodes import EpisodeLimits
from postrl.train.row_skipping import unscored_rows_possible


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_trained_policy(cfg: TrainConfig):
    """``(policy, tokenizer)``: the model of ``cfg`` with LoRA adapters if asked (every
    process that holds a replica builds it this way, and chooses its backend here)."""
    backend.use(cfg.backend)
    model, tokenizer = load_policy(cfg.model, seed=cfg.seed)
    if cfg.lora.r:
        model = apply_lora(model, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout,
                           cfg.lora.target_modules)
    if cfg.gradient_checkpointing:
        checkpoint_layers(causal_lm(model), cfg.model)
    return model, tokenizer


def checkpoint_layers(model, name: str) -> None:
    """Recompute ``model``'s decoder layers in the backward (transformers' flag on each
    layer, which postrl's own layers read too: :mod:`postrl.models.layers`); a critic
    copied from it afterwards inherits the flag."""
    # transformers renamed gradient_checkpointing_enable during 5.x
    enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
    try:
        enable({"use_reentrant": False})
    except ValueError as err:  # a model class without the layers' hook
        raise ConfigError(f"gradient_checkpointing: model {name!r} cannot: {err}") from None


def make_optimizers(cfg: TrainConfig, policy, critic):
    """AdamW for the trainable policy weights, and for the critic if there is one."""
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad],
                                  lr=cfg.lr, betas=tuple(cfg.adam_betas),
                                  weight_decay=cfg.weight_decay, fused=True)
    critic_optimizer = (torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, fused=True)
                        if critic is not None else None)
    return optimizer, critic_optimizer


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """The learning rate's multiplier at ``step``: linear warm-up, then ``lr_schedule``."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = min((step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1), 1.0)
    if cfg.lr_schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def on_device(model: torch.nn.Module, device: torch.device) -> None:
    """Move ``model`` to ``device``; on a GPU its transformers forward (the sampler's there)
    uses PyTorch's fused attention (SDPA) instead of the CPU's plain matmul-softmax."""
    model.to(device)
    if device.type == "cuda":
        causal_lm(model).set_attn_implementation("sdpa")


def records_entropies(cfg: TrainConfig, recipe: Recipe) -> bool:
    """Whether the sampler records its entropies for this run: only where the update can
    stand them in for the forward of rows without a gradient."""
    return unscored_rows_possible(recipe, recipe.policy_loss_config(cfg.max_new_tokens),
                                  cfg.updates_per_batch)


def records_forward(cfg: TrainConfig) -> bool:
    """Whether the sampler records its forward for the update (``reuse_sampler_forward``,
    a backend's record): where the update's forward runs in this process, in the
    sampler's dtype, on the weights the sampler ran (one update per batch): ``fp32``, and
    ``bf16-master``, whose sampler runs the bf16 working copy that the update trains
    (``bf16`` autocast trains float32 weights: no). The engine then records only calls the
    backend's sampling forward runs, in one chunk, where the backend agrees. With
    ``torch_compile`` too: layers reading a record run eagerly (faster than compiled ones,
    which stay for micro-batches without a record). Not with LoRA: the update runs peft's
    layers, which read no record. Not with stale samples (``max_staleness``): their sampler
    ran older weights."""
    return (cfg.reuse_sampler_forward and not cfg.build_recipe().max_staleness
            and not cfg.lora.r and cfg.launcher == "local"
            and cfg.train_workers == 1
            and cfg.rollout_backend == "hf" and cfg.precision in ("fp32", "bf16-master")
            and cfg.sampling_precision == cfg.precision
            and cfg.updates_per_batch == 1)


def reward_specs(rewards: list, defaults: tuple[str, ...]) -> list[tuple[str, float]]:
    """``rewards`` entries are a name/spec or ``{fn: spec, weight: w}``; [] = the task's."""
    if not rewards:
        return [(name, 1.0) for name in defaults]
    specs = []
    for entry in rewards:
        if isinstance(entry, dict):
            specs.append((entry.get("fn"), entry.get("weight", 1.0)))
        else:
            specs.append((entry, 1.0))
    return specs



def episode_limits(cfg: TrainConfig, model, task) -> EpisodeLimits | None:
    """An environment task's episode limits (``max_turns``, ``max_new_tokens`` over the whole
    episode, the model's context); None for a single-turn task."""
    if not is_environment_task(task):
        return None
    return EpisodeLimits.for_model(cfg.max_turns, cfg.max_new_tokens, model)

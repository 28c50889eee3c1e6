"""What a comparison will write to disk, said before it starts and checked against the free
space: each run's final policy, and its checkpoints while it runs (a finished run needs none
to resume: ``compare`` removes them unless ``--keep-checkpoints``).

Sizes are estimates from the model's parameter count (its config, on PyTorch's meta device:
nothing is loaded): float32 weights (4 bytes a parameter) in the final policy; a checkpoint
holds the weights, AdamW's two moments of every trained parameter, and a critic's copy of the
body with its own optimizer state (``postrl/train/resume.py``). Logs are small beside them.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

from postrl.config import TrainConfig
from postrl.errors import ConfigError
from postrl.models.loading import TINY, load_tokenizer, resolve_model_dir, tiny_config

FLOAT32 = 4  # bytes


def parameter_count(model: str) -> int:
    """Parameters of the model ``model`` names, counted without loading its weights."""
    with torch.device("meta"):
        if model == TINY:
            tokenizer = load_tokenizer(model)
            net = LlamaForCausalLM(tiny_config(len(tokenizer), tokenizer.eos_token_id))
        else:
            config = AutoConfig.from_pretrained(str(resolve_model_dir(model)))
            net = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in net.parameters())


@dataclass(frozen=True)
class RunSize:
    """Bytes of one run: its final policy, and one of its checkpoints."""

    final: int
    checkpoint: int


def run_size(cfg: TrainConfig, parameters: int) -> RunSize:
    """The estimate for a run of ``cfg`` on a model of ``parameters`` parameters."""
    weights = parameters * FLOAT32
    trained = parameters if not cfg.lora.r else parameters // 100  # adapters: ~1% or less
    checkpoint = weights + 2 * trained * FLOAT32
    if cfg.build_recipe().critic:  # the value model's body, its head and its AdamW moments
        checkpoint += 3 * weights
    return RunSize(final=weights, checkpoint=checkpoint)


def checkpoints_held(cfg: TrainConfig) -> int:
    """The most checkpoints a run of ``cfg`` holds at once: ``keep_last`` and the one being
    written; with ``keep_last=0`` (keep every one), all it saves in ``steps``."""
    if not cfg.save_every:
        return 0
    if cfg.keep_last > 0:
        return cfg.keep_last + 1
    steps = cfg.steps
    if cfg.token_budget is not None:  # at least one token a response: at most this many steps
        steps = min(steps, -(-cfg.token_budget // (cfg.prompts_per_step * cfg.group_size)))
    return max(steps // cfg.save_every, 1)


def disk_plan(configs: list[TrainConfig], keep_checkpoints: bool,
              keep_weights: bool = True) -> tuple[int, str]:
    """``(bytes, one line)``: the most the runs of ``configs`` hold on disk at once, run one
    after another. Pruned, a finished run keeps its final policy only, and the running one
    its checkpoints (:func:`checkpoints_held`); kept, every run keeps them. Without
    ``keep_weights`` a finished run keeps its final policy's configuration, not its weights
    (the running one holds them once, while it saves)."""
    parameters = parameter_count(configs[0].model)
    sizes = [run_size(cfg, parameters) for cfg in configs]
    held = [checkpoints_held(cfg) for cfg in configs]
    finals = sum(s.final for s in sizes) if keep_weights else max(s.final for s in sizes)
    per_run = [s.checkpoint * n for s, n in zip(sizes, held, strict=True)]
    total = finals + (sum(per_run) if keep_checkpoints else max(per_run))
    kept = "kept" if keep_checkpoints else "removed once each run has finished"
    policies = (f"{len(configs)} final policies of {sizes[0].final / 1e6:.0f} MB"
                if keep_weights else
                f"one final policy of {sizes[0].final / 1e6:.0f} MB at a time (the weights "
                "removed once each run has finished)")
    line = (f"disk: about {total / 1e9:.2f} GB: {policies}, up to {max(held)} checkpoints of "
            f"{sizes[0].checkpoint / 1e6:.0f} MB a run ({kept})")
    return total, line


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def drop_weights(final: Path) -> None:
    """Remove the weight files of a saved policy, keeping its configuration, tokenizer and
    chat template (so the run still reads as finished)."""
    for path in final.iterdir() if final.is_dir() else ():
        if path.suffix in WEIGHT_SUFFIXES:
            path.unlink()


def check_free_space(out: Path, needed: int, line: str) -> None:
    """ConfigError when the disk that will hold ``out`` has less than ``needed`` bytes free."""
    existing = out.resolve()
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if free < needed:
        raise ConfigError(f"{line}, but the disk holding {out} has {free / 1e9:.2f} GB free: "
                          "free some space, choose another --out, or lower keep_last")

"""What a rollout engine returns, and the protocol every backend implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from postrl.errors import ConfigError
from postrl.models.backend import RecordHandle

FINISH_REASONS = ("eos", "length", "stop")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling shared by every recipe of a comparison. ``temperature=0`` is greedy decoding.

    ``top_k=0`` and ``top_p=1`` disable truncation. The recorded log-probs are those of the
    temperature-scaled distribution *before* top-k/top-p truncation: the same policy the
    trainer evaluates (as TRL and verl do).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty")


@dataclass
class Rollouts:
    """``N = P*G`` sampled responses, the G samples of each prompt adjacent.

    ``response_ids``, ``response_mask`` (bool), ``logprobs`` and ``entropies`` are
    right-padded ``[N, T]``; the mask covers every generated token, the final EOS or stop
    token included. ``entropies`` is None where the backend does not report them (vLLM).
    """

    prompt_ids: list[list[int]]  # one entry per response (prompts repeated G times)
    response_ids: Tensor
    response_mask: Tensor
    logprobs: Tensor  # log-prob of each sampled token under the sampling policy; 0 off-mask
    lengths: Tensor  # [N] long
    finish_reasons: list[str]
    texts: list[str]  # decoded responses, special tokens removed
    group_size: int
    entropies: Tensor | None = None  # the sampling policy's entropy at each position; 0 off-mask
    # the sampler's forward, recorded for the update by a backend (opened only by it)
    recorded: RecordHandle | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


class RolloutEngine(Protocol):
    """Generates G samples for each prompt. Seeded: the same seed gives the same samples."""

    def generate(
        self, prompt_ids: list[list[int]], group_size: int, params: SamplingParams, seed: int
    ) -> Rollouts: ...


def cat_right_padded(parts: list[Tensor], fill=0, width: int | None = None) -> Tensor:
    """Stack ``[n_i, T_i]`` row blocks into one ``[sum n_i, width]`` tensor, right-padding each
    with ``fill`` (``width`` defaults to the widest block)."""
    width = max(p.shape[1] for p in parts) if width is None else width
    return torch.cat([F.pad(p, (0, width - p.shape[1]), value=fill) for p in parts])


def select_rows(rollouts: Rollouts, start: int, stop: int) -> Rollouts:
    """Rows ``start:stop`` (e.g. one prompt's group), padding trimmed to their longest row."""
    lengths = rollouts.lengths[start:stop]
    width = max(int(lengths.max()), 1) if len(lengths) else 1
    return Rollouts(
        prompt_ids=rollouts.prompt_ids[start:stop],
        response_ids=rollouts.response_ids[start:stop, :width],
        response_mask=rollouts.response_mask[start:stop, :width],
        logprobs=rollouts.logprobs[start:stop, :width],
        lengths=lengths,
        finish_reasons=rollouts.finish_reasons[start:stop],
        texts=rollouts.texts[start:stop],
        group_size=stop - start,
        entropies=None if rollouts.entropies is None else rollouts.entropies[start:stop, :width],
        recorded=None if rollouts.recorded is None else rollouts.recorded.select(start, stop),
    )

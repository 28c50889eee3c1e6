"""Rollout engines: generate G responses per prompt with their sampling log-probs."""

from postrl.rollout.base import FINISH_REASONS, RolloutEngine, Rollouts, SamplingParams
from postrl.rollout.hf import HFRolloutEngine

__all__ = ["FINISH_REASONS", "HFRolloutEngine", "RolloutEngine", "Rollouts", "SamplingParams"]

"""Reward functions (TRL's signature), verifiers, shaping and the weighted Scorer."""

from postrl.rewards.base import RewardFunction
from postrl.rewards.countdown import countdown_reward, evaluate_expression, extract_expression
from postrl.rewards.math_answer import answers_match, extract_answer, format_reward, math_answer
from postrl.rewards.reasoning_gym import first_answer, reasoning_gym_reward
from postrl.rewards.registry import BUILTIN_REWARDS, load_reward, reward_name
from postrl.rewards.reward_model import RewardModel, load_reward_model
from postrl.rewards.scorer import ScoredRewards, Scorer
from postrl.rewards.shaping import soft_overlong_penalty

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFunction",
    "RewardModel",
    "ScoredRewards",
    "Scorer",
    "answers_match",
    "countdown_reward",
    "evaluate_expression",
    "extract_answer",
    "extract_expression",
    "first_answer",
    "format_reward",
    "load_reward",
    "load_reward_model",
    "math_answer",
    "reasoning_gym_reward",
    "reward_name",
    "soft_overlong_penalty",
]

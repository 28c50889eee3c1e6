"""Pure tensor maths of RL post-training: advantages, ratios, surrogates, aggregation, KL.

No models, no I/O, no config objects beyond the small dataclasses defined here. Every
function cites the paper and equation it implements; docs/algorithms.md is the specification.
"""

from postrl.objectives import advantages, ratios, surrogates
from postrl.objectives.aggregation import AGGREGATIONS, BatchCounts, aggregate
from postrl.objectives.diagnostics import Diagnostics
from postrl.objectives.kl import entropy_from_logits, kl_penalty
from postrl.objectives.policy_loss import (
    RATIO_UNITS,
    LossOutput,
    PolicyLossConfig,
    PolicyLossInputs,
    policy_loss,
)
from postrl.objectives.value_loss import clipped_value_loss

__all__ = [
    "AGGREGATIONS",
    "RATIO_UNITS",
    "BatchCounts",
    "Diagnostics",
    "LossOutput",
    "PolicyLossConfig",
    "PolicyLossInputs",
    "advantages",
    "aggregate",
    "clipped_value_loss",
    "entropy_from_logits",
    "kl_penalty",
    "policy_loss",
    "ratios",
    "surrogates",
]

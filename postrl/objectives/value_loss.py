"""PPO's clipped value loss for the critic (docs/algorithms.md §5)."""

from __future__ import annotations

from torch import Tensor


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, clip_eps: float | None
) -> tuple[Tensor, Tensor]:
    """Per-token ``1/2 * max((V - G)^2, (V_old + clip(V - V_old, -eps, eps) - G)^2)``.

    PPO's value clipping (as in OpenAI baselines' ppo2); ``clip_eps=None`` gives the plain
    squared error. Returns ``(loss [N, T], clipped [N, T] bool)``, where ``clipped`` marks the
    tokens whose clipped error was the larger one. Aggregate with ``aggregation.aggregate``.
    """
    returns, old_values = returns.detach(), old_values.detach()
    plain = (values - returns).square()
    if clip_eps is None:
        return 0.5 * plain, plain != plain  # all False
    clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    clipped = (clipped_values - returns).square()
    return 0.5 * clipped.maximum(plain), (clipped > plain).detach()

"""Reward shaping terms added to the verifier's reward."""

from __future__ import annotations

from postrl.errors import ConfigError


def soft_overlong_penalty(
    lengths: list[int], max_new_tokens: int, buffer: int, factor: float = 1.0
) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), times ``factor``.

    With ``L_max = max_new_tokens`` and ``L_cache = buffer``, a response of length ``L`` gets
    0 if ``L <= L_max - L_cache``, ``((L_max - L_cache) - L) / L_cache`` inside the buffer, and
    -1 beyond ``L_max`` (impossible with a hard generation limit; kept for completeness).
    """
    if not 0 < buffer < max_new_tokens:
        raise ConfigError(
            f"overlong buffer (L_cache) must be in (0, max_new_tokens={max_new_tokens}), "
            f"got {buffer}"
        )
    threshold = max_new_tokens - buffer
    penalties: list[float] = []
    for length in lengths:
        if length <= threshold:
            penalties.append(0.0)
        elif length <= max_new_tokens:
            penalties.append(factor * (threshold - length) / buffer)
        else:
            penalties.append(-1.0 * factor)
    return penalties

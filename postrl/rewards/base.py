"""The reward-function protocol, compatible with TRL's ``reward_funcs`` signature."""

from __future__ import annotations

from typing import Any, Protocol


class RewardFunction(Protocol):
    """``fn(prompts, completions, **columns) -> list[float | None]``.

    ``prompts`` and ``completions`` are lists of strings of equal length; ``columns`` holds one
    list per dataset column (``answer=[...]``), aligned with them. ``None`` means "this function
    does not apply to this sample" and is left out of the weighted sum, as in TRL.
    """

    def __call__(
        self, prompts: list[str], completions: list[str], **columns: Any
    ) -> list[float | None]: ...

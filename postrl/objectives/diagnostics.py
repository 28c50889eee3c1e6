"""Loss diagnostics that merge exactly across micro-batches and ranks.

A micro-batch records each statistic as its share of a global-batch sum (already divided by
the global counts), a minimum or a maximum. Merging the micro-batches of one optimizer step,
in any split, gives the statistics of the whole batch. Derived statistics (standard
deviations) are stored as moments and finished in :meth:`Diagnostics.finish`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_MOMENT = "_moment/"


@dataclass
class Diagnostics:
    sums: dict[str, float] = field(default_factory=dict)
    mins: dict[str, float] = field(default_factory=dict)
    maxs: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, share: float) -> None:
        """Add ``share`` (a partial sum already normalised by global counts) to ``name``."""
        self.sums[name] = self.sums.get(name, 0.0) + float(share)

    def low(self, name: str, value: float) -> None:
        self.mins[name] = min(self.mins.get(name, math.inf), float(value))

    def high(self, name: str, value: float) -> None:
        self.maxs[name] = max(self.maxs.get(name, -math.inf), float(value))

    def add_std(self, name: str, mean_share: float, square_share: float) -> None:
        """Record first and second moments (shares of E[x], E[x^2]) of a shifted quantity x."""
        self.add(f"{_MOMENT}{name}/1", mean_share)
        self.add(f"{_MOMENT}{name}/2", square_share)

    def merge(self, other: Diagnostics) -> Diagnostics:
        merged = Diagnostics(dict(self.sums), dict(self.mins), dict(self.maxs))
        for name, value in other.sums.items():
            merged.add(name, value)
        for name, value in other.mins.items():
            merged.low(name, value)
        for name, value in other.maxs.items():
            merged.high(name, value)
        return merged

    def finish(self) -> dict[str, float]:
        """Plain metrics: sums, minima, maxima and the standard deviations from moments."""
        out = {k: v for k, v in self.sums.items() if not k.startswith(_MOMENT)}
        out.update(self.mins)
        out.update(self.maxs)
        for key, first in self.sums.items():
            if key.startswith(_MOMENT) and key.endswith("/1"):
                name = key[len(_MOMENT) : -2]
                second = self.sums[f"{_MOMENT}{name}/2"]
                out[name] = math.sqrt(max(second - first * first, 0.0))
        return out

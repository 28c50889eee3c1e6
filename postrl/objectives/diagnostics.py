"""Loss diagnostics that merge exactly across micro-batches and ranks.

A micro-batch records each statistic as its share of a global-batch sum (already divided by
the global counts), a minimum or a maximum. Merging the micro-batches of one optimizer step,
in any split, gives the statistics of the whole batch. Derived statistics (standard
deviations; means over only the rows that carry a quantity, such as the sampler's log-probs;
their exponentials, such as perplexities) are stored as sums and finished in
:meth:`Diagnostics.finish`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_MOMENT = "_moment/"
_MEAN = "_mean/"  # {_MEAN}{name}/num and /den
_EXP_MEAN = "_expmean/"  # the same, finished as exp(num / den)
_ESS = "_ess/"  # {_ESS}{name}/1, /2 and /n: sums of w, w^2 and the count


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

    def add_mean(self, name: str, total: float, count: float, exp: bool = False) -> None:
        """Add to a mean over whatever rows report it: ``sum(total) / sum(count)`` at the end
        (``exp``: its exponential, e.g. a perplexity from a mean negative log-likelihood)."""
        prefix = _EXP_MEAN if exp else _MEAN
        self.add(f"{prefix}{name}/num", total)
        self.add(f"{prefix}{name}/den", count)

    def add_ess(self, name: str, weights: float, squares: float, count: float) -> None:
        """Add to a normalised effective sample size ``(sum w)^2 / (n * sum w^2)`` (Kong
        1992): 1 when every weight is equal, 1/n when one weight carries everything."""
        self.add(f"{_ESS}{name}/1", weights)
        self.add(f"{_ESS}{name}/2", squares)
        self.add(f"{_ESS}{name}/n", count)

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
        """Plain metrics: sums, minima, maxima, standard deviations from moments, means."""
        out = {k: v for k, v in self.sums.items()
               if not k.startswith((_MOMENT, _MEAN, _EXP_MEAN, _ESS))}
        out.update(self.mins)
        out.update(self.maxs)
        for key, first in self.sums.items():
            if key.startswith(_MOMENT) and key.endswith("/1"):
                name = key[len(_MOMENT) : -2]
                second = self.sums[f"{_MOMENT}{name}/2"]
                out[name] = math.sqrt(max(second - first * first, 0.0))
            for prefix in (_MEAN, _EXP_MEAN):
                if key.startswith(prefix) and key.endswith("/num"):
                    name = key[len(prefix) : -4]
                    count = self.sums[f"{prefix}{name}/den"]
                    mean = first / count if count else math.nan
                    out[name] = math.exp(mean) if prefix == _EXP_MEAN else mean
            if key.startswith(_ESS) and key.endswith("/1"):
                name = key[len(_ESS) : -2]
                squares, count = self.sums[f"{_ESS}{name}/2"], self.sums[f"{_ESS}{name}/n"]
                out[name] = first * first / (count * squares) if count and squares else math.nan
        return out

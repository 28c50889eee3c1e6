"""Loss diagnostics that merge exactly across micro-batches and ranks.

A micro-batch records each statistic as its share of a global-batch sum (already divided by
the global counts), a minimum or a maximum. Merging the micro-batches of one optimizer step,
in any split, gives the statistics of the whole batch. Derived statistics (standard
deviations; means over only the rows that carry a quantity, such as the sampler's log-probs;
their exponentials, such as perplexities) are stored as sums and finished in
:meth:`Diagnostics.finish`.

Values may be 0-dimensional tensors, left where they were computed: on a GPU, reading each
one (``float(t)``) would stall the host once per statistic and micro-batch, so they are read
together, once per optimizer step (:meth:`Diagnostics.resolved`). A minimum of +inf or a
maximum of -inf means "no value" (a micro-batch without tokens) and is left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

Number = float | Tensor

_MOMENT = "_moment/"
_MEAN = "_mean/"  # {_MEAN}{name}/num and /den
_EXP_MEAN = "_expmean/"  # the same, finished as exp(num / den)
_ESS = "_ess/"  # {_ESS}{name}/1, /2 and /n: sums of w, w^2 and the count


@dataclass
class Diagnostics:
    sums: dict[str, Number] = field(default_factory=dict)
    mins: dict[str, Number] = field(default_factory=dict)
    maxs: dict[str, Number] = field(default_factory=dict)

    def add(self, name: str, share: Number) -> None:
        """Add ``share`` (a partial sum already normalised by global counts) to ``name``."""
        self.sums[name] = self.sums.get(name, 0.0) + _detached(share)

    def low(self, name: str, value: Number) -> None:
        self.mins[name] = _extreme(torch.minimum, min, self.mins.get(name), _detached(value))

    def high(self, name: str, value: Number) -> None:
        self.maxs[name] = _extreme(torch.maximum, max, self.maxs.get(name), _detached(value))

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

    def resolved(self) -> Diagnostics:
        """The same statistics as plain floats, every tensor read in one transfer per device."""
        values = [*self.sums.values(), *self.mins.values(), *self.maxs.values()]
        floats = _to_floats(values)
        keys = ([("sums", k) for k in self.sums] + [("mins", k) for k in self.mins]
                + [("maxs", k) for k in self.maxs])
        out = Diagnostics()
        for (part, key), value in zip(keys, floats, strict=True):
            getattr(out, part)[key] = value
        return out

    def finish(self) -> dict[str, float]:
        """Plain metrics: sums, minima, maxima, standard deviations from moments, means."""
        plain = self.resolved()
        out = {k: v for k, v in plain.sums.items()
               if not k.startswith((_MOMENT, _MEAN, _EXP_MEAN, _ESS))}
        out.update({k: v for k, v in plain.mins.items() if v != math.inf})
        out.update({k: v for k, v in plain.maxs.items() if v != -math.inf})
        for key, first in plain.sums.items():
            if key.startswith(_MOMENT) and key.endswith("/1"):
                name = key[len(_MOMENT) : -2]
                second = plain.sums[f"{_MOMENT}{name}/2"]
                out[name] = math.sqrt(max(second - first * first, 0.0))
            for prefix in (_MEAN, _EXP_MEAN):
                if key.startswith(prefix) and key.endswith("/num"):
                    name = key[len(prefix) : -4]
                    count = plain.sums[f"{prefix}{name}/den"]
                    mean = first / count if count else math.nan
                    out[name] = math.exp(mean) if prefix == _EXP_MEAN else mean
            if key.startswith(_ESS) and key.endswith("/1"):
                name = key[len(_ESS) : -2]
                squares, count = plain.sums[f"{_ESS}{name}/2"], plain.sums[f"{_ESS}{name}/n"]
                out[name] = first * first / (count * squares) if count and squares else math.nan
        return out


def _detached(value: Number) -> Number:
    """Tensors stay where they are, in float64 as a Python float would be."""
    return value.detach().double() if isinstance(value, Tensor) else float(value)


def _extreme(tensor_op, float_op, current: Number | None, value: Number) -> Number:
    """The smaller (larger) of ``current`` and ``value``; a tensor if either is one."""
    if current is None:
        return value
    if isinstance(current, Tensor) or isinstance(value, Tensor):
        like = current if isinstance(current, Tensor) else value
        return tensor_op(torch.as_tensor(current, device=like.device),
                         torch.as_tensor(value, device=like.device))
    return float_op(current, value)


def _to_floats(values: list[Number]) -> list[float]:
    """``values`` as floats: the tensors of each device stacked and copied to the host once."""
    out: list[float | None] = [v if not isinstance(v, Tensor) else None for v in values]
    by_device: dict[torch.device, list[int]] = {}
    for i, value in enumerate(values):
        if isinstance(value, Tensor):
            by_device.setdefault(value.device, []).append(i)
    for indices in by_device.values():
        stacked = torch.stack([values[i].reshape(()).double() for i in indices]).tolist()
        for i, value in zip(indices, stacked, strict=True):
            out[i] = value
    return out

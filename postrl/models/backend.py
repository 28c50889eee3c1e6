"""The one seam between postrl's algorithm and its optional speed-ups.

Everything postrl computes has a plain implementation: PyTorch's operations
(:mod:`postrl.models.ops`) for the training forward, transformers' forward for sampling.
That is :class:`Backend` itself. A backend package subclasses it and overrides what it does
faster, falling back to these methods wherever it does not serve the tensors at hand;
postrl's own, ``postrl.accel``, brings native CPU kernels, a lean sampler and the sampler's
record of its forward. That record is the backend's alone: it makes it, keeps it, reads it
and frees it; the rollouts and batches carry only their rows' share of it, opaque
(:class:`KeptRows`), and the training forward asks :meth:`Backend.kept_forward` whether the
backend serves it from what it kept. Nothing else in postrl imports a backend: :func:`use`
picks one by module name, once, at setup (the trainer and every Ray worker call it), and
:func:`active` hands it out (choosing the default on first use). Deleting ``postrl/accel/``
leaves a postrl that trains with PyTorch's and oneDNN's kernels.
"""

from __future__ import annotations

import contextlib
import importlib
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from postrl.errors import ConfigError
from postrl.models import ops
from postrl.models.vocab import logprob_and_entropy

DEFAULT = "postrl.accel"  # used when importable; PyTorch's operations otherwise


class KeptRows(Protocol):
    """Rows' share of what a backend kept of sampling them (a record of the sampler's
    forward): carried with the rollouts and batches, selected with their rows, and handed back
    to the backend (:meth:`Backend.kept_forward`), which alone looks inside. The backend frees
    what it kept itself: once nothing holds it, or once it is stale (the weights changed)."""

    def select(self, start: int, stop: int) -> KeptRows: ...

    def take(self, rows: Tensor) -> KeptRows: ...

    def join(self, parts: list[KeptRows]) -> KeptRows | None:
        """``parts`` (this one among them) as one, None if they are not one sampling's."""


class KeptForward(Protocol):
    """What a backend kept of the sampler's forward over a micro-batch's rows, opened for one
    training forward of the model it was made with (:meth:`Backend.kept_forward`). Inside
    either context the backend's linears (:meth:`Backend.linears`, :meth:`Backend.kept`)
    return the kept outputs instead of multiplying, with the plain backward."""

    def layers(self, batch, prompts: Tensor, prompt_mask: Tensor, packing
               ) -> AbstractContextManager:
        """Around :func:`postrl.models.layers.body_with_prompts` over ``batch``'s distinct
        prompts (``prompts``: their first rows; ``prompt_mask``), then its packed rows
        (``packing``)."""

    def head(self, rows: Tensor, columns: Tensor) -> AbstractContextManager:
        """Around the LM head over the scored tokens at ``rows`` and response ``columns``, a
        chunk of them per call, in that order."""


@dataclass(frozen=True)
class Past:
    """Kept keys and values a prefill starts from (``postrl.rollout.kept_turns``),
    ``[layers, rows, kv_heads, Q, dim]``, each row's right-aligned after zeros (padding that
    the attention mask hides)."""

    keys: Tensor
    values: Tensor


class Decoding(Protocol):
    """A backend's faster sampling forward for one model (see :meth:`Backend.decoding`)."""

    def snapshot(self, model, dtype: torch.dtype, rows: int, columns: int) -> object | None:
        """``model``'s weights, ready to sample ``rows`` rows of at most ``columns`` tokens
        (prompt and response) at a time in ``dtype``; None where this call would not fit in
        memory (transformers samples it instead)."""

    def prefill(self, weights, input_ids: Tensor, attention: Tensor, positions: Tensor,
                group_size: int, steps: int, record, past: Past | None = None
                ) -> tuple[Tensor, object]:
        """``(first logits, decoder)``: the decoder has ``step(tokens, positions)``,
        ``select(rows)`` and ``kept(row, prompt, fed)``, as
        ``postrl.rollout.hf.TransformersDecoder``. ``past``: kept keys and values the prompts
        continue (:class:`Past`; ``attention`` and ``positions`` cover its columns too)."""

    def recorder(self, model, weights, prompt_lengths: list[int], group_size: int,
                 max_new: int) -> object | None:
        """A record of this call's forward, which the backend keeps for the update to read
        (or None: not worth it, or it does not fit)."""

    def kept_rows(self, record) -> KeptRows:
        """``record``'s rows, in the call's order (``Rollouts.kept_rows``)."""


class Backend:
    """PyTorch's operations and transformers' sampling forward; a backend overrides what it
    does faster."""

    name = "torch"

    def reason(self) -> str | None:
        """Why this backend's own kernels are not used here (None: they are, or it has none)."""
        return None

    # the training forward (postrl.models.layers, logprobs, precision)
    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return ops.rms_norm(x, weight, eps)

    def swiglu(self, gate: Tensor, up: Tensor) -> Tensor:
        return ops.swiglu(gate, up)

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return ops.rotate(x, cos, sin)

    def attention(self, query: Tensor, keys: Tensor, values: Tensor, bias: Tensor,
                  scale: float) -> Tensor:
        return ops.attention(query, keys, values, bias, scale)

    def linears(self, x: Tensor, weights: list[Tensor], biases: list[Tensor | None]
                ) -> list[Tensor]:
        """``[x W_i^T + b_i]`` for linears that read the same ``x`` (the weights are the
        model's parameters)."""
        return [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]

    def input_grad(self, grad: Tensor, weight: Tensor) -> Tensor:
        """``grad W`` (``grad [..., out]``, ``W [out, in]``): a linear's input gradient."""
        return grad @ weight

    def logprob_and_entropy(self, logits: Tensor, targets: Tensor, temperature: float,
                            entropy_grad: bool, with_entropy: bool,
                            consume_logits: bool = False) -> tuple[Tensor, Tensor | None]:
        """:func:`postrl.models.vocab.logprob_and_entropy` (``consume_logits``: see
        there)."""
        return logprob_and_entropy(logits, targets, temperature, entropy_grad, with_entropy,
                                   consume_logits=consume_logits)

    def add_into(self, into: Tensor, grad: Tensor) -> None:
        """``into += grad`` in place (a bf16 gradient into its float32 master's)."""
        into.add_(grad)

    # what the sampler kept of its forward, read by the update's (postrl.models.logprobs)
    def kept_forward(self, model, rows: KeptRows | None) -> KeptForward | None:
        """What this backend kept of sampling ``rows`` (a batch's ``kept_rows``) that
        ``model``'s forward may read now instead of multiplying: None where it kept nothing
        for them, or not for ``model``'s weights as they are (PyTorch's keeps nothing)."""
        return None

    def kept(self, x: Tensor, weights: list[Tensor]) -> list[Tensor] | None:
        """The values of ``x W_i^T`` that an open :class:`KeptForward` holds for these
        weights (the model's parameters), None where none does."""
        return None

    def recompute_contexts(self) -> tuple[AbstractContextManager, AbstractContextManager]:
        """``torch.utils.checkpoint``'s ``context_fn``: a checkpointed layer recomputed in the
        backward reads what its forward read."""
        return contextlib.nullcontext(), contextlib.nullcontext()

    # the sampler (postrl.rollout)
    def decoding(self, model) -> Decoding | None:
        """A faster sampling forward for ``model`` on the CPU (None: transformers' own)."""
        return None

    def draws(self, logits: Tensor) -> bool:
        """Whether :meth:`draw` serves these ``[rows, vocab]`` logits."""
        return False

    def draw(self, logits: Tensor, temperature: float, draws: Tensor, with_entropy: bool
             ) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(tokens, logprobs, entropies or None)`` of an untruncated draw by inversion of the
        uniform ``draws [rows]`` (``postrl.rollout.sampling``'s rule), where :meth:`draws`."""
        raise NotImplementedError(f"backend {self.name} does not draw tokens")


_active: Backend | None = None


def use(name: str = "auto") -> Backend:
    """Make the backend ``name`` the one every forward uses from now on, and return it:
    ``"torch"`` (PyTorch's operations), a backend's module name (its ``backend()``), or
    ``"auto"``: :data:`DEFAULT` when it is installed, else ``"torch"``."""
    global _active
    _active = _load(name)
    return _active


def active() -> Backend:
    """The backend in use (``use("auto")``'s on first call)."""
    return _active if _active is not None else use()


def _load(name: str) -> Backend:
    if name == "torch":
        return Backend()
    module_name = DEFAULT if name == "auto" else name
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if name == "auto" and error.name == module_name:  # not installed (deleted)
            return Backend()
        raise ConfigError(f"backend={name}: cannot import {module_name} ({error}); "
                          f"use backend=torch or backend=auto") from error
    return module.backend()


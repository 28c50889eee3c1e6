"""postrl's CPU backend: native kernels and a lean sampler, behind ``postrl.models.backend``.

Nothing outside this package imports it; ``postrl.models.backend.use`` loads it by name once
(:func:`backend`), and deleting this folder leaves a postrl that trains with PyTorch's and
oneDNN's kernels. Inside, in the order a step meets them:

- the sampler: :mod:`.decoding` (the backend's ``Decoding``) over :mod:`.lean_weights`
  (weights packed once per ``generate``) and :mod:`.lean` (the decode loop, a preallocated KV
  cache), recording its forward for the update (:mod:`.recorded`); :mod:`.native`, the
  sampler's kernels;
- the update's forward and backward: :mod:`.fused` (element-wise work), :mod:`.vocab` (the
  vocabulary's log-probability and entropy), :mod:`.tiles` and :mod:`.tile_attention` (bf16
  products and attention on AMX tiles);
- underneath: :mod:`.library`, the one shared library and its one table of C functions, built
  from ``csrc/`` by :mod:`.build`.
"""

from __future__ import annotations

import contextlib

from postrl.accel import fused, recorded, tile_attention, tiles, vocab
from postrl.accel.decoding import LeanDecoding
from postrl.accel.lean import unsupported_reason
from postrl.accel.library import unavailable_reason
from postrl.accel.native import native_kernels
from postrl.models import ops
from postrl.models.backend import Backend


class AccelBackend(Backend):
    """PyTorch's operations, replaced where these kernels serve the tensors at hand."""

    name = "postrl.accel"

    def reason(self) -> str | None:
        return unavailable_reason()

    def rms_norm(self, x, weight, eps):
        return fused.rms_norm(x, weight, eps)

    def swiglu(self, gate, up):
        return fused.swiglu(gate, up)

    def rotate(self, x, cos, sin):
        return fused.rotate(x, cos, sin)

    def attention(self, query, keys, values, bias, scale):
        if tile_attention.serves(query, keys, values, bias):
            return tile_attention.attention(query, keys, values, bias, scale)
        fuses = fused.fuses_attention(query, bias, keys.shape[2])
        return ops.attention(query, keys, values, bias, scale,
                             fused.attention_weights if fuses else None)

    def linears(self, x, weights, biases):
        outputs = recorded.kept_outputs(x, weights)  # the sampler's record, where it is open
        if len(weights) > 1 and tiles.serves_together(x, weights):
            return tiles.linears(x, weights, biases, outputs)
        if outputs is None:
            return [tiles.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
        return [recorded.recorded_linear(x, w, o, b)
                for w, b, o in zip(weights, biases, outputs, strict=True)]

    def input_grad(self, grad, weight):
        return tiles.input_grad(grad, weight)

    def logprob_and_entropy(self, logits, targets, temperature, entropy_grad, with_entropy,
                            consume_logits=False):
        if vocab.serves(logits, targets):
            return vocab.logprob_and_entropy(logits, targets, temperature, entropy_grad,
                                             with_entropy, consume_logits)
        return super().logprob_and_entropy(logits, targets, temperature, entropy_grad,
                                           with_entropy, consume_logits)

    def add_into(self, into, grad):
        fused.add_into(into, grad)

    def kept_forward(self, model, rows):
        return None if rows is None else rows.open(model)

    def kept(self, x, weights):
        return recorded.kept_outputs(x, weights)

    def recompute_contexts(self):
        what = recorded.current_reading()
        return (contextlib.nullcontext(),
                contextlib.nullcontext() if what is None else recorded.reading(what))

    def decoding(self, model):
        return LeanDecoding() if unsupported_reason(model) is None else None

    def draws(self, logits):
        return logits.device.type == "cpu" and native_kernels() is not None

    def draw(self, logits, temperature, draws, with_entropy):
        return native_kernels().sample(logits, temperature, draws, with_entropy)


def backend() -> AccelBackend:
    return AccelBackend()

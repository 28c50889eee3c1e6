"""The lean sampler as the backend's ``Decoding`` (``postrl.models.backend``): weights
snapshotted for sampling, the lean decoder, and the record of its forward for the update."""

from __future__ import annotations

import os

import torch

from postrl.accel.lean import LeanDecoder
from postrl.accel.lean_weights import LeanWeights
from postrl.accel.recorded import (
    RecordedForward,
    RecordedRows,
    RecordMemory,
    flops_per_recorded_byte,
    record_bytes,
    record_dtype,
)
from postrl.models import layers

# the most of the machine's memory a recorded forward may take (at most, every slot written)
RECORD_MEMORY_SHARE = 0.25
# the least a recorded forward must save per byte written and read back: below it (a narrow
# model whose forward is mostly its LM head), reading a record measured slower than
# multiplying (docs/performance.md)
RECORD_MIN_FLOPS_PER_BYTE = 100.0


class LeanDecoding:
    """One engine's lean sampling of a Llama-style model (its records share one memory)."""

    def __init__(self) -> None:
        self._record_memory = RecordMemory()

    def snapshot(self, model, dtype: torch.dtype, rows: int) -> LeanWeights:
        return LeanWeights.of(model, dtype, rows)

    def prefill(self, weights: LeanWeights, input_ids, attention, positions, group_size: int,
                steps: int, record: RecordedForward | None):
        decoder = LeanDecoder(weights, input_ids, attention, positions, group_size, steps,
                              record=record)
        return decoder.first_logits, decoder

    def recorder(self, model, weights: LeanWeights, prompt_lengths: list[int],
                 group_size: int, max_new: int) -> RecordedForward | None:
        """A record of ``model``'s forward as ``weights`` sample it, where the weights are in
        the record's dtype, the training forward can read it (not through LoRA layers), the
        record fits :data:`RECORD_MEMORY_SHARE` of the memory and saves at least
        :data:`RECORD_MIN_FLOPS_PER_BYTE`; else None."""
        if (weights.dtype != record_dtype(model) or layers.unsupported_reason(model) is not None
                or flops_per_recorded_byte(model) < RECORD_MIN_FLOPS_PER_BYTE):
            return None
        size = record_bytes(model, len(prompt_lengths), max(prompt_lengths), group_size, max_new)
        if size > RECORD_MEMORY_SHARE * physical_memory_bytes():
            return None
        return RecordedForward(model, prompt_lengths, group_size, max_new, self._record_memory)

    @staticmethod
    def handle(record: RecordedForward, rows: int) -> RecordedRows:
        return RecordedRows(record, torch.arange(rows))


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

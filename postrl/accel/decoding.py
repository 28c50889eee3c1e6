"""The lean sampler as the backend's ``Decoding`` (``postrl.models.backend``): weights
snapshotted for sampling, the lean decoder, and the record of its forward for the update."""

from __future__ import annotations

import os
import resource
import sys

import torch

from postrl.accel.lean import LeanDecoder
from postrl.accel.lean_weights import LeanWeights
from postrl.accel.recorded import (
    RECORDS,
    RecordedForward,
    RecordedRows,
    RecordMemory,
    flops_per_recorded_byte,
    record_bytes,
    record_dtype,
)
from postrl.models import layers
from postrl.process import free_heap_bytes

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

    def snapshot(self, model, dtype: torch.dtype, rows: int, columns: int) -> LeanWeights | None:
        """The lean sampler's weights, or None where they and its cache would need more
        memory than is available now (:func:`sampling_bytes`): transformers samples then,
        with the policy's own weights and a cache that grows."""
        if sampling_bytes(model, dtype, rows, columns) > available_memory_bytes():
            return None
        return LeanWeights.of(model, dtype, rows)

    def prefill(self, weights: LeanWeights, input_ids, attention, positions, group_size: int,
                steps: int, record: RecordedForward | None, past=None):
        decoder = LeanDecoder(weights, input_ids, attention, positions, group_size, steps,
                              record=record, past=past)
        return decoder.first_logits, decoder

    def recorder(self, model, weights: LeanWeights, prompt_lengths: list[int],
                 group_size: int, max_new: int) -> RecordedForward | None:
        """A record of ``model``'s forward as ``weights`` sample it, where the weights are in
        the record's dtype, the training forward can read it (not through LoRA layers), the
        record fits :data:`RECORD_MEMORY_SHARE` of the memory and saves at least
        :data:`RECORD_MIN_FLOPS_PER_BYTE`; else None. Records gone stale are released first
        (``RECORDS``): their memory goes to this one."""
        RECORDS.sweep()
        if (weights.dtype != record_dtype(model) or layers.unsupported_reason(model) is not None
                or flops_per_recorded_byte(model) < RECORD_MIN_FLOPS_PER_BYTE):
            return None
        size = record_bytes(model, len(prompt_lengths), max(prompt_lengths), group_size, max_new)
        if size > RECORD_MEMORY_SHARE * physical_memory_bytes():
            return None
        return RECORDS.add(RecordedForward(model, prompt_lengths, group_size, max_new,
                                           self._record_memory))

    @staticmethod
    def kept_rows(record: RecordedForward) -> RecordedRows:
        return RecordedRows(record, torch.arange(record.rows))


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def sampling_bytes(model, dtype: torch.dtype, rows: int, columns: int) -> int:
    """About what the lean sampler allocates to sample ``rows`` rows of at most ``columns``
    prompt and response tokens from ``model`` in ``dtype``: its packed copy of the linear
    weights, and its key/value cache twice (while rows leave, the shared prompt columns and
    the per-row copy are both held)."""
    config, body = model.config, model.model
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    linears = sum(m.in_features * m.out_features for m in body.modules()
                  if isinstance(m, torch.nn.Linear))
    linears += model.lm_head.in_features * model.lm_head.out_features
    cache = (2 * len(body.layers) * rows * config.num_key_value_heads * columns * head_dim)
    return (linears + 2 * cache) * torch.empty((), dtype=dtype).element_size()


def available_memory_bytes() -> int:
    """The memory this process may still take: the kernel's estimate of what is available
    (``MemAvailable``), and no more than its data limit (``RLIMIT_DATA``) leaves, each plus
    what its C heap holds free for reuse; where neither is known (not Linux), no limit."""
    available = _proc_bytes("/proc/meminfo", "MemAvailable")
    limit = resource.getrlimit(resource.RLIMIT_DATA)[0]
    if limit != resource.RLIM_INFINITY:
        left = limit - _data_bytes()
        available = left if available is None else min(available, left)
    return sys.maxsize if available is None else available + free_heap_bytes()


def _data_bytes() -> int:
    """This process's data segment (``VmData``: what ``RLIMIT_DATA`` counts), 0 unknown."""
    return _proc_bytes("/proc/self/status", "VmData") or 0


def _proc_bytes(path: str, field: str) -> int | None:
    """A ``field:  N kB`` line of a /proc file, in bytes (None where there is none)."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None

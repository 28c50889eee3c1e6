"""The sampler's forward, recorded for the update: the training forward multiplies by nothing.

With one update per batch, the update's forward runs the weights the sampler has just run, on
the tokens it has just produced: every linear layer's output in the training forward is, up
to float rounding, one the sampler already computed, token by token. The lean sampler
(``postrl.accel.lean``) can write those outputs down (:class:`RecordedForward`: each
layer's q|k|v, attention output, gate|up and down projections, and the logits), and the
training forward (``postrl.models.layers.body_with_prompts``) then reads them instead of
multiplying. The rollouts and the training batch carry a :class:`RecordedRows` (the
``KeptRows`` of ``postrl.models.backend``), which only this backend opens
(``Backend.kept_forward``); inside its contexts the backend's linears read the record
(:func:`kept_outputs`), each found by its weight. Everything between the linears (embedding,
RMSNorm, rotation, attention, SiLU, residual sums, the log-softmax) still runs, so autograd
has every input a backward needs, and the backward is the plain one: ``dx = dy W``,
``dW = dy^T x``. A third of the training's matmuls go.

The record is in the dtype of the model whose forward it stands for: float32 for ``fp32``,
bf16 for ``bf16-master``'s working copy (the sampler then runs that copy's own weights).

The two forwards differ only by rounding (other matmul shapes, the sampler's fused kernels),
as two micro-batch sizes do; every ratio stays exactly 1 (the old log-probs are the
forward's own, detached). A record is only used while the weights are those it was made
with (:meth:`RecordedForward.fresh`): parameters' version counters, bumped by in-place
changes (``load_state_dict``, an optimizer's ``foreach`` step; the update bumps them after
a fused optimizer's step, which does not). The backend frees a record itself
(:data:`RECORDS`): when nothing holds it any more, or at the next recording once it is
stale.

Slots: the prompts' columns first (``prompts x P``, left-padded as the sampler prefilled
them), then the decode steps' in order, each step's running rows side by side (the column
that feeds response token ``k`` of row ``r``: :meth:`RecordedForward.decode_slots`), then
one slot of zeros for the padding of a training layout.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from postrl.accel import tiles

KINDS = ("qkv", "out", "gate_up", "down")  # the linears of a layer, in the sampler's fusion


def parameter_versions(model: nn.Module) -> tuple[int, ...]:
    """Every parameter's version counter: changed by any in-place write to the weights."""
    return tuple(p._version for p in model.parameters())


def shape_of(model: nn.Module) -> tuple[tuple[int, ...], int, int]:
    """``(widths of KINDS, layers, vocabulary)`` of a Llama-style causal LM."""
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    widths = (sum(m.out_features for m in (attn.q_proj, attn.k_proj, attn.v_proj)),
              attn.o_proj.out_features, mlp.gate_proj.out_features + mlp.up_proj.out_features,
              mlp.down_proj.out_features)
    return widths, len(model.model.layers), model.lm_head.out_features


def record_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of ``model``'s linear outputs, and so of its record: its weights'."""
    return model.lm_head.weight.dtype


def flops_per_recorded_byte(model: nn.Module) -> float:
    """What reading a record saves per byte it holds: each token's linear and LM-head
    multiply-adds (2 FLOPs each) over the bytes of their outputs (:func:`record_dtype`).
    About ``hidden / 2`` in float32 (the vocabulary dominates a narrow model's), twice that in
    bf16."""
    body = model.model.layers
    linears = [m for layer in body for m in layer.modules() if isinstance(m, nn.Linear)]
    linears.append(model.lm_head)
    flops = sum(2 * m.in_features * m.out_features for m in linears)
    return flops / (record_dtype(model).itemsize * sum(m.out_features for m in linears))


def record_bytes(model: nn.Module, prompts: int, prompt_width: int, group_size: int,
                 max_new: int) -> int:
    """The most memory a record of one ``generate`` call can take (every slot written)."""
    widths, layers, vocab = shape_of(model)
    slots = prompts * (prompt_width + group_size * max_new) + 1
    return slots * (layers * sum(widths) + vocab) * record_dtype(model).itemsize


class RecordMemory:
    """Memory for one record at a time, handed to the next record once the last is gone.

    A record of ``make bench``'s batch writes about a gigabyte; in fresh memory, each of its
    pages first costs a page fault, and glibc returns a freed block this large to the kernel
    (past its largest trim threshold). Kept here, the next record writes pages already
    mapped."""

    def __init__(self) -> None:
        self._tensors: list[Tensor] = []
        self._owner: weakref.ref | None = None

    def take(self, owner: object, widths: list[int], slots: int,
             dtype: torch.dtype = torch.float32) -> list[Tensor]:
        """``[slots, width]`` of ``dtype`` for each of ``widths``, the memory of the last
        record if it is gone and its tensors are as wide, at least as long and of ``dtype``,
        else new."""
        last = self._tensors
        if (self._owner is not None and self._owner() is not None) or not (
                [t.shape[1] for t in last] == widths and all(len(t) >= slots for t in last)
                and all(t.dtype == dtype for t in last)):
            # empty: a slot is read only once written; the decode steps fill them in order, so
            # the pages after the last step's are never touched (they take no memory)
            last = [torch.empty(slots + slots // 8, width, dtype=dtype) for width in widths]
        self._tensors, self._owner = last, weakref.ref(owner)
        return [t[:slots] for t in last]

    def release(self, owner: object) -> None:
        """``owner`` is done with its memory: the next record takes it, whoever still holds
        ``owner``."""
        if self._owner is not None and self._owner() is owner:
            self._owner = None


class RecordedForward:
    """One ``generate`` call's linear outputs (in :func:`record_dtype`), written as it
    samples ``model``'s own weights."""

    def __init__(self, model: nn.Module, prompt_lengths: list[int], group_size: int,
                 max_new: int, memory: RecordMemory | None = None) -> None:
        widths, layers, vocab = shape_of(model)
        self.prompts, self.prompt_width = len(prompt_lengths), max(prompt_lengths)
        self.group_size, self.max_new = group_size, max_new
        self.response_start = self.prompts * self.prompt_width
        self.rows = rows = self.prompts * group_size
        self.zero = self.response_start + rows * max_new  # after every slot a step can fill
        self._memory = memory or RecordMemory()
        tensors = self._memory.take(self, [*widths * layers, vocab], self.zero + 1,
                                    record_dtype(model))
        self.linears = [tensors[i : i + len(widths)]
                        for i in range(0, len(widths) * layers, len(widths))]
        self.logits = tensors[-1]
        for tensor in tensors:
            tensor[self.zero].zero_()
        # the slot of each row's response column (the zero slot until a step writes it)
        self.response_slot = torch.full((rows, max_new), self.zero, dtype=torch.long)
        self.filled = self.response_start
        self.model, self.versions = model, parameter_versions(model)

    def fresh(self, model: nn.Module) -> bool:
        """Whether ``model`` is the one recorded, with the weights it had (never after
        :meth:`release`)."""
        return model is self.model and parameter_versions(model) == self.versions

    def stale(self) -> bool:
        """Whether no forward can read this record any more: its model's weights changed
        since, or it was released."""
        return self.model is None or not self.fresh(self.model)

    def release(self) -> None:
        """Done with (stale): its memory goes to the next record, even while something still
        holds this object, and nothing reads it again. Something did hold it: math_verify's
        parse cache keeps antlr's recognition exceptions, whose tracebacks keep every frame up
        the stack, the trainer's step with its batch among them (bench/log.md); each such
        step kept its record's gigabyte alive."""
        self.model = None  # fresh() is False from now on
        self.linears, self.logits = [], torch.empty(0)
        self._memory.release(self)

    def next_block(self, rows: Tensor, column: int) -> slice:
        """The slots where a decode step over ``rows`` (rows of the ``generate`` call) writes
        response ``column``: the next ``len(rows)``, one contiguous block (a plain copy)."""
        block = slice(self.filled, self.filled + len(rows))
        self.response_slot[rows, column] = torch.arange(block.start, block.stop)
        self.filled = block.stop
        return block

    def decode_slots(self, rows: Tensor, column: Tensor | int) -> Tensor:
        """The slots of response ``column`` of ``rows`` (rows of the ``generate`` call)."""
        return self.response_slot[rows, column]

    def prompt_last_slots(self) -> Tensor:
        """Each prompt's last column: its logits predict the first response token."""
        return torch.arange(1, self.prompts + 1) * self.prompt_width - 1


class Records:
    """The records this process has made, held weakly: a record lives while its rows
    (:class:`RecordedRows`, carried by rollouts and batches) do, and :meth:`sweep` releases
    those that are stale however long they are held, before the next record takes memory."""

    def __init__(self) -> None:
        self._made: weakref.WeakSet[RecordedForward] = weakref.WeakSet()

    def add(self, record: RecordedForward) -> RecordedForward:
        self._made.add(record)
        return record

    def sweep(self) -> None:
        """Release every stale record (its memory goes to the next)."""
        for record in list(self._made):
            if record.stale():
                record.release()
                self._made.discard(record)


RECORDS = Records()


@dataclass
class RecordedRows:
    """Rows' view of a record: the ``generate`` row of each (the backend's ``KeptRows``);
    opened (:meth:`open`) for one forward of the recorded ``model``."""

    record: RecordedForward
    rows: Tensor  # [N]
    model: nn.Module | None = None  # the model it is open for

    def select(self, start: int, stop: int) -> RecordedRows:
        return RecordedRows(self.record, self.rows[start:stop])

    def take(self, rows: Tensor) -> RecordedRows:
        return RecordedRows(self.record, self.rows[rows])

    def join(self, parts: list[RecordedRows]) -> RecordedRows | None:
        """``parts``' rows as one, None unless they are all rows of this record."""
        if any(not isinstance(p, RecordedRows) or p.record is not self.record for p in parts):
            return None
        return RecordedRows(self.record, torch.cat([p.rows for p in parts]))

    def open(self, model: nn.Module) -> RecordedRows | None:
        """These rows for ``model``'s forward now (the backend's ``KeptForward``): while the
        record is that of ``model`` at its current weights, outside autocast (the record is in
        the weights' dtype, autocast computes in another); else None."""
        if torch.is_autocast_enabled("cpu") or not self.record.fresh(model):
            return None
        return RecordedRows(self.record, self.rows, model)

    def layers(self, batch, prompts: Tensor, prompt_mask: Tensor, packing
               ) -> contextlib.AbstractContextManager:
        """Inside, the backend's linears of ``model``'s layers read their recorded outputs for
        every token :func:`postrl.models.layers.body_with_prompts` runs: the distinct
        prompts' (``prompts``: their first rows), then the packed rows'."""
        prompt_slots = self.prompt_slots(prompts, batch.prompt_width, prompt_mask)
        prompt_lengths = batch.attention_mask[:, : batch.prompt_width].sum(dim=1)
        rows = packing.segments  # negative on padding
        columns = packing.position_ids - prompt_lengths[rows.clamp(min=0)]
        slots = torch.cat([prompt_slots.flatten(), self.response_slots(rows, columns).flatten()])
        groups = {}  # each group of linears the sampler fuses, by its weights: layer and kind
        for i, layer in enumerate(self.model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            fused = ((attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,),
                     (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,))
            groups.update({tuple(id(m.weight) for m in group): (i, kind)
                           for kind, group in enumerate(fused)})
        return reading(_LayerReading(self.record, slots, groups))

    def head(self, rows: Tensor, columns: Tensor) -> contextlib.AbstractContextManager:
        """Inside, the LM head's linear reads the recorded logits that predict response
        ``columns`` of micro-batch ``rows``, the next of them at each call."""
        return reading(_HeadReading(self.record, self.logit_slots(rows, columns),
                                    self.model.lm_head.weight))

    def prompt_slots(self, prompt_rows: Tensor, width: int, mask: Tensor) -> Tensor:
        """``[n, width]`` slots of the distinct prompts (micro-batch rows ``prompt_rows``),
        left-padded to ``width`` under ``mask``; padding reads the zero slot."""
        record = self.record
        prompt = self.rows[prompt_rows] // record.group_size
        columns = torch.arange(width) + (record.prompt_width - width)
        slots = prompt[:, None] * record.prompt_width + columns
        return torch.where(mask.bool(), slots, record.zero)

    def response_slots(self, row: Tensor, column: Tensor) -> Tensor:
        """Slots of response ``column`` of micro-batch ``row`` (same shapes); a negative row
        is padding and reads the zero slot."""
        record = self.record
        slots = record.decode_slots(self.rows[row.clamp(min=0)], column.clamp(min=0))
        return torch.where(row >= 0, slots, record.zero)

    def logit_slots(self, row: Tensor, column: Tensor) -> Tensor:
        """Slots of the logits that predict response ``column`` of micro-batch ``row``: the
        prompt's last column for the first token, else the previous response column."""
        record = self.record
        rows = self.rows[row]
        first = record.prompt_last_slots()[rows // record.group_size]
        return torch.where(column == 0, first, record.decode_slots(rows, column - 1))

    def layer(self, index: int, slots: Tensor) -> list[Tensor]:
        """Layer ``index``'s recorded outputs at ``slots``, one tensor per :data:`KINDS`."""
        return [t.index_select(0, slots) for t in self.record.linears[index]]


class _LayerReading:
    """The layers' recorded outputs at ``slots``, found by the weights of each group."""

    def __init__(self, record: RecordedForward, slots: Tensor,
                 groups: dict[tuple[int, ...], tuple[int, int]]) -> None:
        self.record, self.slots, self.groups = record, slots, groups

    def outputs(self, x: Tensor, weights: list[Tensor]) -> list[Tensor] | None:
        place = self.groups.get(tuple(id(w) for w in weights))
        if place is None:
            return None
        layer, kind = place
        joined = self.record.linears[layer][kind].index_select(0, self.slots)
        return list(joined.split([w.shape[0] for w in weights], dim=-1))


class _HeadReading:
    """The recorded logits at ``slots``, the next ``len(x)`` of them at each call."""

    def __init__(self, record: RecordedForward, slots: Tensor, weight: Tensor) -> None:
        self.record, self.slots, self.weight, self.read = record, slots, weight, 0

    def outputs(self, x: Tensor, weights: list[Tensor]) -> list[Tensor] | None:
        if len(weights) != 1 or weights[0] is not self.weight:
            return None
        slots = self.slots[self.read : self.read + x.shape[0]]
        self.read += x.shape[0]
        return [self.record.logits.index_select(0, slots)]


_reading: _LayerReading | _HeadReading | None = None  # what the backend's linears read now


@contextlib.contextmanager
def reading(what: _LayerReading | _HeadReading | None) -> Iterator[None]:
    """Inside, :func:`kept_outputs` reads ``what``."""
    global _reading
    before, _reading = _reading, what
    try:
        yield
    finally:
        _reading = before


def current_reading() -> _LayerReading | _HeadReading | None:
    return _reading


def kept_outputs(x: Tensor, weights: list[Tensor]) -> list[Tensor] | None:
    """The recorded outputs of the linears ``weights`` over ``x`` (one group the sampler
    fuses, or the LM head), where an open record holds them; else None."""
    return None if _reading is None else _reading.outputs(x, weights)


class KnownLinear(torch.autograd.Function):
    """``x W^T + b`` whose value ``output`` is already known (the sampler recorded it): the
    forward returns it, the backward is the linear's (:func:`postrl.accel.tiles.backward`:
    on AMX tiles where they serve)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, output: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return (*tiles.backward(grad, *ctx.saved_tensors, ctx.needs_input_grad[:3]), None)


def recorded_linear(x: Tensor, weight: Tensor, output: Tensor,
                    bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` with the value ``output`` already known (same shape),
    its backward on AMX tiles where they serve."""
    return KnownLinear.apply(x, weight, bias, output)

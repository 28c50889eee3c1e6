"""Responses that share a prompt packed into fewer rows of the training forward.

Rows of a micro-batch with the same prompt share its keys and values
(:func:`postrl.models.logprobs.response_hidden`), so their responses can share a row too:
each row's *segment* (its response tokens but the last, which predicts nothing scored) is
placed after another's, and a block-causal attention mask lets each token see its prompt and
the earlier tokens of its own segment only. Position ids restart after the prompt in every
segment, so each token sees exactly the context it has alone: packing without
cross-contamination (Krell et al. 2021, arXiv:2107.02027). The padding of short responses,
otherwise computed up to the micro-batch's longest one, is not.

Segments go into rows as wide as the longest segment, first-fit decreasing within each
prompt, so the packed batch is never wider and never has more rows than the padded one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Packing:
    """The packed response forward of ``N`` rows (``T`` response columns) over ``B`` packed
    rows of ``C`` columns, their prompts' keys and values already computed."""

    prompts: Tensor  # [B]: which distinct prompt each packed row continues
    input_ids: Tensor  # [B, C]
    position_ids: Tensor  # [B, C]
    segments: Tensor  # [B, C]: segment id of each column; a padding column c holds -1 - c
    source: Tensor  # [N * T]: where each row's hidden state at each column comes from, in
    # cat(the prompts' last hidden states [n_prompts], the packed ones [B * C])


def first_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``sizes`` in bins of at most ``capacity``, largest first, each into the
    first bin it fits (every size must be at most ``capacity``)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        slot = next((b for b, free in enumerate(room) if sizes[index] <= free), None)
        if slot is None:
            bins.append([])
            room.append(capacity)
            slot = len(bins) - 1
        bins[slot].append(index)
        room[slot] -= sizes[index]
    return bins


def pack_responses(response_ids: Tensor, response_mask: Tensor, response_positions: Tensor,
                   prompt_of_row: Tensor) -> Packing | None:
    """The packing of rows whose responses (``[N, T]``, right-padded, masks a prefix of each
    row) continue distinct prompt ``prompt_of_row[i]``; None when it would save no row, or a
    mask is not a prefix (masked tokens in mid-response stay out of the context, which only
    the padded layout reproduces)."""
    device = response_ids.device
    response_ids, response_mask, response_positions, prompt_of_row = (
        t.cpu() for t in (response_ids, response_mask, response_positions, prompt_of_row))
    rows, width = response_mask.shape
    lengths = response_mask.sum(dim=1)
    if not torch.equal(response_mask.bool(), torch.arange(width) < lengths[:, None]):
        return None
    segment_sizes = (lengths - 1).clamp(min=0).tolist()  # the last token predicts nothing
    capacity = max(segment_sizes, default=0)
    if capacity == 0:
        return None
    prompt_list = prompt_of_row.tolist()
    bins = []  # (prompt, rows in this packed row)
    for prompt in sorted(set(prompt_list)):
        members = [i for i in range(rows) if prompt_list[i] == prompt and segment_sizes[i]]
        for packed in first_fit_decreasing([segment_sizes[i] for i in members], capacity):
            bins.append((prompt, [members[k] for k in packed]))
    if len(bins) >= rows:
        return None
    input_ids = torch.zeros(len(bins), capacity, dtype=torch.long)
    positions = torch.zeros(len(bins), capacity, dtype=torch.long)
    segments = -1 - torch.arange(capacity).repeat(len(bins), 1)
    n_prompts = int(prompt_of_row.max()) + 1
    source = torch.zeros(rows, width, dtype=torch.long)  # unscored columns: any valid index
    source[:, 0] = prompt_of_row  # the prompt's last hidden state predicts the first token
    for b, (_, members) in enumerate(bins):
        start = 0
        for row in members:
            size = segment_sizes[row]
            end = start + size
            input_ids[b, start:end] = response_ids[row, :size]
            positions[b, start:end] = response_positions[row, :size]
            segments[b, start:end] = row
            source[row, 1 : size + 1] = n_prompts + b * capacity + torch.arange(start, end)
            start = end
    prompts = torch.tensor([prompt for prompt, _ in bins], dtype=torch.long)
    return Packing(*(t.to(device) for t in (prompts, input_ids, positions, segments,
                                            source.view(-1))))


def attention_bias(packing: Packing, prompt_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """``[B, 1, C, P + C]`` additive mask (0 or the dtype's lowest value): every column sees
    its prompt's attended tokens and the earlier columns of its own segment (a padding column
    sees itself, so that no softmax row is empty)."""
    segments = packing.segments
    causal = torch.ones(segments.shape[1], segments.shape[1], dtype=torch.bool,
                        device=segments.device).tril()
    own = (segments[:, :, None] == segments[:, None, :]) & causal
    prompt = prompt_mask.bool()[packing.prompts][:, None, :].expand(-1, segments.shape[1], -1)
    allowed = torch.cat([prompt, own], dim=2)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return bias.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]

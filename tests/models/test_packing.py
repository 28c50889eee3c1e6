"""Packing responses that share a prompt into fewer rows (``postrl/models/packing.py``); the
packed forward against each row scored alone is in ``test_models.py``."""

import torch

from postrl.models.packing import attention_bias, first_fit_decreasing, pack_responses


def test_first_fit_decreasing_places_every_item_once_within_capacity():
    sizes = [4, 1, 3, 2, 2, 4, 1]
    bins = first_fit_decreasing(sizes, capacity=4)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in b) <= 4 for b in bins)
    assert len(bins) == 5  # 17 units in bins of 4: [4] [4] [3 1] [2 2] [1]
    assert first_fit_decreasing([], 4) == []


def test_packed_rows_hold_each_segment_with_its_positions_and_a_block_causal_mask():
    # rows 0, 1, 2 continue prompt 0; row 3 prompt 1. Lengths 4, 2, 3, 4: segments 3, 1, 2, 3
    ids = torch.arange(10, 26).view(4, 4)
    lengths = torch.tensor([4, 2, 3, 4])
    mask = torch.arange(4)[None] < lengths[:, None]
    positions = torch.tensor([5, 5, 5, 7])[:, None] + torch.arange(4)
    packing = pack_responses(ids, mask, positions, torch.tensor([0, 0, 0, 1]))
    assert packing.prompts.tolist() == [0, 0, 1]
    assert packing.segments.tolist() == [[0, 0, 0], [2, 2, 1], [3, 3, 3]]
    assert packing.input_ids.tolist() == [[10, 11, 12], [18, 19, 14], [22, 23, 24]]
    assert packing.position_ids.tolist() == [[5, 6, 7], [5, 6, 5], [7, 8, 9]]
    # hidden states: 2 prompts first, then packed row b column c at 2 + 3 b + c
    source = packing.source.view(4, 4)
    assert source[:, 0].tolist() == [0, 0, 0, 1]  # first tokens: the prompt's last state
    assert source[1, 1].item() == 2 + 3 * 1 + 2 and source[2, 1:3].tolist() == [5, 6]

    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    bias = attention_bias(packing, prompt_mask, torch.float32)
    allowed = (bias == 0)[:, 0].int()
    assert bias.shape == (3, 1, 3, 6) and bias.min() == torch.finfo(torch.float32).min
    assert allowed[1].tolist() == [[0, 1, 1, 1, 0, 0],  # row 2's first token
                                   [0, 1, 1, 1, 1, 0],  # row 2's second
                                   [0, 1, 1, 0, 0, 1]]  # row 1's only token: not row 2's
    assert allowed[2].tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]


def test_padding_columns_see_their_prompt_and_themselves_only():
    """A packed row not full to its width ends in padding columns, which must not leave a
    softmax row empty (an all-masked row is NaN, and NaN times a zero gradient is NaN)."""
    ids = torch.arange(12).view(3, 4)
    mask = torch.arange(4)[None] < torch.tensor([4, 2, 2])[:, None]  # segments 3, 1, 1
    packing = pack_responses(ids, mask, torch.zeros(3, 4, dtype=torch.long),
                             torch.tensor([0, 0, 0]))
    assert packing.segments.tolist() == [[0, 0, 0], [1, 2, -3]]
    bias = attention_bias(packing, torch.tensor([[1, 1]]), torch.bfloat16)
    assert bias.dtype == torch.bfloat16
    assert (bias[1, 0, 2] == 0).tolist() == [True, True, False, False, True]


def test_nothing_is_packed_without_a_gain_or_with_a_gap_in_a_mask():
    ids = positions = torch.zeros(2, 3, dtype=torch.long)
    same = torch.tensor([0, 0])
    assert pack_responses(ids, torch.ones(2, 3, dtype=torch.bool), positions, same) is None
    short = torch.tensor([[True, True, True], [True, True, False]])
    assert pack_responses(ids, short, positions, torch.tensor([0, 1])) is None  # two prompts
    assert pack_responses(ids, short, positions, same) is None  # segments 2 + 1 > width 2
    gappy = torch.tensor([[True, False, True], [True, False, False]])
    assert pack_responses(ids, gappy, positions, same) is None
    assert pack_responses(ids, torch.tensor([[True, True, True], [True, False, False]]),
                          positions, same) is not None  # a one-token response: no segment

"""``postrl.accel.tile_attention``: the training attention's forward and backward on AMX tiles,
against the float64 attention and against PyTorch's bf16 path (``layers._attend`` with the
kernel off), over grouped query heads, padding masks, partial tiles and fully masked rows;
where it serves and where PyTorch's path runs."""

import pytest
import torch

from postrl.accel import native, tile_attention
from postrl.models import layers
from postrl.models.layers import causal_bias

kernels = native.native_kernels()
needs_amx = pytest.mark.skipif(kernels is None or not kernels.amx,
                               reason="no native kernels or no AMX tiles here")
SCALE = 0.125


def inputs(rows: int, heads: int, kv_heads: int, width: int, prompt: int, dim: int = 64,
           masked_row: bool = False):
    """Queries of ``width`` tokens over ``prompt + width`` keys, causal, the first row's
    first three keys and the last row's last five padding (``masked_row``: the first row's
    every key), and an output gradient; bf16."""
    torch.manual_seed(rows * 1000 + width * 10 + prompt)
    columns = prompt + width
    query = torch.randn(rows, heads, width, dim).bfloat16()
    keys, values = (torch.randn(rows, kv_heads, columns, dim).bfloat16() for _ in range(2))
    mask = torch.ones(rows, columns, dtype=torch.long)
    mask[0, :3] = 0
    mask[-1, max(columns - 5, 1):] = 0
    if masked_row:
        mask[0] = 0
    grad = torch.randn(rows, width, heads * dim).bfloat16()
    return query, keys, values, causal_bias(mask, torch.bfloat16, width), grad


def run(attend, query, keys, values, bias, grad):
    """``attend``'s output and the gradients of the queries, keys and values."""
    query, keys, values = (t.detach().clone().requires_grad_() for t in (query, keys, values))
    out = attend(query, keys, values, bias, SCALE)
    out.backward(grad)
    return out.detach(), query.grad, keys.grad, values.grad


def errors(got, exact) -> list[float]:
    """Each tensor's largest error relative to the largest exact value."""
    return [float((g.double() - e).abs().max() / e.abs().max().clamp(min=1e-30))
            for g, e in zip(got, exact, strict=True)]


SHAPES = [  # rows, heads, kv_heads, width, prompt
    (9, 9, 3, 63, 45),  # the bench's: SmolLM2's heads, 63 response tokens after a prompt
    (2, 9, 3, 45, 0),  # a prompt's own attention
    (3, 4, 2, 17, 30),  # rows and keys around the 16- and 32-wide blocks
    (2, 2, 1, 33, 64),  # 97 keys: a partial panel past three tiles' depth
    (5, 6, 6, 40, 33),  # no grouping
    (1, 2, 1, 1, 0),  # one query, one key
]


@needs_amx
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernels_match_the_float64_attention_at_least_as_well_as_pytorchs(
        shape, monkeypatch):
    query, keys, values, bias, grad = inputs(*shape)
    assert tile_attention.serves(query, keys, values, bias)
    exact = run(layers._attend, *(t.double() for t in (query, keys, values, bias, grad)))
    tiles = run(tile_attention.attention, query, keys, values, bias, grad)
    monkeypatch.setattr(tile_attention, "serves", lambda *args: False)
    pytorch = run(layers._attend, query, keys, values, bias, grad)
    for name, got, theirs in zip(("out", "dq", "dk", "dv"), errors(tiles, exact),
                                 errors(pytorch, exact), strict=True):
        # bf16 inputs and outputs: a few of bf16's 2^-8 steps at most, and the float32 scores
        # and gradients here never lose more than PyTorch's rounding of them between kernels
        assert got <= 2.0 ** -7 and got <= theirs + 2.0 ** -9, (name, got, theirs)


@needs_amx
@pytest.mark.parametrize("dim", [32, 128])
def test_other_head_widths(dim):
    query, keys, values, bias, grad = inputs(2, 4, 2, 20, 10, dim=dim)
    exact = run(layers._attend, *(t.double() for t in (query, keys, values, bias, grad)))
    assert max(errors(run(tile_attention.attention, query, keys, values, bias, grad),
                      exact)) <= 2.0 ** -7


@needs_amx
def test_a_row_with_every_key_masked_attends_uniformly_as_pytorchs_softmax_does():
    query, keys, values, bias, grad = inputs(2, 2, 1, 6, 4, masked_row=True)
    out = tile_attention.attention(query, keys, values, bias, SCALE)
    uniform = values[0, 0].double().mean(dim=0)  # every query of row 0, both heads
    for head in range(2):
        got = out[0, :, head * 64:(head + 1) * 64].double()
        assert torch.allclose(got, uniform.expand_as(got), atol=2e-2), head


@needs_amx
def test_layers_attend_routes_bf16_to_the_kernels_the_same_without_a_gradient():
    query, keys, values, bias, _ = inputs(3, 4, 2, 17, 30)
    with_grad = layers._attend(query.requires_grad_(), keys, values, bias, SCALE)
    assert with_grad.grad_fn.name() == "_AttentionBackward"
    with torch.no_grad():
        assert torch.equal(layers._attend(query, keys, values, bias, SCALE), with_grad)


@needs_amx
def test_pytorchs_path_where_the_kernels_do_not_serve():
    query, keys, values, bias, _ = inputs(2, 4, 2, 5, 3)
    assert tile_attention.serves(query, keys, values, bias)
    assert not tile_attention.serves(*(t.float() for t in (query, keys, values, bias)))
    assert not tile_attention.serves(query[..., :48], keys[..., :48], values[..., :48], bias)
    assert not tile_attention.serves(query, keys, values, bias[:, :, :, 1:])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not tile_attention.serves(query, keys, values, bias)


@needs_amx
def test_an_empty_micro_batch_takes_pytorchs_path():
    query, keys, values, bias, _ = inputs(2, 4, 2, 5, 3)
    assert not tile_attention.serves(query[:0], keys[:0], values[:0], bias[:0])
    assert layers._attend(query[:0], keys[:0], values[:0], bias[:0], SCALE).shape == (0, 5, 256)

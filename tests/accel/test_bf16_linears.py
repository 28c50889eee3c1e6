"""The bf16 sampler's linear layers (``dpbf16.c``: on AMX tiles, ``amx.c``, else by
VDPBF16PS), against a float32 product rounded once (and PyTorch's bf16 linear); their packing;
the lean sampler's use of them."""


import pytest
import torch

from postrl.accel import native
from postrl.accel.lean_weights import Linear

kernels = native.native_kernels()
needs_amx = pytest.mark.skipif(kernels is None or not kernels.amx,
                               reason="no native kernels or no AMX tiles here")
needs_bf16_linears = pytest.mark.skipif(kernels is None or not kernels.bf16_linears,
                                        reason="no native kernels, or neither AMX tiles nor "
                                               "AVX512-BF16 here")


def dpbf16_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  outputs: int) -> torch.Tensor:
    """``dpbf16.c``'s VDPBF16PS kernel itself, also where AMX tiles would be taken."""
    function = kernels.library.dpbf16_linear
    if function is None:
        pytest.skip("this CPU has no AVX512-BF16")
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty(rows.shape[0], outputs, dtype=torch.bfloat16)
    function(rows.data_ptr(), rows.shape[0], rows.shape[1], packed.data_ptr(),
             None if bias is None else bias.data_ptr(), outputs, y.data_ptr(),
             torch.get_num_threads())
    return y


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The product in float32, plus the bias, rounded to bf16 once."""
    y = x.float() @ weight.float().t()
    return (y if bias is None else y + bias.float()).bfloat16()


@needs_bf16_linears
@pytest.mark.parametrize("rows", [1, 5, 14, 15, 16, 17, 32, 33, 70])
@pytest.mark.parametrize("outputs", [16, 40, 960])
@pytest.mark.parametrize("inputs", [32, 64, 576])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_bf16_linear_is_the_float32_product_rounded_once(rows, outputs, inputs, with_bias):
    """Rows in blocks of 32 (AMX) or 14 (VDPBF16PS) and their remainders, outputs in pairs of
    16-wide panels and a lone or partial one, inputs in tiles of 32: within a rounding of the
    float32 product (the sums' order differs), and in practice PyTorch's bf16 linear to the
    bit; by the kernel this CPU takes, and by VDPBF16PS's wherever the CPU has it."""
    generator = torch.Generator().manual_seed(rows * outputs + inputs)
    x = torch.randn(rows, inputs, generator=generator).bfloat16()
    parts = [torch.randn(outputs - outputs // 3, inputs, generator=generator).bfloat16(),
             torch.randn(outputs // 3, inputs, generator=generator).bfloat16()]
    weight = torch.cat(parts)
    bias = torch.randn(outputs, generator=generator).bfloat16() if with_bias else None
    packed = kernels.bf16_pack(parts)
    same = torch.nn.functional.linear(x, weight, bias)
    for y in (kernels.bf16_linear(x, packed, bias, outputs),
              dpbf16_linear(x, packed, bias, outputs)):
        assert y.dtype == torch.bfloat16 and y.shape == (rows, outputs)
        torch.testing.assert_close(y, reference(x, weight, bias), rtol=2**-7, atol=2**-7)
        assert (y != same).float().mean() < 0.01


@needs_bf16_linears
def test_it_packs_float32_weights_writes_into_a_given_output_and_refuses_what_it_cannot_run():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=generator)  # float32: cast while packing
    x = torch.randn(2, 3, 64, generator=generator).bfloat16()
    packed = kernels.bf16_pack([weight])
    slots = torch.zeros(10, 48, dtype=torch.bfloat16)
    y = kernels.bf16_linear(x, packed, None, 48, out=slots[4:10])
    assert y.shape == (2, 3, 48) and y.data_ptr() == slots[4].data_ptr()
    assert torch.equal(slots[:4], torch.zeros(4, 48, dtype=torch.bfloat16))
    torch.testing.assert_close(slots[4:], reference(x.view(6, 64), weight.bfloat16(), None),
                               rtol=2**-7, atol=2**-7)
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.bf16_pack([torch.randn(16, 48)])
    with pytest.raises(ValueError, match="native bf16_linear"):
        kernels.bf16_linear(x.float(), packed, None, 48)
    with pytest.raises(ValueError, match="out must be"):
        kernels.bf16_linear(x, packed, None, 48, out=slots[:6, :40])
    assert kernels.bf16_linear(x[:0], packed, None, 48).shape == (0, 3, 48)
    assert dpbf16_linear(x[:0], packed, None, 48).shape == (0, 48)  # the kernel itself too


@needs_bf16_linears
def test_the_lean_linear_takes_them_for_inputs_of_a_multiple_of_32_only():
    """Other input widths keep oneDNN's linear, with the same result."""
    generator = torch.Generator().manual_seed(1)
    for inputs, own in ((64, True), (40, False)):
        weights = [torch.randn(24, inputs, generator=generator) for _ in range(2)]
        biases = [torch.randn(24, generator=generator) for _ in range(2)]
        linear = Linear(weights, biases, torch.bfloat16, rows=4, native=kernels)
        assert (linear.native is not None) == own
        x = torch.randn(4, inputs, generator=generator).bfloat16()
        torch.testing.assert_close(linear(x), reference(x, torch.cat(weights).bfloat16(),
                                                        torch.cat(biases).bfloat16()),
                                   rtol=2**-7, atol=2**-7)


@needs_amx
def test_pytorchs_amx_kernels_and_it_interleave_without_clobbering_each_others_tiles():
    """PyTorch's bf16 attention and linear layers use AMX tiles too (oneDNN, and
    ``cpublas::brgemm``, which skips reloading its tile configuration while it believes its
    own is still loaded). Each library's calls load their configuration and release the tiles
    when done, so calls interleaved on the same threads give what each gives alone."""
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 300, 64, generator=generator).bfloat16() for _ in range(3))
    x = torch.randn(40, 576, generator=generator).bfloat16()
    weight = torch.randn(960, 576, generator=generator).bfloat16()
    packed = kernels.bf16_pack([weight])
    alone = (torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
             torch.nn.functional.linear(x, weight), kernels.bf16_linear(x, packed, None, 960))
    for _ in range(3):
        together = (torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                    kernels.bf16_linear(x, packed, None, 960),
                    torch.nn.functional.linear(x, weight),
                    kernels.bf16_linear(x, packed, None, 960))
        assert torch.equal(together[0], alone[0]) and torch.equal(together[2], alone[1])
        assert torch.equal(together[1], alone[2]) and torch.equal(together[3], alone[2])

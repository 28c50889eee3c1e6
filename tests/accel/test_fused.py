"""The training forward's fused RMSNorm and SwiGLU (``postrl/accel/csrc/fused.c``) against
PyTorch's operations: the same values forward, gradients to float rounding, in float32 and
bf16; and what takes PyTorch's path."""

import pytest
import torch
import torch.nn.functional as F

from postrl.accel import fused, library, native
from postrl.models import ops

needs_native = pytest.mark.skipif(native.native_kernels() is None,
                                  reason=f"no native kernels: {native.unavailable_reason()}")

# bf16 backward: PyTorch rounds intermediate products to bf16, the kernels round once
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5},
             torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2}}


def torch_norm(x, weight, eps):
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def gradients(fn, inputs, grad):
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*inputs)
    out.backward(grad)
    return out.detach(), [t.grad for t in inputs]


def exact_norm_gradients(x, weight, grad, eps):
    """float64 dx and dweight of transformers' RMSNorm at these (rounded) inputs, and the
    scale of each element's terms (what float32 rounding of a sum is relative to)."""
    dtype = x.dtype
    x, weight, grad = (t.detach().double().reshape(-1, t.shape[-1]) for t in (x, weight, grad))
    s = (x.square().mean(-1, keepdim=True) + eps).rsqrt()
    n = x * s
    rounded = n.to(dtype).double()  # as the forward multiplied it by the weight
    dn = grad * weight
    dx = s * (dn - n * (dn * n).mean(-1, keepdim=True))
    dx_scale = s * (dn.abs() + n.abs() * (dn * n).abs().mean(-1, keepdim=True))
    return dx, dx_scale, (grad * rounded).sum(0), (grad * rounded).abs().sum(0)


def assert_near(actual, exact, scale, relative):
    """Within ``relative`` of the exact value, plus float32 rounding of the terms' sum."""
    error = (actual.double().reshape(exact.shape) - exact).abs()
    bound = relative * exact.abs() + 1e-5 * scale + 1e-30
    assert bool((error <= bound).all()), f"worst: {(error / bound).max().item():.2f} of bound"


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 17, 576), (40, 64), (1, 1, 24)])
def test_rms_norm_matches_pytorch(dtype, shape):
    """The forward equals PyTorch's (float32: to rounding; bf16: the same roundings, the sum
    of squares aside); the gradients are the exact ones at the inputs, rounded once (PyTorch's
    bf16 autograd rounds products on the way, so it is compared in float32 only)."""
    generator = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=generator) * 3).to(dtype).requires_grad_()
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=generator)).to(dtype).requires_grad_()
    grad = torch.randn(shape, generator=generator).to(dtype)
    out, (dx, dweight) = gradients(lambda a, w: fused.rms_norm(a, w, 1e-5), (x, weight), grad)
    expected, (ex, eweight) = gradients(lambda a, w: torch_norm(a, w, 1e-5), (x, weight), grad)
    assert out.dtype == dtype and dx.dtype == dtype and dweight.dtype == dtype
    torch.testing.assert_close(out, expected, rtol=1e-6 if dtype == torch.float32 else 8e-3,
                               atol=1e-6)
    relative = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-6  # bf16: a half-ulp is 2^-8
    exact_dx, dx_scale, exact_dweight, dweight_scale = exact_norm_gradients(x, weight, grad, 1e-5)
    assert_near(dx, exact_dx, dx_scale, relative)
    assert_near(dweight, exact_dweight, dweight_scale, relative)
    if dtype == torch.float32:
        torch.testing.assert_close(dx, ex, **TOLERANCE[dtype])
        torch.testing.assert_close(dweight, eweight, **TOLERANCE[dtype])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_without_a_weight_gradient(dtype):
    """A frozen weight (no gradient asked) and a forward without autograd give the same x
    gradient and output."""
    x = torch.randn(5, 96).to(dtype).requires_grad_()
    weight = torch.linspace(0.5, 1.5, 96).to(dtype)
    grad = torch.randn(5, 96).to(dtype)
    out, (dx, dweight) = gradients(lambda a, w: fused.rms_norm(a, w, 1e-6), (x, weight), grad)
    _, (ex, _) = gradients(lambda a, w: torch_norm(a, w, 1e-6), (x, weight), grad)
    assert dweight is None
    torch.testing.assert_close(dx, ex, **TOLERANCE[dtype])
    with torch.no_grad():
        assert torch.equal(fused.rms_norm(x, weight, 1e-6), out)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("joined", [True, False])
def test_swiglu_matches_pytorch(dtype, joined):
    """Gate and up as the halves of one gate|up output (strided rows, as the recorded
    forward hands them over) or as tensors of their own; large |gate| included."""
    generator = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(2, 9, 2 * 200, generator=generator) * 4).to(dtype)
    gate_up[0, 0, :4] = torch.tensor([-100.0, 100.0, -87.5, 0.0])
    gate_up.requires_grad_()
    grad = torch.randn(2, 9, 200, generator=generator).to(dtype)

    def run(fn):
        source = gate_up.detach().clone().requires_grad_()
        gate, up = (source.split(200, dim=-1) if joined
                    else (t.contiguous() for t in source.split(200, dim=-1)))
        out = fn(gate, up)
        out.backward(grad)
        return out.detach(), source.grad

    out, d = run(fused.swiglu)
    expected, ed = run(lambda g, u: F.silu(g) * u)
    torch.testing.assert_close(out, expected, rtol=1e-6 if dtype == torch.float32 else 8e-3,
                               atol=1e-6)
    torch.testing.assert_close(d, ed, **TOLERANCE[dtype])


def test_other_tensors_take_pytorchs_path(monkeypatch):
    """float64, mixed dtypes and a switched-off build compute with PyTorch's operations."""
    x = torch.randn(4, 32, dtype=torch.float64, requires_grad=True)
    weight = torch.ones(32, dtype=torch.float64)
    assert fused.native(x, weight) is None
    torch.testing.assert_close(fused.rms_norm(x, weight, 1e-5), torch_norm(x, weight, 1e-5))
    assert fused.native(x.float(), weight.to(torch.bfloat16)) is None
    monkeypatch.setenv(library.SWITCH, "0")
    assert fused.native(x.float(), weight.float()) is None
    gate, up = torch.randn(2, 8), torch.randn(2, 8)
    torch.testing.assert_close(fused.swiglu(gate, up), F.silu(gate) * up)


@needs_native
def test_attention_under_autocast_takes_pytorchs_path():
    """Under autocast the scores' matmul gives bf16 whatever the queries' dtype, against a
    float32 bias: the layers then scale the queries and use PyTorch's softmax."""
    query, bias = torch.zeros(2, 3, 4, 8), torch.zeros(2, 1, 4, 5)
    assert fused.fuses_attention(query, bias, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fused.fuses_attention(query, bias, 5)
    assert not fused.fuses_attention(query, bias[:, :, :3], 5)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_weights_match_pytorch(dtype):
    """softmax(scale * scores + bias) and its backward against PyTorch's, with masked
    columns (the dtype's lowest value, as the layers' bias holds them) and 45 columns (not a
    multiple of 16); one query row sees a single column."""
    generator = torch.Generator().manual_seed(11)
    rows, heads, width, columns = 3, 6, 5, 45
    scores = (torch.randn(rows, heads, width, columns, generator=generator) * 8).to(dtype)
    allowed = torch.rand(rows, 1, width, columns, generator=generator) > 0.3
    allowed[..., 0] = True
    allowed[0, 0, 1] = False
    allowed[0, 0, 1, 7] = True
    bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    grad = torch.randn(rows, heads, width, columns, generator=generator).to(dtype)
    query = torch.zeros(rows, heads, width, 8, dtype=dtype)
    assert fused.fuses_attention(query, bias, columns)

    def torch_weights(s):
        return torch.softmax(s * 0.125 + bias, dim=-1, dtype=torch.float32).to(dtype)

    out, (d,) = gradients(lambda s: fused.attention_weights(s, bias, 0.125),
                          (scores.requires_grad_(),), grad)
    expected, (ed,) = gradients(torch_weights, (scores,), grad)
    assert out.dtype == d.dtype == dtype
    assert bool((out[~allowed.expand_as(out)] == 0).all())
    torch.testing.assert_close(out[0, :, 1, 7], torch.ones(heads, dtype=dtype))
    torch.testing.assert_close(out, expected, rtol=1e-5 if dtype == torch.float32 else 2 ** -7,
                               atol=1e-6)
    # bf16: the backward uses the rounded weights where PyTorch keeps float32 ones
    torch.testing.assert_close(d, ed, rtol=1e-5 if dtype == torch.float32 else 2 ** -6,
                               atol=1e-5 if dtype == torch.float32 else 1e-3)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 40])
@pytest.mark.parametrize("tied", [True, False])
def test_rotate_matches_pytorch(dtype, dim, tied):
    """Queries as the layers hand them over (a linear's output viewed as heads: strided), the
    angles of transformers' rotary module (``tied``: the halves' angles equal) or others."""
    generator = torch.Generator().manual_seed(dim)
    rows, heads, width = 3, 5, 7
    flat = torch.randn(rows, width, heads * dim, generator=generator).to(dtype)
    angles = torch.rand(rows, 1, width, dim, generator=generator) * 6
    if tied:
        angles[..., dim // 2:] = angles[..., : dim // 2]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    grad = torch.randn(rows, heads, width, dim, generator=generator).to(dtype)

    def heads_of(t):
        return t.view(rows, width, heads, dim).transpose(1, 2)

    out, (d,) = gradients(lambda t: fused.rotate(heads_of(t), cos, sin),
                          (flat.requires_grad_(),), grad)
    through = fused.rotate(heads_of(flat.detach().requires_grad_()), cos, sin)
    assert through.grad_fn.name() == "_RotateBackward" and d.shape == flat.shape
    # float32: PyTorch's operations; bf16: the exact rotation of the same (rounded) inputs,
    # which the kernel rounds once (PyTorch's bf16 operations round each product on the way)
    exact = torch.float32 if dtype == torch.float32 else torch.float64
    expected, (ed,) = gradients(
        lambda t: ops.rotate(heads_of(t), cos.to(exact), sin.to(exact)),
        (flat.to(exact),), grad.to(exact))
    tolerance = ({"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32
                 else {"rtol": 2 ** -8, "atol": 1e-6})
    torch.testing.assert_close(out.to(exact), expected, **tolerance)
    torch.testing.assert_close(d.to(exact), ed, **tolerance)


@pytest.mark.parametrize("count", [1_000_003, 17])
def test_add_into_adds_a_bf16_gradient_into_float32_exactly(count):
    """What PyTorch's mixed-dtype add_ gives, to the bit (the bf16 value widens exactly), by
    the kernel where it serves and by add_ elsewhere (a strided master gradient)."""
    generator = torch.Generator().manual_seed(count)
    into = torch.randn(count, generator=generator)
    grad = torch.randn(count, generator=generator).to(torch.bfloat16)
    expected = into + grad.float()
    fused.add_into(into, grad)
    assert torch.equal(into, expected)
    strided = torch.randn(2 * count, generator=generator)[::2]
    expected = strided + grad.float()
    fused.add_into(strided, grad)
    assert torch.equal(strided, expected)

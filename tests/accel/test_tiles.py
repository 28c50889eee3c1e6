"""``postrl.accel.tiles``: the update's bf16 linear gradients on AMX tiles, against float64
products; a ``bf16-master`` weight's gradient added into its float32 master by the backward
itself; PyTorch's matmuls wherever the tiles do not serve."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from postrl.accel import native, tiles
from postrl.accel.recorded import recorded_linear
from postrl.models.precision import MasterWeights, master_of

kernels = native.native_kernels()
needs_amx = pytest.mark.skipif(kernels is None or not kernels.amx,
                               reason="no native kernels or no AMX tiles here")


def bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).bfloat16()


def within_rounding(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rounded: bool,
                    start: torch.Tensor | None = None) -> None:
    """``got`` is ``a @ b`` summed in float32 (and rounded to bf16 once where ``rounded``;
    added to the float32 ``start`` where given): within float32's error of the float64
    product, plus half a bf16 step of it, or a float32 step of the sum."""
    exact = a.double() @ b.double()
    bound = 1e-6 * (a.double().abs() @ b.double().abs())
    if start is not None:
        got = got.double() - start.double()
        bound = bound + 2.0 ** -23 * (start.double() + exact).abs()
    if rounded:
        bound = bound + exact.abs() * 2.0 ** -8
    assert bool(((got.double() - exact).abs() <= bound).all()), float(
        ((got.double() - exact).abs() - bound).max())


@needs_amx
@pytest.mark.parametrize("rows", [1, 15, 17, 32, 300])
@pytest.mark.parametrize("outputs, inputs", [(64, 48), (1536, 40), (96, 96)])
def test_the_input_gradient_is_the_float32_product_rounded_once(rows, outputs, inputs):
    """Row counts around the 16- and 32-row blocks and past a chunk of rows (128 at 1,536
    outputs); inputs that leave a partial panel or a pair of one panel."""
    torch.manual_seed(rows + outputs)
    grad, weight = bf16(rows, outputs), bf16(outputs, inputs)
    got = tiles.kernels(grad, weight).input_grad(grad, weight)
    assert got.shape == (rows, inputs) and got.dtype == torch.bfloat16
    within_rounding(got, grad, weight, rounded=True)


@needs_amx
@pytest.mark.parametrize("rows", [1, 31, 33, 700])
@pytest.mark.parametrize("outputs, inputs", [(48, 40), (1536, 576)])
def test_the_weight_gradient_is_summed_in_float32_into_the_total_given(rows, outputs, inputs):
    """``grad^T x`` over rows padded to the tiles' 32 with zeros: alone, added into a float32
    total in place, and added into a total the kernel cannot write (not contiguous)."""
    torch.manual_seed(rows)
    grad, x = bf16(rows, outputs), bf16(rows, inputs)
    kernel = tiles.kernels(grad, x)
    within_rounding(kernel.add_weight_grad(None, grad, x), grad.t(), x, rounded=False)
    total = torch.randn(outputs, inputs)
    start = total.clone()
    assert kernel.add_weight_grad(total, grad, x) is total
    within_rounding(total, grad.t(), x, rounded=False, start=start)
    strided = torch.randn(inputs, outputs).t()
    start = strided.clone()
    assert kernel.add_weight_grad(strided, grad, x) is strided
    within_rounding(strided, grad.t(), x, rounded=False, start=start)


@needs_amx
def test_a_masters_gradient_is_added_in_float32_by_the_backward_itself(monkeypatch):
    """``bf16-master``: the recorded linear's backward adds each micro-batch's weight gradient
    into the float32 master's ``.grad`` (the working weight gets none, and its hook, which
    adds a bf16 gradient into the master's, has nothing to add); PyTorch's path, a bf16
    gradient per micro-batch, gives the same sum to its bf16 roundings."""
    torch.manual_seed(0)
    master = nn.Linear(64, 96, bias=False)
    copies = MasterWeights(master)
    weight = copies.working.weight
    assert master_of(weight) is master.weight and master_of(master.weight) is None
    batches = [(bf16(40, 64), bf16(40, 96)) for _ in range(2)]

    def backward_of(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_()
        y = recorded_linear(x, weight, F.linear(x, weight).detach())
        (y.float() * grad.float()).sum().backward()
        return x.grad

    input_grads = [backward_of(x, grad) for x, grad in batches]
    assert weight.grad is None
    exact = sum(grad.double().t() @ x.double() for x, grad in batches)
    assert float((master.weight.grad.double() - exact).abs().max()) < 1e-4
    for (_, grad), got in zip(batches, input_grads, strict=True):
        within_rounding(got, grad, weight.detach(), rounded=True)

    tiled, master.weight.grad = master.weight.grad, None
    monkeypatch.setattr(tiles, "kernels", lambda *tensors: None)
    for x, grad in batches:
        backward_of(x, grad)
    assert weight.grad is None  # the hook moved it into the master's
    per_batch = sum((grad.double().t() @ x.double()).bfloat16().double() for x, grad in batches)
    assert float((master.weight.grad.double() - per_batch).abs().max()) < 1e-4
    assert float((tiled.double() - exact).abs().max()) < float(
        (master.weight.grad.double() - exact).abs().max())


def test_pytorchs_matmuls_serve_where_the_tiles_do_not():
    """float32 tensors, rows that are not contiguous, no rows: PyTorch's products, the weight's
    gradient returned (no master)."""
    grad, x, weight = torch.randn(5, 32), torch.randn(5, 24), torch.randn(32, 24)
    assert tiles.kernels(grad, x, weight) is None
    assert tiles.kernels(bf16(5, 64)[:, ::2]) is None
    assert tiles.kernels(bf16(0, 32)) is None
    dx, dw = tiles.linear_backward(grad, x, weight, True, True)
    torch.testing.assert_close(dx, grad @ weight)
    torch.testing.assert_close(dw, grad.t() @ x)
    assert tiles.linear_backward(grad, x, weight, False, False) == (None, None)


@needs_amx
def test_a_weight_wider_than_tall_takes_pytorchs_input_gradient(monkeypatch):
    """The down projection's shape (measured slower on the tiles in situ) and outputs that are
    not a multiple of 32 keep oneDNN's ``dy W``; the others take the tiles'."""
    calls = []
    original = tiles._Tiles.input_grad
    monkeypatch.setattr(tiles._Tiles, "input_grad",
                        lambda self, *args: calls.append(args[1].shape) or original(self, *args))
    for shape in [(64, 96), (48, 32), (96, 64), (64, 64)]:
        weight = bf16(*shape)
        dx, _ = tiles.linear_backward(bf16(7, shape[0]), bf16(7, shape[1]), weight, True, False)
        assert dx.shape == (7, shape[1])
    assert calls == [(96, 64), (64, 64)]


@needs_amx
@pytest.mark.parametrize("with_master", [False, True])
def test_a_bf16_linear_multiplies_by_pytorchs_and_differentiates_on_the_tiles(with_master):
    """``tiles.linear``: ``F.linear``'s value; its input, weight and bias gradients within a
    rounding of autograd's (the weight's into its float32 master under ``bf16-master``)."""
    torch.manual_seed(1)
    model = nn.Linear(64, 96)
    module = MasterWeights(model).working if with_master else nn.Linear(64, 96).bfloat16()
    x = bf16(3, 9, 64).requires_grad_()
    y = tiles.linear(x, module.weight, module.bias)
    assert y.grad_fn.name() == "_LinearBackward"
    torch.testing.assert_close(y, torch.nn.functional.linear(x, module.weight, module.bias),
                               rtol=0, atol=0)
    grad = bf16(3, 9, 96)
    y.backward(grad)
    flat, inputs = grad.reshape(-1, 96), x.detach().reshape(-1, 64)
    within_rounding(x.grad.reshape(-1, 64), flat, module.weight.detach(), rounded=True)
    weight_grad = model.weight.grad if with_master else module.weight.grad
    assert (module.weight.grad is None) == with_master
    exact = flat.double().t() @ inputs.double()
    assert float((weight_grad.double() - exact).abs().max()) < (1e-4 if with_master else 0.1)
    bias_grad = model.bias.grad if with_master else module.bias.grad
    torch.testing.assert_close(bias_grad.float(), flat.float().sum(0), rtol=0.01, atol=0.05)


def test_a_linear_without_a_gradient_or_in_float32_is_pytorchs():
    weight = torch.randn(32, 16, requires_grad=True)
    assert tiles.linear(torch.randn(4, 16), weight).grad_fn.name() != "_LinearBackward"
    assert not tiles.serves(torch.randn(4, 16), weight)
    with torch.no_grad():
        assert not tiles.serves(bf16(4, 16), weight.bfloat16())


@needs_amx
@pytest.mark.parametrize("outputs", [192, 160])
def test_a_long_inner_dimension_goes_in_slices_summed_in_float32(monkeypatch, outputs):
    """The LM head's ``dy W`` (49,152 outputs) runs in slices of ``SLICE`` outputs, here 64 (and
    a last one of 32), summed in float32 and rounded once; ``grad``'s leading dimensions stay."""
    monkeypatch.setattr(tiles, "SLICE", 64)
    torch.manual_seed(outputs)
    grad, weight = bf16(2, 21, outputs), bf16(outputs, 48)
    got = tiles.input_grad(grad, weight)
    assert got.shape == (2, 21, 48) and got.dtype == torch.bfloat16
    within_rounding(got.reshape(-1, 48), grad.reshape(-1, outputs), weight, rounded=True)


@needs_amx
def test_the_float32_sums_stay_float32_under_another_default_dtype(monkeypatch):
    """The kernels write float32: their buffers are float32 whatever ``torch``'s default."""
    monkeypatch.setattr(tiles, "SLICE", 64)
    torch.set_default_dtype(torch.float64)
    try:
        grad, x, weight = bf16(9, 128), bf16(9, 48), bf16(128, 48)
        kernel = tiles.kernels(grad, x, weight)
        total = kernel.add_weight_grad(None, grad, x)
        dx = tiles.input_grad(grad, weight)
    finally:
        torch.set_default_dtype(torch.float32)
    assert total.dtype == torch.float32
    within_rounding(total, grad.t(), x, rounded=False)
    within_rounding(dx, grad, weight, rounded=True)


def within_rounding_of_sum(got: torch.Tensor, pairs) -> None:
    """``got`` is ``sum_i g_i W_i`` summed in float32 and rounded to bf16 once."""
    exact = sum(g.double() @ w.double() for g, w in pairs)
    bound = 1e-6 * sum(g.double().abs() @ w.double().abs() for g, w in pairs)
    bound = bound + exact.abs() * 2.0 ** -8
    assert bool(((got.double() - exact).abs() <= bound).all()), float(
        ((got.double() - exact).abs() - bound).max())


@needs_amx
@pytest.mark.parametrize("rows", [1, 17, 300])
@pytest.mark.parametrize("outputs", [(576, 192, 192), (64, 32), (96,)])
def test_input_gradients_of_linears_sharing_an_input_sum_in_the_tiles(rows, outputs):
    """One product over the linears' outputs side by side (a layer's query, key and value
    projections), float32 sums rounded once, with a grad that is a column slice of a wider
    tensor (its row stride not its width)."""
    torch.manual_seed(rows + len(outputs))
    wide = bf16(rows, sum(outputs) + 7)
    grads = list(wide[:, :sum(outputs)].split(list(outputs), dim=1))
    pairs = [(g, bf16(o, 40)) for g, o in zip(grads, outputs, strict=True)]
    got = tiles.kernels(*grads, pairs[0][1]).input_grads(pairs)
    assert got.shape == (rows, 40) and got.dtype == torch.bfloat16
    within_rounding_of_sum(got, pairs)


@needs_amx
@pytest.mark.parametrize("with_master", [False, True])
@pytest.mark.parametrize("known", [False, True])
def test_linears_sharing_an_input_have_one_backward(with_master, known):
    """``tiles.linears``: each ``F.linear``'s value (or the known one); the input gradient
    summed over them in float32 once; each weight's and bias's gradient as a lone linear's
    (the weight's into its float32 master under ``bf16-master``)."""
    torch.manual_seed(2)
    models = [nn.Linear(64, 96), nn.Linear(64, 32)]
    if with_master:
        working = [MasterWeights(m).working for m in models]
    else:
        working = [nn.Linear(64, o).bfloat16() for o in (96, 32)]
    weights, biases = [m.weight for m in working], [m.bias for m in working]
    x = bf16(3, 9, 64).requires_grad_()
    plain = [torch.nn.functional.linear(x, w, b).detach()
             for w, b in zip(weights, biases, strict=True)]
    outputs = [p.clone() for p in plain] if known else None
    assert tiles.serves_together(x, weights)
    ys = tiles.linears(x, weights, biases, outputs)
    assert ys[0].grad_fn.name() == "_LinearsBackward"
    for y, want in zip(ys, plain, strict=True):
        torch.testing.assert_close(y, want, rtol=0, atol=0)
    grads = [bf16(3, 9, 96), bf16(3, 9, 32)]
    torch.autograd.backward(ys, grads)
    flats = [g.reshape(-1, g.shape[-1]) for g in grads]
    within_rounding_of_sum(x.grad.reshape(-1, 64), [(g, w.detach()) for g, w in
                                                    zip(flats, weights, strict=True)])
    inputs = x.detach().reshape(-1, 64)
    for model, module, flat in zip(models, working, flats, strict=True):
        assert (module.weight.grad is None) == with_master
        weight_grad = model.weight.grad if with_master else module.weight.grad
        exact = flat.double().t() @ inputs.double()
        assert float((weight_grad.double() - exact).abs().max()) < (1e-4 if with_master
                                                                    else 0.1)
        bias_grad = model.bias.grad if with_master else module.bias.grad
        torch.testing.assert_close(bias_grad.float(), flat.float().sum(0), rtol=0.01,
                                   atol=0.05)


@needs_amx
def test_linears_whose_outputs_are_not_a_multiple_of_32_are_not_grouped():
    x = bf16(4, 64).requires_grad_()
    assert tiles.serves_together(x, [bf16(64, 64), bf16(32, 64)])
    assert not tiles.serves_together(x, [bf16(64, 64), bf16(48, 64)])
    assert not tiles.serves_together(x.float(), [bf16(64, 64).float()])

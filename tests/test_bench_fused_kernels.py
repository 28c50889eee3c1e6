"""bench/fused_kernels_ab.py switches the training forward's fused kernels off part by part:
off, the layers and the vocabulary must compute by PyTorch's operations (or the A/B times
nothing), and on again, by the kernels."""

import pytest
import torch

from postrl import accel
from postrl.accel import fused, native, tiles, vocab
from postrl.models import layers, ops
from tests.bench_scripts import load_bench_script


@pytest.mark.skipif(native.native_kernels() is None, reason="no native kernels")
@pytest.mark.parametrize("part", ["norm_mlp", "vocab", "attention", "rotate"])
def test_each_part_switches_off_and_on(part):
    bench = load_bench_script("fused_kernels_ab")
    switch = bench.switches((part,))
    x, weight = torch.randn(4, 32, requires_grad=True), torch.ones(32)
    query, bias = torch.zeros(2, 3, 4, 8), torch.zeros(2, 1, 4, 5)
    logits = torch.randn(3, 40, requires_grad=True)
    targets = torch.tensor([1, 2, 3])

    def kernels_on() -> dict[str, bool]:
        logp, _ = accel.backend().logprob_and_entropy(logits, targets, 1.0, False, False)
        angles = torch.ones(2, 1, 4, 8)
        return {"norm_mlp": fused.rms_norm(x, weight, 1e-5).grad_fn.name() == "_RMSNormBackward",
                "rotate": fused.rotate(query.requires_grad_(), angles, angles).grad_fn.name()
                == "_RotateBackward",
                "attention": fused.fuses_attention(query, bias, 5),
                "vocab": logp.grad_fn.name() == "_LogProbEntropyBackward"
                and vocab.serves(logits, targets)}

    assert all(kernels_on().values())
    switch(False)
    try:
        off = kernels_on()
        assert not off[part] and all(on for name, on in off.items() if name != part)
    finally:
        switch(True)
    assert all(kernels_on().values())


@pytest.mark.skipif(native.native_kernels() is None or not native.native_kernels().amx,
                    reason="no native kernels or no AMX tiles")
def test_the_tiles_part_switches_the_backwards_amx_products_off_and_on():
    bench = load_bench_script("fused_kernels_ab")
    switch = bench.switches(("tiles",))
    rows = torch.zeros(4, 32, dtype=torch.bfloat16)
    assert tiles.kernels(rows) is not None
    switch(False)
    try:
        assert tiles.kernels(rows) is None and fused.rms_norm is not ops.rms_norm
    finally:
        switch(True)
    assert tiles.kernels(rows) is not None


@pytest.mark.skipif(native.native_kernels() is None or not native.native_kernels().amx,
                    reason="no native kernels or no AMX tiles")
def test_the_tile_attention_part_switches_the_attention_kernel_off_and_on():
    """Off, the layers' attention runs PyTorch's bmms around the fused softmax (the grad_fn of
    its output is a view's, not the kernel's)."""
    bench = load_bench_script("fused_kernels_ab")
    switch = bench.switches(("tile_attention",))
    query = torch.randn(2, 4, 5, 32, dtype=torch.bfloat16, requires_grad=True)
    keys = torch.randn(2, 2, 7, 32, dtype=torch.bfloat16)
    bias = torch.zeros(2, 1, 5, 7, dtype=torch.bfloat16)

    def kernel() -> bool:
        return layers._attend(query, keys, keys, bias, 0.2).grad_fn.name() == "_AttentionBackward"

    assert kernel()
    switch(False)
    try:
        assert not kernel() and tiles.kernels(keys.flatten(0, 2)) is not None
    finally:
        switch(True)
    assert kernel()

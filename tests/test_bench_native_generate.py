"""bench/native_generate_ab.py switches a piece of the sampler's native kernels off and on:
off, the sampler must build its weights without it (or the A/B times nothing), and on again,
with it."""

import pytest
import torch

from postrl import accel
from postrl.accel import lean_weights, native
from tests.bench_scripts import load_bench_script

needs_native = pytest.mark.skipif(native.native_kernels() is None, reason="no native kernels")


@needs_native
def test_between_switches_the_bf16_samplers_work_between_its_linears(tiny):
    """Off, a bf16 sampler runs PyTorch's operations between its linears (and so no step in
    one call), its linears as they were; float32 keeps every kernel."""
    model, _ = tiny
    switch = load_bench_script("native_generate_ab").switches("between")
    on = lean_weights.LeanWeights.of(model, torch.bfloat16, rows=2)
    assert on.native is not None
    switch(False)
    try:
        off = lean_weights.LeanWeights.of(model, torch.bfloat16, rows=2)
        assert off.native is None and off.pointers is None
        assert (off.lm_head.native is None) == (on.lm_head.native is None)
        assert lean_weights.LeanWeights.of(model, torch.float32, rows=2).native is not None
    finally:
        switch(True)
    assert lean_weights.LeanWeights.of(model, torch.bfloat16, rows=2).native is not None


@needs_native
def test_draw_and_layers_switch_off_and_on(tiny):
    model, _ = tiny
    bench = load_bench_script("native_generate_ab")
    draw, layers = bench.switches("draw"), bench.switches("layers")
    logits = torch.zeros(2, 8)
    assert accel.backend().draws(logits)
    draw(False)
    layers(False)
    try:
        assert not accel.backend().draws(logits)
        assert lean_weights.LeanWeights.of(model, torch.float32, rows=2).pointers is None
    finally:
        draw(True)
        layers(True)
    assert accel.backend().draws(logits)
    assert lean_weights.LeanWeights.of(model, torch.float32, rows=2).pointers is not None


@pytest.mark.skipif(native.native_kernels() is None or not native.native_kernels().bf16_linears,
                    reason="neither AMX tiles nor AVX512-BF16 here")
def test_linears_switches_the_bf16_samplers_own_linears(tiny):
    model, _ = tiny
    switch = load_bench_script("native_generate_ab").switches("linears")
    assert lean_weights.LeanWeights.of(model, torch.bfloat16, rows=2).lm_head.native is not None
    switch(False)
    try:
        weights = lean_weights.LeanWeights.of(model, torch.bfloat16, rows=2)
        assert weights.lm_head.native is None and weights.native is not None
    finally:
        switch(True)
    assert lean_weights.LeanWeights.of(model, torch.bfloat16, rows=2).lm_head.native is not None

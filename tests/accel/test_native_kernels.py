"""postrl's own kernels for the lean sampler (``gemm.c``, ``decode.c``, ``step.c``): the
float32 linear against a float64 product; RMSNorm, the residual add with its RMSNorm, SiLU ·
up, the rotary embedding with the cache's new column, and attention against PyTorch's, in
float32 and bf16; a decode step's layers in one call against the layer loop; the sampler's
logits with them or without them; and a clear fallback where they cannot be built."""

import dataclasses
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch

from postrl.accel import build, library, native
from postrl.accel.lean import LeanDecoder
from postrl.accel.lean_weights import LeanWeights
from postrl.accel.recorded import RecordedForward
from postrl.models.layers import rotate
from postrl.models.precision import bf16_copy
from postrl.rollout import HFRolloutEngine, SamplingParams
from postrl.rollout.hf import left_padded

needs_native = pytest.mark.skipif(native.native_kernels() is None,
                                  reason=f"no native kernels: {native.unavailable_reason()}")
dtypes = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])


def close(dtype: torch.dtype, float32: float) -> dict[str, float]:
    """``assert_close``'s tolerances: ``float32`` in float32; in bf16 a rounding apart (the
    kernels compute in float32 and round what they store, PyTorch's bf16 operations round
    some intermediate values too, so two results may straddle a rounding boundary)."""
    tolerance = float32 if dtype == torch.float32 else 2.0**-7
    return {"rtol": tolerance, "atol": tolerance}


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty library cache, and the loader's memo cleared before and after."""
    monkeypatch.setenv("POSTRL_CACHE", str(tmp_path))
    library._load.cache_clear()
    yield tmp_path / "native"
    library._load.cache_clear()


@needs_native
@pytest.mark.parametrize("rows", [1, 3, 14, 15, 29, 100])
@pytest.mark.parametrize("parts", [[32], [45], [7, 96, 20], [1]])
@pytest.mark.parametrize("inputs", [1, 9, 64])
def test_the_native_linear_is_the_float64_product(rows, parts, inputs):
    """Rows split into blocks of at most 14 and columns into panels of 32, the last one
    partly filled; several weights concatenated; with and without a bias."""
    generator = torch.Generator().manual_seed(rows * 1000 + inputs)
    weights = [torch.randn(n, inputs, generator=generator) for n in parts]
    x = torch.randn(rows, 2, inputs, generator=generator)[:, 1]  # not contiguous
    kernels = native.native_kernels()
    packed = kernels.pack(weights)
    weight = torch.cat(weights)
    bias = torch.randn(len(weight), generator=generator)
    for b in (None, bias):
        out = kernels.linear(x, packed, kernels.pad_bias(b), len(weight))
        expected = x.double() @ weight.double().T + (0 if b is None else b.double())
        assert out.dtype == torch.float32 and out.shape == (rows, len(weight))
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    batched = kernels.linear(x.reshape(1, rows, inputs), packed, None, len(weight))
    assert torch.equal(batched[0], kernels.linear(x, packed, None, len(weight)))
    assert kernels.linear(x[:0], packed, None, len(weight)).shape == (0, len(weight))


@needs_native
def test_it_writes_into_a_given_output_and_refuses_one_it_cannot_fill():
    """A decode step's linears write straight into a record's slots: rows of a larger
    tensor."""
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(40, 16, generator=generator), torch.randn(5, 16, generator=generator)
    kernels = native.native_kernels()
    packed, record = kernels.pack([weight]), torch.zeros(9, 40)
    out = kernels.linear(x[:, None], packed, None, 40, record[2:7])
    assert out.shape == (5, 1, 40) and out.data_ptr() == record[2].data_ptr()
    torch.testing.assert_close(record[2:7], x @ weight.T, rtol=1e-5, atol=1e-5)
    assert not record[:2].any() and not record[7:].any()
    for wrong in (torch.zeros(5, 41), torch.zeros(40, 5).T, torch.zeros(5, 40).double()):
        with pytest.raises(ValueError, match="out must be a contiguous float32"):
            kernels.linear(x, packed, None, 40, wrong)


@needs_native
@dtypes
@pytest.mark.parametrize("width", [64, 576, 23])
@pytest.mark.parametrize("rows", [1, 6, 300])
def test_rms_norm_is_pytorchs(width, rows, dtype):
    generator = torch.Generator().manual_seed(width + rows)
    x = (torch.randn(rows, 2, width, generator=generator) * 3).to(dtype)
    weight = torch.randn(width, generator=generator).to(dtype)
    for view in (x, x[:, 1]):  # a batch of rows, and a non-contiguous view
        out = native.native_kernels().rms_norm(view, weight, 1e-5)
        assert out.dtype == dtype
        torch.testing.assert_close(out, torch.nn.functional.rms_norm(view, (width,), weight,
                                                                     1e-5), **close(dtype, 2e-6))
    with pytest.raises(ValueError, match="native rms_norm"):
        native.native_kernels().rms_norm(x, weight.double(), 1e-5)
    with pytest.raises(ValueError, match="native rms_norm"):  # one dtype per call
        native.native_kernels().rms_norm(x.float(), weight.bfloat16(), 1e-5)


@needs_native
@dtypes
@pytest.mark.parametrize("width", [64, 576, 23])
@pytest.mark.parametrize("rows", [1, 6, 300])
def test_the_residual_add_and_its_rms_norm_are_pytorchs(width, rows, dtype):
    """The residual stream is added to in place, exactly as PyTorch adds in its dtype; its
    norm as PyTorch's."""
    generator = torch.Generator().manual_seed(width * rows)
    hidden, delta = ((torch.randn(rows, 1, width, generator=generator) * 3).to(dtype)
                     for _ in range(2))
    weight = torch.randn(width, generator=generator).to(dtype)
    expected_hidden = hidden + delta
    normed = native.native_kernels().add_rms_norm(hidden, delta, weight, 1e-5)
    assert torch.equal(hidden, expected_hidden) and normed.dtype == dtype
    torch.testing.assert_close(normed, torch.nn.functional.rms_norm(
        expected_hidden, (width,), weight, 1e-5), **close(dtype, 2e-6))
    with pytest.raises(ValueError, match="native add_rms_norm"):
        native.native_kernels().add_rms_norm(hidden, delta[:, :, :-1], weight[:-1], 1e-5)
    strided = torch.zeros(2, 1, 2 * width)[..., :width]  # in place needs it contiguous
    with pytest.raises(ValueError, match="native add_rms_norm"):
        native.native_kernels().add_rms_norm(strided, delta[:1].expand(2, 1, width), weight,
                                             1e-5)


@needs_native
@dtypes
@pytest.mark.parametrize("width", [1536, 40, 7])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_silu_times_up_is_pytorchs(width, rows, dtype):
    """Gates from far negative to far positive (SiLU's tails), up the second half."""
    generator = torch.Generator().manual_seed(width + rows)
    gate_up = torch.randn(rows, 1, 2 * width, generator=generator) * 4
    gate_up[0, 0, :3] = torch.tensor([-120.0, 95.0, 0.0])[: min(3, width)]
    gate_up = gate_up.to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    out = native.native_kernels().silu_mul(gate_up)
    assert out.dtype == dtype
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, **close(dtype, 1e-6))
    with pytest.raises(ValueError, match="native silu_mul"):
        native.native_kernels().silu_mul(gate_up[..., 1:])


@needs_native
@dtypes
@pytest.mark.parametrize("dim", [64, 24, 6])
@pytest.mark.parametrize("rows", [1, 9])
def test_the_rotary_embedding_and_the_caches_new_column_are_pytorchs(dim, rows, dtype):
    """Queries and keys rotated as postrl.models.layers.rotate rotates them (in float32 with
    the same rounding), keys and values written into one column of a longer cache and
    nowhere else."""
    generator = torch.Generator().manual_seed(dim * rows)
    heads, kv_heads, column = 6, 2, 3
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    angles = torch.rand(rows, dim // 2, generator=generator) * 50
    cos, sin = (torch.cat((f(angles), f(angles)), dim=-1).to(dtype)
                for f in (torch.cos, torch.sin))
    keys, values = (torch.randn(2, rows, kv_heads, 5, dim, generator=generator).to(dtype)
                    for _ in range(2))
    before_keys, before_values = keys.clone(), values.clone()
    queries = native.native_kernels().rotate_store(qkv, cos, sin, keys[1, :, :, column],
                                                   values[1, :, :, column], heads)
    rotated = rotate(qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim),
                     cos[:, None], sin[:, None])
    if dtype == torch.float32:
        assert torch.equal(queries, rotated[:, :heads])
        assert torch.equal(keys[1, :, :, column], rotated[:, heads:])
    else:
        assert queries.dtype == dtype
        torch.testing.assert_close(queries, rotated[:, :heads], **close(dtype, 0))
        torch.testing.assert_close(keys[1, :, :, column], rotated[:, heads:], **close(dtype, 0))
    assert torch.equal(values[1, :, :, column],
                       qkv[:, (heads + kv_heads) * dim:].view(rows, kv_heads, dim))
    untouched = torch.ones(2, rows, kv_heads, 5, dtype=torch.bool)
    untouched[1, :, :, column] = False
    assert torch.equal(keys[untouched], before_keys[untouched])
    assert torch.equal(values[untouched], before_values[untouched])
    with pytest.raises(ValueError, match="native rotate_store"):
        native.native_kernels().rotate_store(qkv[:, 1:], cos, sin, keys[1, :, :, column],
                                             values[1, :, :, column], heads)


@needs_native
@dtypes
@pytest.mark.parametrize("dim", [64, 128, 24])
@pytest.mark.parametrize("columns", [1, 2, 16, 17, 150])
@pytest.mark.parametrize("rows", [1, 9])
def test_attention_over_each_rows_columns_is_pytorchs(dim, columns, rows, dtype):
    """Views as a decode step has them: queries in the rotated projections (query heads,
    then key heads), keys and values the first columns of a longer cache, the mask a row
    mask's first columns with left padding masked out (a large negative, as the cache's).
    Heads of 64 and 128 take the blocked kernel (16 columns' scores at a time, even and odd
    columns summed apart), 24 the plain one; column counts around the blocks' edges."""
    generator = torch.Generator().manual_seed(dim * columns + rows)
    kv_heads, group = 3, 3
    rotated = torch.randn(rows, 1, kv_heads * group + kv_heads, dim,
                          generator=generator).to(dtype)
    q = rotated[:, 0, : kv_heads * group].view(rows, kv_heads, group, dim)
    keys, values = ((torch.randn(rows, kv_heads, columns + 5, dim, generator=generator) * 2
                     ).to(dtype) for _ in range(2))
    row_mask = torch.zeros(rows, columns + 5, dtype=dtype)
    row_mask[1:, : columns // 3] = torch.finfo(dtype).min
    args = (q, keys[:, :, :columns], values[:, :, :columns], row_mask[:, None, None, :columns])
    expected = torch.nn.functional.scaled_dot_product_attention(*args[:3], attn_mask=args[3])
    out = native.native_kernels().attend_rows(*args)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **close(dtype, 1e-5))
    with pytest.raises(ValueError, match="decode-step layouts"):
        native.native_kernels().attend_rows(q.contiguous().transpose(1, 2), *args[1:])


@needs_native
@dtypes
@pytest.mark.parametrize("masked", [1, 16, 40])
def test_masked_columns_weigh_exactly_nothing(masked, dtype):
    """A masked column's exponential is 0, as PyTorch's: not the smallest float the
    polynomial reaches (about 1e-38, which would show against values of 1e36, and whose
    subnormal products take the CPU's slow path)."""
    generator = torch.Generator().manual_seed(masked)
    rows, columns, dim = 4, 50, 64
    q = torch.randn(rows, 3, 3, dim, generator=generator).to(dtype)
    keys, values = (torch.randn(rows, 3, columns, dim, generator=generator).to(dtype)
                    for _ in range(2))
    values[:, :, :masked] = 1e36
    mask = torch.zeros(rows, 1, 1, columns, dtype=dtype)
    mask[..., :masked] = torch.finfo(dtype).min  # as the cache masks left padding
    expected = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    torch.testing.assert_close(native.native_kernels().attend_rows(q, keys, values, mask),
                               expected, **close(dtype, 1e-5))


@needs_native
def test_the_lean_sampler_runs_them_where_they_apply(tiny):
    """float32 runs every kernel; bf16 its work between the linears, and its own linears
    and whole steps where the CPU has AMX tiles or AVX512-BF16 (else oneDNN's linears);
    other dtypes none."""
    model, _ = tiny
    fp32 = LeanWeights.of(model, torch.float32, rows=4)
    bf16 = LeanWeights.of(model, torch.bfloat16, rows=4)
    assert fp32.native is not None and fp32.lm_head.native is not None
    assert fp32.layers[0].qkv.native is not None and fp32.pointers is not None
    assert bf16.native is not None
    own = native.native_kernels().bf16_linears
    assert (bf16.lm_head.native is not None) == own
    assert (bf16.layers[0].qkv.native is not None) == own
    assert (bf16.pointers is not None) == own  # a step's layers in one call
    assert LeanWeights.of(model, torch.float16, rows=4).native is None


@needs_native
@dtypes
def test_decode_steps_give_the_same_logits_with_and_without_it(tiny, monkeypatch, dtype):
    """Prefill and three decode steps of 3 prompts x 2 samples, with postrl's kernels and
    with PyTorch's and oneDNN's, from the same tokens, with the prompts' columns shared and
    copied to each row."""
    model, tokenizer = tiny
    texts = [tokenizer(t, add_special_tokens=False).input_ids
             for t in ("What is 2 + 3?", "Name a colour.", "Hi")]
    outputs = []
    for switch, share_from in (("1", 1), ("0", 1), ("1", 10**6), ("0", 10**6)):
        monkeypatch.setenv(library.SWITCH, switch)
        weights = LeanWeights.of(model, dtype, rows=6)
        assert (weights.native is not None) == (switch == "1")
        decoder = LeanDecoder(weights, *left_padded(texts, 0), 2, 3, share_from=share_from)
        logits = [decoder.first_logits]
        positions = torch.tensor([len(t) for t in texts]).repeat_interleave(2)
        for step in range(3):
            logits.append(decoder.step(torch.arange(6) * 11 + step, positions + step))
        outputs.append(torch.stack(logits).float())
    for other in outputs[1:]:
        torch.testing.assert_close(outputs[0], other, atol=1e-4 if dtype == torch.float32
                                   else 0.05, rtol=0)


@needs_native
@dtypes
@pytest.mark.parametrize("fixture", ["tiny", "tiny_qwen2"])
@pytest.mark.parametrize("share_from", [10**6, 1])
def test_a_decode_step_in_one_call_is_the_layer_loop_to_the_bit(request, tiny, fixture,
                                                                share_from, monkeypatch, dtype):
    """3 prompts x 2 samples, recording, rows dropped before the last step: the logits, the
    cache's written columns and the record's written slots are equal bit for bit, the layers
    run in one call (``step.c``) or by the Python loop over the same kernels. Each row holds
    its own cache columns from the start, or (``share_from=1``) the prompts' columns are
    shared until the rows are dropped, and only the last step runs in one call. Qwen2 brings
    biases on q|k|v and a head dimension of 8. In bf16 (with ``dpbf16.c``'s linears) a bf16
    copy of the model samples and records, as ``bf16-master``'s working copy does."""
    if dtype == torch.bfloat16 and not native.native_kernels().bf16_linears:
        pytest.skip("bf16 decode steps run in one call with postrl's bf16 linears only")
    model = tiny[0] if fixture == "tiny" else request.getfixturevalue(fixture)
    if dtype == torch.bfloat16:
        model = bf16_copy(model)
    texts = [tiny[1](t, add_special_tokens=False).input_ids
             for t in ("What is 2 + 3?", "Name a colour.", "Hi")]
    fused = LeanWeights.of(model, dtype, rows=6)
    assert fused.pointers is not None
    calls = []
    decode_layers = native.NativeKernels.decode_layers
    monkeypatch.setattr(native.NativeKernels, "decode_layers",
                        lambda self, *args: calls.append(1) or decode_layers(self, *args))
    results = []
    for weights in (fused, dataclasses.replace(fused, pointers=None)):
        record = RecordedForward(model, [len(t) for t in texts], 2, 4)
        decoder = LeanDecoder(weights, *left_padded(texts, 0), 2, 4, share_from=share_from,
                              record=record)
        logits = [decoder.first_logits]
        positions = torch.tensor([len(t) for t in texts]).repeat_interleave(2)
        for step in range(3):
            if step == 2:
                keep = torch.tensor([0, 2, 3, 5])
                decoder.select(keep)
                positions = positions[keep]
            logits.append(decoder.step(torch.arange(len(positions)) * 11 + step,
                                       positions + step))
        written = decoder.cache.offset + decoder.cache.length
        results.append([*logits, decoder.cache.keys[..., :written, :],
                        decoder.cache.values[..., :written, :],
                        record.logits[record.prompt_last_slots()],  # the prompts' written ones
                        record.logits[record.response_start:record.filled],
                        *(t[:record.filled] for layer in record.linears for t in layer)])
    assert len(calls) == (3 if share_from > 1 else 1)  # the first decoder's; the loop's none
    assert len(results[0]) == len(results[1])
    for one_call, loop in zip(*results, strict=True):
        assert torch.equal(one_call, loop)


@needs_native
def test_it_is_built_once_and_then_loaded_from_the_cache(fresh_build, monkeypatch, tmp_path):
    calls, real = tmp_path / "calls", build.compiler()
    compiler = tmp_path / "cc"  # the real compiler, counting its calls
    compiler.write_text(f'#!/bin/sh\necho built >> {calls}\nexec {real} "$@"\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    assert native.native_kernels() is not None
    library._load.cache_clear()
    assert native.native_kernels() is not None
    assert calls.read_text() == "built\n"
    assert [p.name.startswith("kernels-") for p in fresh_build.iterdir()] == [True]


def test_without_a_compiler_the_sampler_keeps_onednn_and_says_why(tiny, fresh_build,
                                                                  monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert native.native_kernels() is None
    assert "/nonexistent/cc" in native.unavailable_reason()
    model, tokenizer = tiny
    weights = LeanWeights.of(model, torch.float32, rows=4)
    assert weights.lm_head.native is None
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    ids = [tokenizer("Hi", add_special_tokens=False).input_ids]
    assert HFRolloutEngine(model, tokenizer).generate(ids, 2, params, seed=0).lengths.sum() > 0


def test_a_failing_build_names_the_compilers_message(fresh_build, monkeypatch, tmp_path):
    compiler = tmp_path / "cc"
    compiler.write_text("#!/bin/sh\necho 'In file included from gemm.c:1:' >&2\n"
                        "echo 'gemm.c:2: error: no AVX-512 here' >&2\necho '  2 | #' >&2\n"
                        "exit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    assert native.native_kernels() is None
    assert native.unavailable_reason().endswith("gemm.c:2: error: no AVX-512 here")
    assert not list(fresh_build.glob("*"))  # nothing half-built stays


def test_it_can_be_switched_off(monkeypatch):
    monkeypatch.setenv(library.SWITCH, "0")
    assert native.native_kernels() is None
    assert native.unavailable_reason() == f"{library.SWITCH}=0"


@needs_native
def test_they_share_pytorchs_openmp_runtime():
    runtimes = build.openmp_runtimes()
    assert len(runtimes) <= 1, runtimes


def test_the_package_ships_every_source_it_compiles():
    """An installed (not editable) postrl must carry the C sources and their header:
    pyproject's package data names them for their package (``postrl.accel``, in
    ``csrc/``)."""
    tomllib = pytest.importorskip("tomllib")
    project = Path(native.__file__).parents[2] / "pyproject.toml"
    data = tomllib.loads(project.read_text())["tool"]["setuptools"]["package-data"]
    package = Path(build.__file__).parent
    assert build.SOURCES and build.HEADERS
    for source in build.SOURCES + build.HEADERS:
        relative = source.relative_to(package).as_posix()
        assert source.exists()
        assert any(fnmatch(relative, pattern) for pattern in data["postrl.accel"]), source

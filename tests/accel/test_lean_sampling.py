"""The lean sampling forward (packed weights, static KV cache) samples what transformers' own
forward samples."""


import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from postrl.accel import decoding, library, native
from postrl.accel import lean as lean_module
from postrl.accel.lean import LeanDecoder, unsupported_reason
from postrl.accel.lean_weights import LeanWeights
from postrl.models.logprobs import SequenceBatch, response_logprobs
from postrl.rollout import HFRolloutEngine, SamplingParams
from postrl.rollout.hf import left_padded
from tests.models.test_adapters import TARGETS, trained_lora


def prompts(tokenizer):
    texts = ["What is 2 + 3?", "Name a colour, please, in one word only.", "Hi"]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def engines(model, tokenizer, precision="fp32", many_stops=True):
    lean = HFRolloutEngine(model, tokenizer, precision=precision, entropies=True)
    plain = HFRolloutEngine(model, tokenizer, precision=precision, lean=False, entropies=True)
    assert lean.fast is not None and plain.fast is None
    if many_stops:  # rows end early and at different steps, so finished rows get dropped
        stops = torch.arange(0, len(tokenizer), 97)
        lean.eos_ids = plain.eos_ids = stops
    return lean, plain


def assert_same_rollouts(a, b, logprob_tol):
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    assert a.finish_reasons == b.finish_reasons
    assert (a.logprobs - b.logprobs).abs().max() < logprob_tol
    assert (a.entropies is None) == (b.entropies is None)
    if a.entropies is not None:
        assert (a.entropies - b.entropies).abs().max() < logprob_tol


def force_sharing(monkeypatch, share_from: int) -> None:
    """The prompt length from which the lean sampler shares prompts' columns, whichever way
    its decode steps run."""
    monkeypatch.setattr(lean_module, "SHARE_PROMPTS_FROM", share_from)
    monkeypatch.setattr(lean_module, "SHARE_PROMPTS_FROM_ONE_CALL", share_from)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, max_new_tokens=40),
                                    SamplingParams(temperature=0.7, top_k=50, top_p=0.9,
                                                   max_new_tokens=40),
                                    SamplingParams(temperature=0.0, max_new_tokens=12)])
@pytest.mark.parametrize("share_from", [1, 10**6], ids=["shared prompts", "per row"])
def test_lean_sampling_matches_transformers_on_tiny_llama(tiny, params, share_from,
                                                          monkeypatch):
    force_sharing(monkeypatch, share_from)
    model, tokenizer = tiny
    lean, plain = engines(model, tokenizer)
    for seed in range(3):
        a = lean.generate(prompts(tokenizer), 4, params, seed=seed)
        b = plain.generate(prompts(tokenizer), 4, params, seed=seed)
        assert_same_rollouts(a, b, 1e-5)
    if params.temperature:  # the stop ids did end rows at different steps (compaction ran)
        assert len(set(a.lengths.tolist())) > 2 and "eos" in a.finish_reasons


@pytest.mark.parametrize("share_from", [1, 10**6], ids=["shared prompts", "per row"])
def test_lean_sampling_in_bf16_is_as_close_to_the_float32_policy_as_transformers(
        tiny, share_from, monkeypatch):
    """In bf16 the two forwards round differently (the fused attention keeps its softmax and
    weighted sum in float32, transformers' eager attention rounds the probabilities to bf16),
    so on the tiny model's near-uniform distributions a drawn token may move to a neighbour.
    Both must score their samples like the float32 policy, the lean one no worse, also when
    the prompt's and the response's attention are merged from two bf16 parts."""
    force_sharing(monkeypatch, share_from)
    model, tokenizer = tiny
    lean, plain = engines(model, tokenizer, precision="bf16")
    params = SamplingParams(temperature=1.0, max_new_tokens=30)
    errors = {}
    for name, engine in (("lean", lean), ("plain", plain)):
        errs = []
        for seed in range(3):
            out = engine.generate(prompts(tokenizer), 4, params, seed=seed)
            batch = SequenceBatch.build(out.prompt_ids, out.response_ids, out.response_mask,
                                        engine.pad_id)
            with torch.no_grad():
                logp, _ = response_logprobs(model, batch)
            errs.append((logp - out.logprobs)[out.response_mask].abs())
        errors[name] = torch.cat(errs)
    assert errors["lean"].max() < 5e-3
    assert errors["lean"].mean() < 1.2 * errors["plain"].mean()


def test_lean_sampling_matches_transformers_on_a_qwen2_with_biases(tiny, tiny_qwen2):
    _, tokenizer = tiny
    lean, plain = engines(tiny_qwen2, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=30)
    assert_same_rollouts(lean.generate(prompts(tokenizer), 3, params, seed=1),
                         plain.generate(prompts(tokenizer), 3, params, seed=1), 1e-5)


def test_models_the_lean_step_does_not_know_fall_back_to_transformers(tiny):
    model, tokenizer = tiny
    assert unsupported_reason(model) is None
    dora = trained_lora(model, use_dora=True).get_base_model()
    assert "DoRA" in unsupported_reason(dora)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2))
    assert unsupported_reason(gpt2) == "model type 'gpt2'"
    engine = HFRolloutEngine(dora, tokenizer)
    assert engine.fast is None
    out = engine.generate(prompts(tokenizer), 2, SamplingParams(max_new_tokens=5), seed=0)
    assert out.response_ids.shape[0] == 6


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], TARGETS], ids=["q and v", "all"])
def test_lean_sampling_of_lora_adapters_matches_transformers(tiny, targets):
    """The lean sampler multiplies each LoRA layer's merged weight; transformers runs peft's
    layers (base, then the adapters' product): the same samples to float32 rounding. The
    adapters are moved off their zero start, so sampling the base weights would differ."""
    model, tokenizer = tiny
    lora = trained_lora(model, targets=targets).get_base_model()
    lean, plain = engines(lora, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=30)
    for seed in range(2):
        assert_same_rollouts(lean.generate(prompts(tokenizer), 4, params, seed=seed),
                             plain.generate(prompts(tokenizer), 4, params, seed=seed), 1e-5)
    base = HFRolloutEngine(model, tokenizer, entropies=True)
    base.eos_ids = lean.eos_ids
    apart = lean.generate(prompts(tokenizer), 4, params, seed=0)
    assert (apart.logprobs - base.generate(prompts(tokenizer), 4, params, seed=0).logprobs
            ).abs().max() > 1e-3


def test_lean_sampling_scores_long_prompts_like_the_float32_policy(tiny):
    """At positions past 250 (where rotary angles are large), the sampled log-probs are the
    float32 policy's teacher-forced ones, to float32 or bf16 rounding."""
    model, tokenizer = tiny
    long = [tokenizer("count: " + " ".join(str(i) for i in range(150)),
                      add_special_tokens=False).input_ids, prompts(tokenizer)[0]]
    assert len(long[0]) > 250
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    for precision, tol in (("fp32", 1e-4), ("bf16", 5e-2)):
        engine = HFRolloutEngine(model, tokenizer, precision=precision)
        out = engine.generate(long, 2, params, seed=0)
        batch = SequenceBatch.build(out.prompt_ids, out.response_ids, out.response_mask,
                                    engine.pad_id)
        with torch.no_grad():
            logp, _ = response_logprobs(model, batch)
        assert (logp - out.logprobs)[out.response_mask].abs().max() < tol, precision


def test_without_onednn_the_lean_forward_uses_plain_matmuls(tiny, monkeypatch):
    model, tokenizer = tiny
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    packed = HFRolloutEngine(model, tokenizer).generate(prompts(tokenizer), 2, params, seed=4)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    monkeypatch.setenv(library.SWITCH, "0")  # nor postrl's own kernels
    weights = LeanWeights.of(model, torch.float32, rows=6)
    assert not weights.lm_head.packed and weights.lm_head.native is None
    assert weights.lm_head.weight.shape == model.lm_head.weight.shape
    plain = HFRolloutEngine(model, tokenizer).generate(prompts(tokenizer), 2, params, seed=4)
    assert_same_rollouts(packed, plain, 1e-5)


@pytest.mark.parametrize("group", [3, 1])
def test_each_decode_step_is_the_policys_forward_as_rows_leave(tiny, group):
    """While all of a prompt's samples run they read its keys and values from one shared
    copy; after rows leave, each row reads its own. Each step's logits are the policy's own
    forward over the prompt and the row's tokens so far, in both layouts and across both."""
    model, tokenizer = tiny
    texts, steps = prompts(tokenizer), 6
    weights = LeanWeights.of(model, torch.float32, rows=len(texts) * group)
    decoder = LeanDecoder(weights, *left_padded(texts, 0), group, steps, share_from=1)
    assert decoder.cache.shared == (group > 1)
    rows = list(range(len(texts) * group))  # original row of each running row
    history = {r: [] for r in rows}
    logits, generator = decoder.first_logits, torch.Generator().manual_seed(0)
    for step in range(steps):
        with torch.no_grad():
            for j, r in enumerate(rows):
                ids = torch.tensor([texts[r // group] + history[r]])
                expected = model(input_ids=ids).logits[0, -1]
                assert (logits[j] - expected).abs().max() < 1e-4, (step, r)
        if step in (2, 4):  # all of prompt 1's rows end and one of prompt 2's; then another
            keep = ([j for j, r in enumerate(rows) if r // group != 1 and r != 7]
                    if step == 2 else list(range(1, len(rows))))
            decoder.select(torch.tensor(keep))
            rows, logits = [rows[j] for j in keep], logits[keep]
            assert not decoder.cache.shared
        tokens = torch.randint(0, len(tokenizer), (len(rows),), generator=generator)
        for r, token in zip(rows, tokens.tolist(), strict=True):
            history[r].append(token)
        logits = decoder.step(tokens, torch.tensor([len(texts[r // group]) + step
                                                    for r in rows]))


def test_without_pytorchs_attention_kernel_with_log_sum_exps_prompts_are_not_shared(
        tiny, monkeypatch):
    model, tokenizer = tiny
    texts = prompts(tokenizer)
    weights = LeanWeights.of(model, torch.float32, rows=len(texts) * 2)
    shared = LeanDecoder(weights, *left_padded(texts, 0), 2, 4, share_from=1)
    monkeypatch.setattr(lean_module, "_flash_available", lambda: False)
    copied = LeanDecoder(weights, *left_padded(texts, 0), 2, 4, share_from=1)
    assert shared.cache.shared and not copied.cache.shared
    tokens = torch.arange(6) + 10
    positions = torch.tensor([len(t) for t in texts]).repeat_interleave(2)
    torch.testing.assert_close(shared.step(tokens, positions), copied.step(tokens, positions),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("rows", [5, 16])
def test_float32_decode_attention_by_matmuls_is_the_fused_kernels(rows, monkeypatch):
    """In float32 (from ``MATMUL_ATTENTION_FROM_ROWS`` running rows, here from 1) a decode
    step's attention is two batched matmuls around a softmax; it gives the fused kernel's
    output on key/value views of a longer cache, as decoding reads them, with left padding
    masked out."""
    monkeypatch.setattr(lean_module, "MATMUL_ATTENTION_FROM_ROWS", 1)
    generator = torch.Generator().manual_seed(0)
    kv_heads, group, dim, columns = 3, 3, 16, 11
    query = torch.randn(rows, kv_heads, group, dim, generator=generator)
    keys, values = (torch.randn(rows, kv_heads, columns + 4, dim, generator=generator)
                    [:, :, :columns] for _ in range(2))
    mask = torch.zeros(rows, 1, 1, columns)
    mask[1:, ..., :3] = torch.finfo(torch.float32).min
    expected = torch.nn.functional.scaled_dot_product_attention(query, keys, values,
                                                                attn_mask=mask)
    torch.testing.assert_close(lean_module._attend_rows(query, keys, values, mask), expected)


def test_float32_sampling_across_the_matmul_attentions_row_count_matches_transformers(
        tiny, monkeypatch):
    """Without postrl's kernels, 3 prompts x 8 samples: a decode step attends by matmuls while
    ``MATMUL_ATTENTION_FROM_ROWS`` rows or more run, by the fused kernel once enough rows have
    ended, and the engine samples what transformers' forward samples either way."""
    monkeypatch.setenv(library.SWITCH, "0")
    force_sharing(monkeypatch, 10**6)  # each row attends over its own columns
    model, tokenizer = tiny
    lean, plain = engines(model, tokenizer)
    lean.eos_ids = plain.eos_ids = torch.arange(0, len(tokenizer), 17)  # most rows end early
    running = []
    attend = lean_module._attend_rows
    monkeypatch.setattr(lean_module, "_attend_rows",
                        lambda q, *rest: running.append(q.shape[0]) or attend(q, *rest))
    params = SamplingParams(temperature=1.0, max_new_tokens=40)
    ours = lean.generate(prompts(tokenizer), 8, params, seed=0)
    assert max(running) >= lean_module.MATMUL_ATTENTION_FROM_ROWS > min(running)
    assert_same_rollouts(ours, plain.generate(prompts(tokenizer), 8, params, seed=0), 1e-5)


def test_prompts_are_shared_from_a_longer_length_where_a_step_runs_in_one_call(tiny,
                                                                              monkeypatch):
    """A 100-token prompt: its columns are shared by its samples where a decode step runs the
    Python layer loop (PyTorch's kernels), copied to each row where the step runs in one call
    of postrl's kernels (sharing then pays only from 256 tokens)."""
    model, tokenizer = tiny
    texts = [tokenizer(" ".join(["seven plus two"] * 33), add_special_tokens=False).input_ids]
    assert lean_module.SHARE_PROMPTS_FROM <= len(texts[0]) < (
        lean_module.SHARE_PROMPTS_FROM_ONE_CALL)
    for switch in ("1", "0"):
        monkeypatch.setenv(library.SWITCH, switch)
        weights = LeanWeights.of(model, torch.float32, rows=2)
        decoder = LeanDecoder(weights, *left_padded(texts, 0), 2, 3)
        assert decoder.cache.shared == (weights.pointers is None)
        assert (weights.pointers is None) == (switch == "0" or native.native_kernels() is None)


def test_a_call_whose_lean_weights_and_cache_would_not_fit_is_sampled_by_transformers(
        tiny, monkeypatch):
    """Where the lean sampler's packed weights and cache would need more memory than is
    available, transformers samples that call with the policy's own weights: the same
    rollouts as an engine without the lean sampler, and no record."""
    model, tokenizer = tiny
    lean, plain = engines(model, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=20)
    columns = max(map(len, prompts(tokenizer))) + params.max_new_tokens
    needed = decoding.sampling_bytes(model, torch.float32, 12, columns)
    monkeypatch.setattr(decoding, "available_memory_bytes", lambda: needed - 1)
    built, build = [], LeanWeights.of
    monkeypatch.setattr(LeanWeights, "of", lambda *a: built.append(a) or build(*a))
    out = lean.generate(prompts(tokenizer), 4, params, seed=0)
    assert built == [] and out.kept_rows is None
    expected = plain.generate(prompts(tokenizer), 4, params, seed=0)
    assert torch.equal(out.response_ids, expected.response_ids)
    assert torch.equal(out.logprobs, expected.logprobs)
    monkeypatch.setattr(decoding, "available_memory_bytes", lambda: needed)  # just enough
    assert_same_rollouts(lean.generate(prompts(tokenizer), 4, params, seed=0), expected, 1e-5)
    assert len(built) == 1


def test_the_lean_samplers_memory_estimate_covers_its_weights_and_cache(tiny):
    model, _ = tiny
    weights = LeanWeights.of(model, torch.float32, 12)
    packed = sum(t.numel() * t.element_size()
                 for layer in weights.layers for linear in (layer.qkv, layer.out, layer.gate_up,
                                                            layer.down)
                 for t in (linear.weight,) if isinstance(t, torch.Tensor))
    packed += weights.lm_head.weight.numel() * weights.lm_head.weight.element_size()
    cache = lean_module.KVCache(weights, 3, 10, 4, 30)
    cache_bytes = sum(t.numel() * t.element_size() for t in (
        cache.prompt_keys, cache.prompt_values, cache.keys, cache.values))
    estimate = decoding.sampling_bytes(model, torch.float32, 12, 40)
    assert 0.9 * packed + cache_bytes <= estimate <= 1.2 * packed + 4 * cache_bytes


def test_available_memory_honours_the_data_limit_and_counts_the_free_heap(monkeypatch):
    """What the data limit leaves, plus what the C heap holds free for reuse."""
    free = decoding.available_memory_bytes()
    assert 0 < free < 2**62
    used = decoding._data_bytes()
    monkeypatch.setattr(decoding.resource, "getrlimit", lambda _: (used + 2**20, used + 2**20))
    monkeypatch.setattr(decoding, "free_heap_bytes", lambda: 0)
    assert decoding.available_memory_bytes() <= 2**20
    monkeypatch.setattr(decoding, "free_heap_bytes", lambda: 2**30)
    assert 2**30 <= decoding.available_memory_bytes() <= 2**30 + 2**20

"""The sampler's recorded forward: what it holds is the training forward's, the update reads
it instead of multiplying and gets the same log-probs and gradients, it is read only while the
weights are those it was recorded with, and the backend frees it itself."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import postrl.models.layers as layers
from postrl.accel import decoding, recorded
from postrl.accel.recorded import flops_per_recorded_byte, parameter_versions
from postrl.models.logprobs import SequenceBatch, response_logprobs
from postrl.models.precision import bf16_copy
from postrl.rollout import HFRolloutEngine, SamplingParams
from tests.models.test_adapters import trained_lora

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=14)


def usable_record(model, batch):
    """The batch's record opened for ``model`` (None: not usable for its forward now)."""
    return batch.kept_rows.open(model)


@pytest.fixture(autouse=True)
def records_the_tiny_model(monkeypatch):
    """The tiny model's forward is mostly its LM head: too little arithmetic per recorded
    byte for a record to pay (see the last test); here it records all the same."""
    monkeypatch.setattr(decoding, "RECORD_MIN_FLOPS_PER_BYTE", 0.0)


def prompts(tokenizer):
    texts = ["What is 2 + 3?", "Name a colour, please, in one word only.", "Hi"]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def sample(model, tokenizer, scoring_model=None, **engine_options):
    """3 prompts of different lengths x 4 samples; rows end at different steps."""
    engine = HFRolloutEngine(model, tokenizer, record_forward=True, **engine_options)
    engine.scoring_model = scoring_model or model
    engine.eos_ids = torch.arange(0, len(tokenizer), 13)  # many stops: rows end early
    return engine.generate(prompts(tokenizer), 4, PARAMS, seed=3)


def micro_batch(rollouts, rows, pad_id=0, with_record=True):
    """Some rows of ``rollouts`` (any order) as the update's forward input."""
    width = max(int(rollouts.lengths[rows].max()), 1)
    batch = SequenceBatch.build([rollouts.prompt_ids[i] for i in rows.tolist()],
                                rollouts.response_ids[rows, :width],
                                rollouts.response_mask[rows, :width], pad_id)
    if with_record:
        batch.kept_rows = rollouts.kept_rows.take(rows)
    return batch


def logp_and_grads(model, batch, head_grad_in_place):
    model.zero_grad(set_to_none=True)
    logp, entropy = response_logprobs(model, batch, with_entropy=True,
                                      head_grad_in_place=head_grad_in_place)
    weights = torch.linspace(-1.0, 1.0, logp.numel()).view(logp.shape)
    ((logp * weights).sum() + entropy.sum()).backward()
    grads = {n: p.grad.to_dense().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return logp.detach(), entropy.detach(), grads


def count_reads(monkeypatch):
    """A list that gets an entry for every linear whose output the backend reads from the
    record (the layers' q, k, v, o, gate, up and down, the LM head's chunks), whichever
    way the linear then takes it (``recorded_linear``, a group of ``tiles.linears``, the
    in-place head's chunks)."""
    reads = []
    for reading in (recorded._LayerReading, recorded._HeadReading):
        def counted(self, x, weights, outputs=reading.outputs):
            found = outputs(self, x, weights)
            reads.extend(1 for _ in found or ())
            return found

        monkeypatch.setattr(reading, "outputs", counted)
    return reads


def test_a_known_linear_returns_its_value_and_the_linears_gradients():
    """The sampler's recorded output stands in for the product; the backward is the plain
    linear's, for the input, the weight and the bias."""
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, dtype=torch.float64, requires_grad=True)
    output = torch.nn.functional.linear(x, weight, bias).detach() + 1e-9  # "recorded"
    grad = torch.randn(5, 4, dtype=torch.float64)
    known = recorded.recorded_linear(x, weight, output, bias)
    assert torch.equal(known, output)
    known.backward(grad)
    got = [t.grad.clone() for t in (x, weight, bias)]
    for t in (x, weight, bias):
        t.grad = None
    torch.nn.functional.linear(x, weight, bias).backward(grad)
    for mine, theirs in zip(got, (x.grad, weight.grad, bias.grad), strict=True):
        torch.testing.assert_close(mine, theirs)


@pytest.mark.parametrize("fixture", ["tiny", "tiny_qwen2"])
def test_the_recorded_forward_gives_the_training_forwards_logprobs_and_gradients(
        request, tiny, fixture, monkeypatch):
    """Rows of two prompts, out of order, packed: every linear and the LM head read the
    record (7 per layer, and the LM head), and log-probs, entropies and every gradient
    (q/k/v biases too, for Qwen2) match the forward that multiplies, to float32 roundoff."""
    model = tiny[0] if fixture == "tiny" else request.getfixturevalue(fixture)
    model.train()
    rollouts = sample(model, tiny[1])
    assert rollouts.kept_rows is not None and len(set(rollouts.lengths.tolist())) > 2
    rows = torch.tensor([5, 0, 7, 2, 4, 1, 6])  # prompts 0 and 1, mixed
    reads = count_reads(monkeypatch)
    for head_grad_in_place in (True, False):
        plain = logp_and_grads(model, micro_batch(rollouts, rows, with_record=False),
                               head_grad_in_place)
        assert not reads
        read = logp_and_grads(model, micro_batch(rollouts, rows), head_grad_in_place)
        # every linear of every layer, and the LM head (one chunk of 8 rows' columns)
        assert len(reads) == 7 * len(model.model.layers) + 1
        reads.clear()
        torch.testing.assert_close(read[0], plain[0], atol=2e-5, rtol=0)
        torch.testing.assert_close(read[1], plain[1], atol=2e-5, rtol=0)
        assert plain[2].keys() == read[2].keys()
        for name, grad in plain[2].items():
            scale = max(1.0, float(grad.abs().max()))
            torch.testing.assert_close(read[2][name], grad, atol=2e-5 * scale, rtol=0,
                                       msg=name)
    model.zero_grad(set_to_none=True)


def test_a_bf16_working_copys_record_gives_its_logprobs_and_gradients(tiny, monkeypatch):
    """``bf16-master``: the sampler runs the bf16 working copy's own weights and records in
    bf16; the copy's forward reads the record (not the float32 masters') and gets its own
    log-probs, entropies and gradients to bf16 rounding: the sampler's forward is another
    bf16 forward (other kernels, other roundings), within twice the float32 forward's
    distance from the update's (also with oneDNN off, as on a CPU without fast bf16)."""
    model, tokenizer = tiny
    working = bf16_copy(model, trainable=True).train()
    rollouts = sample(model, tokenizer, precision="bf16-master", scoring_model=working)
    record = rollouts.kept_rows.record
    assert record.logits.dtype == torch.bfloat16 and record.linears[0][0].dtype == torch.bfloat16
    assert record.fresh(working) and not record.fresh(model)
    rows = torch.tensor([5, 0, 7, 2, 4, 1, 6])
    reads = count_reads(monkeypatch)
    plain = logp_and_grads(working, micro_batch(rollouts, rows, with_record=False), True)
    assert not reads
    read = logp_and_grads(working, micro_batch(rollouts, rows), True)
    assert len(reads) == 7 * len(model.model.layers) + 1
    full = logp_and_grads(model, micro_batch(rollouts, rows, with_record=False), True)
    def gap(a, b):
        return float((a.float() - b.float()).abs().max())

    # measured: 0.6-1.2x the float32 forward's distance (a record read at the wrong slots
    # is off by the spread of the log-probs, 0.5 on the tiny model)
    for got, want, other in zip(read[:2], plain[:2], full[:2], strict=True):
        assert gap(got, want) <= 2 * gap(other, want)
    assert plain[2].keys() == read[2].keys() == full[2].keys()
    for name, grad in plain[2].items():
        assert gap(read[2][name], grad) <= 2 * gap(full[2][name], grad), name


def test_a_record_is_read_only_while_the_weights_are_the_recorded_ones(tiny, monkeypatch):
    """A record written over with zeros changes the log-probs while fresh, and nothing once
    any weight has changed in place (the optimizer step), or for another model."""
    model, tokenizer = tiny
    rollouts = sample(model, tokenizer)
    rows = torch.arange(8)
    with torch.no_grad():
        plain, _ = response_logprobs(model, micro_batch(rollouts, rows, with_record=False))
        batch = micro_batch(rollouts, rows)
        assert usable_record(model, batch) is not None
        record = rollouts.kept_rows.record
        record.logits.zero_()  # every logit 0: log-probs of -log(vocab)
        spoiled, _ = response_logprobs(model, batch)
        scored = batch.attention_mask[:, batch.prompt_width:].bool()
        uniform = -torch.log(torch.tensor(float(model.lm_head.out_features)))
        assert torch.allclose(spoiled[scored], uniform)
        norm = model.model.norm.weight
        norm.add_(0.0)  # an in-place write, the same values
        assert usable_record(model, batch) is None
        torch.testing.assert_close(response_logprobs(model, batch)[0], plain)
        record.versions = parameter_versions(model)
        assert usable_record(model, batch) is not None
        assert usable_record(torch.nn.Module(), batch) is None  # not the recorded model
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert usable_record(model, batch) is None  # the record is float32


def test_the_backend_frees_a_record_once_stale_or_let_go(tiny):
    """A record still held and fresh keeps its memory when the next ``generate`` records;
    once stale (a weight written in place), the next record takes its memory however long it
    is held, and it is never read again; a record nothing holds gives its memory too."""
    model, tokenizer = tiny
    engine = HFRolloutEngine(model, tokenizer, record_forward=True)
    first = engine.generate(prompts(tokenizer), 4, PARAMS, seed=3).kept_rows.record
    rollouts = engine.generate(prompts(tokenizer), 4, PARAMS, seed=4)
    second = rollouts.kept_rows.record
    assert second.logits.data_ptr() != first.logits.data_ptr()  # first is held and fresh
    memory = second.logits.data_ptr()
    batch = micro_batch(rollouts, torch.arange(4))
    assert usable_record(model, batch) is not None
    with torch.no_grad():
        model.model.norm.weight.add_(0.0)  # an in-place write, the same values
    assert usable_record(model, batch) is None and first.stale() and second.stale()
    third = engine.generate(prompts(tokenizer), 4, PARAMS, seed=5).kept_rows.record
    assert third.logits.data_ptr() == memory and not third.stale()  # second is still held
    assert second.model is None and usable_record(model, batch) is None  # released
    del third  # nothing holds it: its memory goes to the next, fresh as it is
    fourth = engine.generate(prompts(tokenizer), 4, PARAMS, seed=6).kept_rows.record
    assert fourth.logits.data_ptr() == memory and not fourth.stale()


def test_the_record_holds_each_prompt_and_response_columns_linear_outputs(tiny):
    """Layer 1's down projection at a prompt's and a response's slots, and the logits that
    predict each response token, are those of transformers' forward of the whole row."""
    model, tokenizer = tiny
    rollouts = sample(model, tokenizer)
    captured = {}
    down = model.model.layers[1].mlp.down_proj
    handle = down.register_forward_hook(lambda _, __, out: captured.update(down=out))
    try:
        for row in (1, 6, 9):  # prompts 0, 1 and 2: three prompt lengths
            batch = micro_batch(rollouts, torch.tensor([row]))
            length = int(batch.attention_mask[0].sum())
            ids = batch.input_ids[:, batch.prompt_width - len(rollouts.prompt_ids[row]):]
            with torch.no_grad():
                logits = model(input_ids=ids[:, :length]).logits[0]
            view = batch.kept_rows
            prompt_len = len(rollouts.prompt_ids[row])
            slots = view.prompt_slots(torch.tensor([0]), batch.prompt_width,
                                      batch.attention_mask[:, : batch.prompt_width])[0]
            real = slots[batch.prompt_width - prompt_len:]
            got = view.record.linears[1][3].index_select(0, real)
            torch.testing.assert_close(got, captured["down"][0, :prompt_len], atol=1e-5,
                                       rtol=0)
            responses = length - prompt_len
            columns = torch.arange(responses - 1)
            got = view.record.linears[1][3].index_select(
                0, view.response_slots(torch.zeros_like(columns), columns))
            torch.testing.assert_close(got, captured["down"][0, prompt_len:length - 1],
                                       atol=1e-5, rtol=0)
            columns = torch.arange(responses)
            got = view.record.logits.index_select(
                0, view.logit_slots(torch.zeros_like(columns), columns))
            torch.testing.assert_close(got, logits[prompt_len - 1 : length - 1], atol=1e-4,
                                       rtol=0)
    finally:
        handle.remove()


def test_the_engine_records_only_a_float32_lean_forward_in_one_chunk_that_fits(tiny,
                                                                            monkeypatch):
    model, tokenizer = tiny
    assert sample(model, tokenizer).kept_rows is not None
    assert sample(model, tokenizer, precision="bf16").kept_rows is None  # samples in bf16
    # bf16-master: a record of the bf16 working copy's forward, not of the float32 masters'
    assert sample(model, tokenizer, precision="bf16-master").kept_rows is None
    working = bf16_copy(model, trainable=True)
    assert sample(model, tokenizer, working, precision="bf16-master").kept_rows is not None
    assert sample(model, tokenizer, batch_size=4).kept_rows is None  # a chunk per prompt
    assert sample(model, tokenizer, lean=False).kept_rows is None  # transformers' forward
    monkeypatch.setattr(decoding, "RECORD_MEMORY_SHARE", 1e-6)
    assert sample(model, tokenizer).kept_rows is None
    monkeypatch.undo()
    assert sample(model, tokenizer).kept_rows is None  # too little arithmetic to pay
    plain = HFRolloutEngine(model, tokenizer).generate(prompts(tokenizer), 4, PARAMS, seed=3)
    assert plain.kept_rows is None


def test_a_record_pays_where_the_model_is_wide_enough(tiny, monkeypatch):
    """SmolLM2's forward saves 329 FLOPs per recorded byte (its record measured 32% off the
    update), the tiny model's 32 (its record made steps slower)."""
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         tie_word_embeddings=True)
    with torch.device("meta"):
        smollm2 = LlamaForCausalLM(config)
    assert flops_per_recorded_byte(smollm2) == pytest.approx(329, abs=1)
    assert flops_per_recorded_byte(tiny[0]) == pytest.approx(32, abs=1)
    monkeypatch.undo()  # the threshold itself
    assert (flops_per_recorded_byte(tiny[0]) < decoding.RECORD_MIN_FLOPS_PER_BYTE
            < flops_per_recorded_byte(smollm2))


def test_layers_that_read_a_record_run_eagerly_under_torch_compile(tiny, monkeypatch):
    """Compiled layers read a record more slowly than eager ones (SmolLM2's update,
    docs/performance.md): with ``compile_layers``, a micro-batch with a usable record runs no
    compiled layer, and one without a record runs it."""
    model, tokenizer = tiny
    model.train()
    rollouts = sample(model, tokenizer)
    rows = torch.tensor([5, 0, 7, 2, 4, 1, 6])
    compiled = []
    monkeypatch.setattr(layers, "_compiled_pair_layer",
                        lambda: compiled.append(1) or layers._pair_layer)
    reads = count_reads(monkeypatch)
    read, _ = response_logprobs(model, micro_batch(rollouts, rows), compile_layers=True)
    assert not compiled and len(reads) == 7 * len(model.model.layers) + 1
    plain, _ = response_logprobs(model, micro_batch(rollouts, rows, with_record=False),
                                 compile_layers=True)
    assert compiled == [1]  # one layer function, chosen once for every layer
    torch.testing.assert_close(read, plain, atol=2e-5, rtol=0)


def test_a_model_with_adapters_is_sampled_without_a_record(tiny):
    """The update runs a LoRA model's forward through peft's layers, which read no record: the
    lean sampler samples it (adapters merged) but records nothing."""
    lora = trained_lora(tiny[0]).get_base_model()
    engine = HFRolloutEngine(lora, tiny[1], record_forward=True)
    assert engine.fast is not None
    assert sample(lora, tiny[1]).kept_rows is None
    assert sample(tiny[0], tiny[1]).kept_rows is not None

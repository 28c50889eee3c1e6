"""The sampler's recorded forward: what it holds is the training forward's, the update reads
it instead of multiplying and gets the same log-probs and gradients, and it is read only
while the weights are those it was recorded with."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import postrl.accel.tiles as tiles
import postrl.models.layers as layers
import postrl.models.logprobs as logprobs_module
import postrl.models.ops as ops
from postrl.accel import decoding
from postrl.accel.recorded import flops_per_recorded_byte, parameter_versions
from postrl.models.logprobs import SequenceBatch, response_logprobs
from postrl.models.precision import bf16_copy
from postrl.rollout import HFRolloutEngine, SamplingParams
from tests.models.test_adapters import trained_lora

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=14)


def usable_record(model, batch):
    """The batch's record opened for ``model`` (None: not usable for its forward now)."""
    return batch.recorded.open(model)


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
        batch.recorded = rollouts.recorded.take(rows)
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
    """A list that gets an entry for every linear that reads the record: through
    ``recorded_linear``, a group of ``tiles.linears`` given their outputs (bf16 on AMX), or
    the in-place head's chunks given their logits."""
    reads = []
    original = ops.KnownLinear.apply
    monkeypatch.setattr(ops.KnownLinear, "apply",
                        lambda *args: reads.append(1) or original(*args))
    grouped = tiles._Linears.apply
    monkeypatch.setattr(tiles._Linears, "apply", lambda x, count, *tensors: reads.extend(
        1 for known in tensors[2 * count:] if known is not None) or grouped(x, count, *tensors))
    head = logprobs_module._HeadChunk.apply
    monkeypatch.setattr(logprobs_module._HeadChunk, "apply",
                        lambda hidden, output, *args: (output is not None and reads.append(1))
                        or head(hidden, output, *args))
    return reads


@pytest.mark.parametrize("fixture", ["tiny", "tiny_qwen2"])
def test_the_recorded_forward_gives_the_training_forwards_logprobs_and_gradients(
        request, tiny, fixture, monkeypatch):
    """Rows of two prompts, out of order, packed: every linear and the LM head read the
    record (7 per layer, and the LM head), and log-probs, entropies and every gradient
    (q/k/v biases too, for Qwen2) match the forward that multiplies, to float32 roundoff."""
    model = tiny[0] if fixture == "tiny" else request.getfixturevalue(fixture)
    model.train()
    rollouts = sample(model, tiny[1])
    assert rollouts.recorded is not None and len(set(rollouts.lengths.tolist())) > 2
    rows = torch.tensor([5, 0, 7, 2, 4, 1, 6])  # prompts 0 and 1, mixed
    reads = count_reads(monkeypatch)
    for head_grad_in_place in (True, False):
        plain = logp_and_grads(model, micro_batch(rollouts, rows, with_record=False),
                               head_grad_in_place)
        assert not reads
        recorded = logp_and_grads(model, micro_batch(rollouts, rows), head_grad_in_place)
        # every linear of every layer, and the LM head (one chunk of 8 rows' columns)
        assert len(reads) == 7 * len(model.model.layers) + 1
        reads.clear()
        torch.testing.assert_close(recorded[0], plain[0], atol=2e-5, rtol=0)
        torch.testing.assert_close(recorded[1], plain[1], atol=2e-5, rtol=0)
        assert plain[2].keys() == recorded[2].keys()
        for name, grad in plain[2].items():
            scale = max(1.0, float(grad.abs().max()))
            torch.testing.assert_close(recorded[2][name], grad, atol=2e-5 * scale, rtol=0,
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
    record = rollouts.recorded.record
    assert record.logits.dtype == torch.bfloat16 and record.linears[0][0].dtype == torch.bfloat16
    assert record.fresh(working) and not record.fresh(model)
    rows = torch.tensor([5, 0, 7, 2, 4, 1, 6])
    reads = count_reads(monkeypatch)
    plain = logp_and_grads(working, micro_batch(rollouts, rows, with_record=False), True)
    assert not reads
    recorded = logp_and_grads(working, micro_batch(rollouts, rows), True)
    assert len(reads) == 7 * len(model.model.layers) + 1
    full = logp_and_grads(model, micro_batch(rollouts, rows, with_record=False), True)
    def gap(a, b):
        return float((a.float() - b.float()).abs().max())

    # measured: 0.6-1.2x the float32 forward's distance (a record read at the wrong slots
    # is off by the spread of the log-probs, 0.5 on the tiny model)
    for got, want, other in zip(recorded[:2], plain[:2], full[:2], strict=True):
        assert gap(got, want) <= 2 * gap(other, want)
    assert plain[2].keys() == recorded[2].keys() == full[2].keys()
    for name, grad in plain[2].items():
        assert gap(recorded[2][name], grad) <= 2 * gap(full[2][name], grad), name


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
        record = rollouts.recorded.record
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


def test_a_released_record_gives_its_memory_to_the_next_and_is_never_read(tiny):
    """A record still held when the next ``generate`` records keeps its memory; once
    released, its memory goes to the next record however long it is held, and it is never
    read again."""
    model, tokenizer = tiny
    engine = HFRolloutEngine(model, tokenizer, record_forward=True)
    first = engine.generate(prompts(tokenizer), 4, PARAMS, seed=3).recorded.record
    rollouts = engine.generate(prompts(tokenizer), 4, PARAMS, seed=4)
    second = rollouts.recorded.record
    assert second.logits.data_ptr() != first.logits.data_ptr()  # first is still held
    memory = second.logits.data_ptr()
    batch = micro_batch(rollouts, torch.arange(4))
    assert usable_record(model, batch) is not None
    second.release()
    assert not second.fresh(model) and usable_record(model, batch) is None
    third = engine.generate(prompts(tokenizer), 4, PARAMS, seed=5).recorded.record
    assert third.logits.data_ptr() == memory and third.fresh(model)  # second is still held
    first.release()  # not the memory's holder now: nothing changes
    fourth = engine.generate(prompts(tokenizer), 4, PARAMS, seed=6).recorded.record
    assert fourth.logits.data_ptr() != memory and third.fresh(model)


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
            view = batch.recorded
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
    assert sample(model, tokenizer).recorded is not None
    assert sample(model, tokenizer, precision="bf16").recorded is None  # samples in bf16
    # bf16-master: a record of the bf16 working copy's forward, not of the float32 masters'
    assert sample(model, tokenizer, precision="bf16-master").recorded is None
    working = bf16_copy(model, trainable=True)
    assert sample(model, tokenizer, working, precision="bf16-master").recorded is not None
    assert sample(model, tokenizer, batch_size=4).recorded is None  # a chunk per prompt
    assert sample(model, tokenizer, lean=False).recorded is None  # transformers' forward
    monkeypatch.setattr(decoding, "RECORD_MEMORY_SHARE", 1e-6)
    assert sample(model, tokenizer).recorded is None
    monkeypatch.undo()
    assert sample(model, tokenizer).recorded is None  # too little arithmetic to pay
    plain = HFRolloutEngine(model, tokenizer).generate(prompts(tokenizer), 4, PARAMS, seed=3)
    assert plain.recorded is None


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
    recorded, _ = response_logprobs(model, micro_batch(rollouts, rows), compile_layers=True)
    assert not compiled and len(reads) == 7 * len(model.model.layers) + 1
    plain, _ = response_logprobs(model, micro_batch(rollouts, rows, with_record=False),
                                 compile_layers=True)
    assert compiled == [1]  # one layer function, chosen once for every layer
    torch.testing.assert_close(recorded, plain, atol=2e-5, rtol=0)


def test_a_model_with_adapters_is_sampled_without_a_record(tiny):
    """The update runs a LoRA model's forward through peft's layers, which read no record: the
    lean sampler samples it (adapters merged) but records nothing."""
    lora = trained_lora(tiny[0]).get_base_model()
    engine = HFRolloutEngine(lora, tiny[1], record_forward=True)
    assert engine.fast is not None
    assert sample(lora, tiny[1]).recorded is None
    assert sample(tiny[0], tiny[1]).recorded is not None

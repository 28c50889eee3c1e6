"""postrl's own training forward of Llama-style layers against transformers' forward."""

import copy
import math

import pytest
import torch
from torch._dynamo.utils import counters

from postrl.config import load_config
from postrl.models import layers, ops
from postrl.models.logprobs import SequenceBatch, response_logprobs
from postrl.models.policy import apply_lora
from postrl.train.trainer import Trainer


def shared_batch(tokenizer, share_prompts=True):
    """Six rows with responses of different lengths: two prompts of different lengths, three
    rows each (their responses packed where they fit), or six different prompts."""
    texts = (["What is 1 + 1?", "Add the numbers seven and eight, please."] * 3 if share_prompts
             else [f"What is {i} + {i}?" + " Think." * i for i in range(6)])
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    responses = torch.randint(5, 100, (6, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.arange(5)[None] < torch.tensor([5, 1, 3, 5, 2, 4])[:, None]
    return SequenceBatch.build(prompts, responses, mask, tokenizer.pad_token_id)


def scored(model, batch, monkeypatch, own_layers: bool, compile_layers: bool = False):
    """Log-probs, entropies and the gradient of a weighted sum of the log-probs (undoes every
    monkeypatch of the test so far)."""
    if not own_layers:
        monkeypatch.setattr(layers, "unsupported_reason", lambda model: "switched off")
    model.zero_grad(set_to_none=True)
    logp, entropy = response_logprobs(model, batch, temperature=0.7, with_entropy=True,
                                      compile_layers=compile_layers)
    (logp * torch.arange(1, len(logp) + 1)[:, None]).sum().backward()
    monkeypatch.undo()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logp.detach(), entropy, grads


def assert_same(model, batch, monkeypatch):
    ours = scored(model, batch, monkeypatch, own_layers=True)
    theirs = scored(model, batch, monkeypatch, own_layers=False)
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours[1], theirs[1], atol=1e-5, rtol=0)
    for name, grad in ours[2].items():
        torch.testing.assert_close(grad, theirs[2][name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("share_prompts", [True, False], ids=["shared", "distinct-prompts"])
def test_own_layers_give_transformers_logprobs_and_gradients(tiny, monkeypatch, share_prompts):
    """Packed responses after shared prompts, and one plain forward when no prompt repeats."""
    model, tokenizer = tiny
    assert layers.unsupported_reason(model) is None
    assert_same(model, shared_batch(tokenizer, share_prompts), monkeypatch)


def test_own_layers_match_transformers_on_a_qwen2_with_biases(tiny, tiny_qwen2, monkeypatch):
    assert layers.unsupported_reason(tiny_qwen2) is None
    assert_same(tiny_qwen2, shared_batch(tiny[1]), monkeypatch)


def test_models_the_own_layers_do_not_cover_keep_transformers_forward(tiny):
    model, tokenizer = tiny
    lora = apply_lora(copy.deepcopy(model), 4, 8, 0.0, ["q_proj", "v_proj"])
    assert "adapters" in layers.unsupported_reason(lora.get_base_model())
    dropout = copy.deepcopy(model)
    dropout.config.attention_dropout = 0.1
    assert layers.unsupported_reason(dropout) == "attention dropout"
    with torch.no_grad():  # the fallback still scores the batch
        logp, _ = response_logprobs(lora.get_base_model(), shared_batch(tokenizer))
    assert logp.shape == (6, 5) and torch.isfinite(logp).all()


def counting_compiled_layer(monkeypatch) -> list[str]:
    """Patches in a counter of the calls to the compiled layers (a plain layer, or a layer over
    prompts and packed rows together); returns it."""
    calls = []
    for name in ("_compiled_layer", "_compiled_pair_layer"):
        compiled = getattr(layers, name)()

        def counting(*args, compiled=compiled, name=name):
            calls.append(name)
            return compiled(*args)

        monkeypatch.setattr(layers, name, lambda counting=counting: counting)
    return calls


@pytest.mark.slow  # torch.compile compiles the model first: slow on a cold cache
def test_compiled_layers_give_transformers_logprobs_and_gradients(tiny, monkeypatch):
    """``torch_compile``: the layers run compiled (one graph for every layer, dynamic lengths)
    when gradients are on, and eagerly without them."""
    model, tokenizer = tiny
    calls = counting_compiled_layer(monkeypatch)
    batch = shared_batch(tokenizer)
    ours = scored(model, batch, monkeypatch, own_layers=True, compile_layers=True)
    # the prompts and the packed responses together, one call per layer
    assert calls == ["_compiled_pair_layer"] * len(model.model.layers)
    theirs = scored(model, batch, monkeypatch, own_layers=False)
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-5, rtol=0)
    for name, grad in ours[2].items():
        torch.testing.assert_close(grad, theirs[2][name], atol=1e-5, rtol=1e-4, msg=name)
    calls = counting_compiled_layer(monkeypatch)
    with torch.no_grad():
        response_logprobs(model, shared_batch(tokenizer, share_prompts=False),
                          compile_layers=True)
    assert calls == []


def other_sizes(tokenizer, prompts: int) -> SequenceBatch:
    """``prompts`` prompts, three rows each, of 4, 1 and 3 response tokens (two of them fit
    in one packed row)."""
    texts = ["What is 2 + 3?", "Subtract four from nine.", "Double six, then add one."][:prompts]
    prompt_ids = [tokenizer(t, add_special_tokens=False).input_ids for t in texts for _ in "abc"]
    rows = len(prompt_ids)
    responses = torch.randint(5, 100, (rows, 4), generator=torch.Generator().manual_seed(1))
    mask = torch.arange(4)[None] < torch.tensor([4, 1, 3] * prompts)[:, None]
    return SequenceBatch.build(prompt_ids, responses, mask, tokenizer.pad_token_id)


def test_compiled_layers_compile_once_for_every_size(tiny, monkeypatch):
    """After its first compile, the compiled layer serves other sizes without compiling
    again. ``shared_batch`` has as many rows as packed response tokens (6), which dynamo
    would have made one size and recompiled at the first batch where they differ; a
    micro-batch of a single prompt, whose size of 1 dynamo would specialise, runs eagerly and
    still gives transformers' log-probs."""
    model, tokenizer = tiny
    calls = counting_compiled_layer(monkeypatch)
    scored(model, shared_batch(tokenizer), monkeypatch, own_layers=True, compile_layers=True)
    graphs = counters["stats"]["unique_graphs"]  # the first compile (or an earlier test's)
    calls = counting_compiled_layer(monkeypatch)
    scored(model, other_sizes(tokenizer, 3), monkeypatch, own_layers=True, compile_layers=True)
    assert calls == ["_compiled_pair_layer"] * len(model.model.layers)
    assert counters["stats"]["unique_graphs"] == graphs
    calls = counting_compiled_layer(monkeypatch)
    single = other_sizes(tokenizer, 1)
    ours = scored(model, single, monkeypatch, own_layers=True, compile_layers=True)
    assert calls == [] and counters["stats"]["unique_graphs"] == graphs
    theirs = scored(model, single, monkeypatch, own_layers=False)
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-5, rtol=0)


@pytest.mark.slow  # torch.compile compiles the model first: slow on a cold cache
def test_torch_compile_option_reaches_the_training_forward(tiny, monkeypatch, tmp_path):
    calls = counting_compiled_layer(monkeypatch)
    cfg = load_config(None, ["model=tiny", "task=arithmetic", "steps=1", "prompts_per_step=2",
                             "group_size=2", "max_new_tokens=6", "quiet=true",
                             f"out={tmp_path / 'run'}", "torch_compile=true"])
    row = Trainer(cfg).train_step()
    assert calls and math.isfinite(row["loss/policy"])


@pytest.mark.parametrize("share_prompts", [True, False], ids=["shared", "distinct-prompts"])
def test_fused_attention_gives_transformers_logprobs_and_gradients(tiny, monkeypatch,
                                                                   share_prompts):
    """On a GPU the own layers attend by SDPA (``ops.sdpa_attention``); forced here on the CPU,
    where grouped heads and fully masked rows (left padding) are the same as elsewhere."""
    model, tokenizer = tiny
    batch = shared_batch(tokenizer, share_prompts)
    theirs = scored(model, batch, monkeypatch, own_layers=False)
    calls = []
    real = ops.sdpa_attention
    monkeypatch.setattr(ops, "FUSED_ATTENTION_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(ops, "sdpa_attention", lambda *a: calls.append(1) or real(*a))
    ours = scored(model, batch, monkeypatch, own_layers=True)
    assert calls
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours[1], theirs[1], atol=1e-5, rtol=0)
    for name, grad in ours[2].items():
        torch.testing.assert_close(grad, theirs[2][name], atol=1e-5, rtol=1e-4, msg=name)


def test_long_sequences_attend_by_sdpa_on_the_cpu_too(tiny, monkeypatch):
    """From ``FUSED_ATTENTION_SCORES`` scores per row and head on, the CPU attends by SDPA
    (its flash kernel never holds the scores), with the same results; below, by
    matmul-softmax."""
    model, tokenizer = tiny
    batch = shared_batch(tokenizer, True)
    real, calls = ops.sdpa_attention, []

    def counting(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(ops, "sdpa_attention", counting)
    short = scored(model, batch, monkeypatch, own_layers=True)  # undoes the patches
    assert not calls  # the tiny batch's few scores: matmul-softmax
    monkeypatch.setattr(ops, "sdpa_attention", counting)
    monkeypatch.setattr(ops, "FUSED_ATTENTION_SCORES", 8)
    long = scored(model, batch, monkeypatch, own_layers=True)
    assert calls
    torch.testing.assert_close(long[0], short[0], atol=1e-5, rtol=0)
    for name, grad in long[2].items():
        torch.testing.assert_close(grad, short[2][name], atol=1e-5, rtol=1e-4, msg=name)

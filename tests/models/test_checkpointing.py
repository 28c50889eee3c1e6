"""``gradient_checkpointing``: the same log-probs and gradients, fewer activations kept, on
postrl's own layers and on transformers' forward (whose checkpointed layers drop a cache)."""

import copy
import json

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from postrl.errors import ConfigError
from postrl.models import layers
from postrl.models.logprobs import response_logprobs
from postrl.models.policy import ValueModel, apply_lora
from postrl.train.setup import checkpoint_layers
from postrl.train.trainer import Trainer
from tests.models.test_layers import shared_batch
from tests.train.test_trainer import tiny_config


def kept_bytes(model, batch) -> int:
    """Bytes the scoring forward keeps for the backward (storages outside the parameters,
    each once): the layers' activations, and each chunk's logits."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        logp, _ = response_logprobs(model, batch, temperature=0.7, with_entropy=True)
    logp.sum().backward()
    model.zero_grad(set_to_none=True)
    return sum(kept.values())


def scored(model, batch):
    """The log-probs and the gradient of their weighted sum."""
    model.zero_grad(set_to_none=True)
    logp, _ = response_logprobs(model, batch, temperature=0.7)
    (logp * torch.arange(1, len(logp) + 1)[:, None]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logp.detach(), grads


def assert_checkpointing_changes_only_memory(model, batch):
    plain_bytes, plain = kept_bytes(model, batch), scored(model, batch)
    checkpoint_layers(model, "tiny")
    assert layers.checkpointed(model)
    ours_bytes, ours = kept_bytes(model, batch), scored(model, batch)
    assert ours_bytes < 0.1 * plain_bytes, (ours_bytes, plain_bytes)
    torch.testing.assert_close(ours[0], plain[0], atol=1e-6, rtol=0)
    assert ours[1].keys() == plain[1].keys()
    for name, grad in ours[1].items():
        torch.testing.assert_close(grad, plain[1][name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("share_prompts", [True, False], ids=["shared", "distinct-prompts"])
def test_own_layers_recompute_the_same_forward(tiny, share_prompts):
    model, tokenizer = tiny
    model = copy.deepcopy(model)
    assert layers.unsupported_reason(model) is None
    assert_checkpointing_changes_only_memory(model, shared_batch(tokenizer, share_prompts))


def test_transformers_forward_checkpoints_without_losing_the_prompts(tiny):
    """LoRA keeps transformers' forward, whose checkpointed layers run without the shared
    prompts' cache: rows then run whole, and score as they would with the cache."""
    model, tokenizer = tiny
    model = apply_lora(copy.deepcopy(model), 4, 8, 0.0, ["q_proj"]).train()
    assert layers.unsupported_reason(model.get_base_model()) is not None
    assert_checkpointing_changes_only_memory(model.get_base_model(), shared_batch(tokenizer))


def test_a_critic_copied_after_checkpointing_checkpoints_too(tiny):
    model, _ = tiny
    model = copy.deepcopy(model)
    checkpoint_layers(model, "tiny")
    critic = ValueModel(model)
    assert all(layer.gradient_checkpointing for layer in critic.backbone.layers)


def test_a_model_without_checkpointing_is_refused_by_name(tiny, monkeypatch):
    model, _ = tiny
    model = copy.deepcopy(model)
    monkeypatch.setattr(type(model), "supports_gradient_checkpointing", False)
    with pytest.raises(ConfigError, match="gradient_checkpointing: model 'tiny'"):
        checkpoint_layers(model, "tiny")


@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_a_run_with_checkpointing_trains_as_one_without(tmp_path, recipe):
    """Every metric of two steps the same to float rounding (times aside), the critic's too;
    the option reaches the policy and the critic."""
    rows = {}
    for on in (False, True):
        trainer = Trainer(tiny_config(tmp_path / str(on), recipe, "steps=2",
                                      f"gradient_checkpointing={str(on).lower()}"))
        assert layers.checkpointed(trainer.lm) == on
        if trainer.critic is not None:
            assert trainer.critic.backbone.layers[0].gradient_checkpointing == on
        trainer.train()
        lines = (tmp_path / str(on) / recipe / "metrics.jsonl").read_text().splitlines()
        rows[on] = [{k: v for k, v in json.loads(line).items()
                     if not k.startswith(("time/", "throughput/", "memory/"))} for line in lines]
    assert len(rows[True]) == 2
    for ours, plain in zip(rows[True], rows[False], strict=True):
        assert ours.keys() == plain.keys()
        for key, value in plain.items():
            expected = value if value is None else pytest.approx(value, rel=1e-4, abs=1e-6)
            assert ours[key] == expected, key

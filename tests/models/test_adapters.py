"""A linear layer's weight as its forward applies it: a plain linear's own tensors, a LoRA
layer's base weight plus its adapters' product; what cannot be merged is refused by name."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from postrl.models import layers
from postrl.models.adapters import effective_linear, linear_reason
from postrl.models.policy import apply_lora

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def trained_lora(model, targets=TARGETS, **options):
    """A copy of ``model`` with rank-4 adapters on ``targets`` (every linear of its layers),
    their B matrices moved off zero (peft starts them at zero, where an adapter changes
    nothing), in eval mode."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), **options)
    lora = get_peft_model(copy.deepcopy(model), config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in lora.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.05)
    return lora.eval()


def first_q_proj(lora):
    return lora.get_base_model().model.layers[0].self_attn.q_proj


def test_a_plain_linear_is_its_own_tensors():
    linear = nn.Linear(8, 4)
    weight, bias = effective_linear(linear)
    assert linear_reason(linear) is None
    assert weight.data_ptr() == linear.weight.data_ptr() and not weight.requires_grad
    assert bias.data_ptr() == linear.bias.data_ptr()


def test_a_lora_layers_merged_weight_is_what_its_forward_applies(tiny):
    module = first_q_proj(trained_lora(tiny[0]))
    x = torch.randn(5, module.in_features)
    weight, bias = effective_linear(module)
    assert linear_reason(module) is None and bias is None
    with torch.no_grad():
        expected = module(x)
        torch.testing.assert_close(x @ weight.T, expected, rtol=1e-5, atol=1e-5)
        # the adapters matter here: the base weight alone is far off
        assert (x @ module.base_layer.weight.T - expected).abs().max() > 1e-2


def test_what_cannot_be_merged_is_refused_by_name(tiny):
    model = tiny[0]
    assert "DoRA" in linear_reason(first_q_proj(trained_lora(model, use_dora=True)))
    merged = trained_lora(model)
    first_q_proj(merged).merge()
    assert "merged" in linear_reason(first_q_proj(merged))
    switched_off = trained_lora(model)
    with switched_off.disable_adapter():
        assert "switched off" in linear_reason(first_q_proj(switched_off))
    assert linear_reason(first_q_proj(switched_off)) is None
    with pytest.raises(ValueError, match="DoRA"):
        effective_linear(first_q_proj(trained_lora(model, use_dora=True)))


class ScaledLinear(nn.Linear):  # stands for a quantised or otherwise unfamiliar linear
    pass


def test_unfamiliar_linears_are_refused():
    assert "non-plain" in linear_reason(ScaledLinear(4, 4))


def test_the_training_body_refuses_adapters_the_sampler_takes(tiny):
    model = tiny[0]
    lora = apply_lora(copy.deepcopy(model), 4, 8, 0.0, ["q_proj", "v_proj"]).get_base_model()
    assert "adapters" in layers.body_reason(lora)
    assert layers.body_reason(lora, adapters=True) is None
    assert layers.architecture_reason(lora, adapters=True) is None

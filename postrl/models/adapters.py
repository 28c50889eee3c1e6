"""A linear layer's weight as its forward applies it, peft's LoRA adapters included, for code
that multiplies the weights itself (the backend's sampler packs them once per call).

A LoRA layer (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3)
computes ``W x + b + scaling * B A x`` in eval mode (no dropout), which is
``(W + scaling * B A) x + b``: a sampler may multiply that merged weight. What else peft
offers (DoRA and other variants, fan-in-fan-out weights, adapters already merged into the
base or switched off) is refused by name, and transformers samples such a model itself.
"""

from __future__ import annotations

import sys

from torch import Tensor, nn


def linear_reason(module: nn.Module) -> str | None:
    """Why :func:`effective_linear` cannot give ``module``'s weight (None when it can: a plain
    ``nn.Linear``, or a peft LoRA layer over one)."""
    if type(module) is nn.Linear:
        return None
    if not _is_lora_linear(module):
        return "non-plain linear layers (quantisation or an adapter other than LoRA)"
    if type(module.base_layer) is not nn.Linear:
        return "LoRA over a non-plain linear layer"
    if module.disable_adapters or module.merged:
        return "LoRA adapters switched off or merged into the base weights"
    if module.fan_in_fan_out:
        return "LoRA with fan-in-fan-out weights"
    variants = getattr(module, "lora_variant", {})  # DoRA and others (peft >= 0.15)
    if any(name in variants or module.use_dora.get(name) for name in _active(module)):
        return "a LoRA variant (DoRA or another)"
    return None


def effective_linear(module: nn.Module) -> tuple[Tensor, Tensor | None]:
    """``module``'s weight and bias as its forward applies them in eval mode, detached: a
    plain linear's own tensors (no copy), or a LoRA layer's base weight plus each active
    adapter's ``scaling * B A`` (a new tensor). ValueError where :func:`linear_reason` names
    a reason."""
    reason = linear_reason(module)
    if reason is not None:
        raise ValueError(f"no single weight for {type(module).__name__}: {reason}")
    if type(module) is nn.Linear:
        return module.weight.detach(), None if module.bias is None else module.bias.detach()
    base = module.base_layer
    weight = base.weight.detach()
    for name in _active(module):
        weight = weight + module.get_delta_weight(name).detach().to(weight.dtype)
    return weight, None if base.bias is None else base.bias.detach()


def has_lora(model: nn.Module) -> bool:
    """Whether any layer of ``model`` is a peft LoRA linear layer."""
    return any(_is_lora_linear(module) for module in model.modules())


def merged_state(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter of ``model`` (detached, shared ones once) under the names it has
    without adapters: each LoRA layer's ``<name>.weight`` (and bias) is its
    :func:`effective_linear`, so the state loads into the base architecture, as a sampler
    that serves the merged model needs. ValueError as :func:`effective_linear`."""
    state: dict[str, Tensor] = {}
    lora = set()
    for name, module in model.named_modules():
        if _is_lora_linear(module):
            weight, bias = effective_linear(module)
            state[f"{name}.weight"] = weight
            if bias is not None:
                state[f"{name}.bias"] = bias
            lora.add(name)
    for name, param in model.named_parameters():
        parts = name.split(".")
        if not any(".".join(parts[:i]) in lora for i in range(1, len(parts))):
            state[name] = param.detach()
    return state


def _active(module: nn.Module) -> list[str]:
    """The names of a LoRA layer's adapters that its forward applies."""
    return [name for name in module.active_adapters if name in module.lora_A]


def _is_lora_linear(module: nn.Module) -> bool:
    """Whether ``module`` is peft's LoRA linear layer (peft not imported: no module is)."""
    if "peft" not in sys.modules:
        return False
    from peft.tuners.lora import Linear

    return isinstance(module, Linear)

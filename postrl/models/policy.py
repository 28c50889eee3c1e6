"""The models around a policy: LoRA adapters, the reference policy, PPO's critic, saving."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch
from torch import nn

from postrl.errors import ConfigError
from postrl.models.logprobs import SequenceBatch, response_hidden, response_logprobs


def apply_lora(model, r: int, alpha: int, dropout: float, target_modules: list[str]):
    """Wrap ``model`` with peft LoRA adapters; only the adapters are trainable. ConfigError
    for an entry of ``target_modules`` that names no module (peft matches an entry to every
    module whose dotted name is it or ends in ``.entry``)."""
    from peft import LoraConfig, get_peft_model

    names = [name for name, _ in model.named_modules()]
    for target in target_modules:
        if not any(name == target or name.endswith(f".{target}") for name in names):
            linears = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                              if isinstance(module, nn.Linear)})
            raise ConfigError(f"lora.target_modules: {target!r} matches no module of the model; "
                              f"its linear layers are {', '.join(linears)}")

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=list(target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def is_lora(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def causal_lm(model):
    """The transformers causal LM inside a (possibly peft-wrapped) policy."""
    return model.get_base_model() if is_lora(model) else model


class ReferencePolicy:
    """Log-probs under the frozen reference: the base model with LoRA adapters disabled, or a
    frozen copy of the initial policy when all weights are trained."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self.frozen = None
        if not is_lora(policy):
            self.frozen = copy.deepcopy(policy).eval().requires_grad_(False)

    @torch.no_grad()
    def logprobs(self, batch: SequenceBatch, temperature: float) -> torch.Tensor:
        # never what the backend kept of the policy's sampling: with adapters disabled the
        # model is the same object, at the same weight versions, yet not the sampled policy
        batch = dataclasses.replace(batch, kept_rows=None)
        if self.frozen is not None:
            return response_logprobs(self.frozen, batch, temperature)[0]
        with self.policy.disable_adapter():
            return response_logprobs(causal_lm(self.policy), batch, temperature)[0]


class ValueModel(nn.Module):
    """PPO's critic: a copy of the policy's backbone with a scalar head (Schulman et al. 2017).

    ``values(batch)[i, t]`` estimates the return from the state just before response token t,
    read at the same position that predicts token t.
    """

    def __init__(self, policy) -> None:
        super().__init__()
        lm = causal_lm(policy)
        self.backbone = copy.deepcopy(lm.model).requires_grad_(True)
        self.head = nn.Linear(lm.config.hidden_size, 1, device=lm.device)  # beside the backbone
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def values(self, batch: SequenceBatch, share_prompts: bool = True,
               compile_layers: bool = False) -> torch.Tensor:
        """``[N, T]`` float32, 0 outside the response mask. The backbone runs like the
        policy's scoring forward (:func:`postrl.models.logprobs.response_hidden`): rows of a
        prompt share its forward unless ``share_prompts`` is off (FSDP2), responses packed,
        postrl's own layers for Llama-style backbones (compiled with ``compile_layers``)."""
        hidden, _ = response_hidden(_Body(self.backbone), batch, share_prompts, compile_layers)
        values = self.head(hidden).squeeze(-1).float()
        return values.masked_fill(~batch.scored, 0.0)


class _Body:
    """What :func:`response_hidden` reads of a causal LM (its body and config), around a
    bare decoder body such as the critic's backbone."""

    def __init__(self, body) -> None:
        self.model, self.config = body, body.config

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()


def save_policy(model, tokenizer, path: Path) -> None:
    """A Hugging Face directory ``transformers`` loads directly (LoRA merged into a copy)."""
    path.mkdir(parents=True, exist_ok=True)
    plain = copy.deepcopy(model).merge_and_unload() if is_lora(model) else model
    plain.save_pretrained(path)
    tokenizer.save_pretrained(path)

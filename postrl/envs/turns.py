"""The tokens of an environment's turn, rendered by the tokenizer's chat template.

Multi-turn rollouts are token in, token out: the model's sampled tokens stay exactly as
sampled and the environment's reply is *appended* as tokens; earlier turns are never decoded
and re-tokenized (which can split words differently and silently change what was sampled).
This module finds the text the chat template puts between the end of an assistant message and
the start of the next assistant message, with the observation in between, and tokenizes only
that.
"""

from __future__ import annotations

from typing import Any

_USER, _ASSISTANT = "\x1fpostrl-user\x1f", "\x1fpostrl-assistant\x1f"  # never in real text


def turn_text(tokenizer: Any, observation: str, role: str = "user") -> str:
    """The text after an assistant message's content up to the next assistant message's
    content: its end-of-turn marker, the ``role`` turn holding ``observation``, and the
    generation prompt. A tokenizer without a chat template gets plain paragraphs."""
    if not getattr(tokenizer, "chat_template", None):
        return f"\n\n{observation}\n\n"
    messages = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT},
                {"role": role, "content": observation}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
    if _ASSISTANT not in rendered:
        raise ValueError("the chat template drops the assistant's message; it cannot render "
                         "a multi-turn episode")
    return rendered[rendered.index(_ASSISTANT) + len(_ASSISTANT):]


def observation_ids(tokenizer: Any, observation: str, role: str = "user",
                    after_eos: bool = True) -> list[int]:
    """Token ids of the environment's turn, to append after the model's sampled tokens.

    ``after_eos``: the model's turn ended with its end-of-sequence token, which the template's
    end-of-turn marker then starts with and which is not repeated."""
    text = turn_text(tokenizer, observation, role)
    eos = tokenizer.eos_token or ""
    if after_eos and eos and text.startswith(eos):
        text = text[len(eos):]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])

"""Turning a task's question into the text the model is prompted with (its chat template)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from postrl.envs.tools import tool_schema, tools_system_text

Message = dict[str, str]  # {"role": "user" | "assistant" | "tool" | "system", "content": ...}


def chat_messages(question: str, system_prompt: str | None = None,
                  demonstrations: Sequence[Message] = ()) -> list[Message]:
    """The conversation to render: an optional system turn, the demonstrations (worked
    example turns, shown as earlier conversation), then the user's question."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*messages, *demonstrations, {"role": "user", "content": question}]


def task_prompt(tokenizer: Any, task: Any, question: str,
                system_prompt: str | None = None) -> str:
    """:func:`build_prompt` with what ``task`` adds to every prompt: its ``tools`` and its
    ``demonstrations`` (a task may have neither)."""
    return build_prompt(tokenizer, question, system_prompt, getattr(task, "tools", ()),
                        getattr(task, "demonstrations", ()))


def build_prompt(tokenizer: Any, question: str, system_prompt: str | None = None,
                 tools: Sequence[Callable[..., Any]] = (),
                 demonstrations: Sequence[Message] = ()) -> str:
    """Render ``question`` with the tokenizer's chat template, ending where the assistant's
    reply begins (``add_generation_prompt=True``).

    Without a system prompt the template's own default applies (SmolLM2's names itself). A
    tokenizer without a chat template (a base model) gets the raw text and a newline, with the
    system prompt and each demonstration's content, if any, as earlier paragraphs. ``tools``
    (functions, ``postrl.envs.tools``) are offered by the template when it renders them,
    otherwise described in the system message. ``demonstrations`` are prompt tokens like the
    question: the model reads them and is never trained on them.
    """
    schemas = [tool_schema(function) for function in tools]
    if schemas and not _renders_tools(tokenizer, schemas):
        system_prompt = "\n\n".join(filter(None, (system_prompt, tools_system_text(schemas))))
        schemas = []
    if not getattr(tokenizer, "chat_template", None):
        earlier = [system_prompt] if system_prompt else []
        earlier += [message["content"] for message in demonstrations]
        return "".join(f"{text}\n\n" for text in earlier) + f"{question}\n"
    prompt = tokenizer.apply_chat_template(
        chat_messages(question, system_prompt, demonstrations), tokenize=False,
        add_generation_prompt=True,
        **({"tools": schemas} if schemas else {}))
    if not isinstance(prompt, str):
        raise TypeError(f"apply_chat_template returned {type(prompt).__name__}, expected str")
    return prompt


def _renders_tools(tokenizer: Any, schemas: list[dict[str, Any]]) -> bool:
    """Whether the chat template shows the tools (SmolLM2's ignores them)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    messages = chat_messages("?")
    plain = tokenizer.apply_chat_template(messages, tokenize=False)
    return tokenizer.apply_chat_template(messages, tokenize=False, tools=schemas) != plain

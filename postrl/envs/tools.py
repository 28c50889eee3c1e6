"""Plain Python functions as tools: their schema, the prompt that offers them, the calls a
model writes, and running those calls without ever crashing the run.

A tool is a function with type hints and a Google-style docstring (``Args:``), the convention
of TRL and transformers, whose ``get_json_schema`` builds the JSON schema from them. The
model calls a tool by writing, anywhere in its turn::

    <tool_call>{"name": "calculate", "arguments": {"expression": "37 * 48"}}</tool_call>

(the Hermes format that Qwen's and many other chat templates use). Each call's result, or its
error, goes back to the model as one ``<tool_response>`` block in a ``tool`` turn. A chat
template that renders ``tools`` offers them itself; one that ignores them (SmolLM2's) gets
the schemas and the call format in the system message (:func:`tools_system_text`).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from postrl.envs.base import Step

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
RESULT_CHARS = 2000  # a tool's result is cut to this many characters


def tool_schema(function: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of ``function`` from its type hints and docstring; ValueError naming
    the function when they do not describe it."""
    from transformers.utils import get_json_schema  # transformers: only where tools are used

    try:
        return get_json_schema(function)
    except Exception as error:  # transformers raises its own DocstringParsingException
        name = getattr(function, "__name__", repr(function))
        raise ValueError(f"tool {name}: {error} (a tool needs type hints and a docstring "
                         "with an Args: section)") from error


def tools_system_text(schemas: Sequence[dict[str, Any]]) -> str:
    """How a template that ignores ``tools`` is told about them: the schemas and the call
    format, for the system message."""
    listed = "\n".join(json.dumps(schema["function"]) for schema in schemas)
    return ("You can call these tools:\n" + listed + "\nTo call one, write "
            '<tool_call>{"name": <tool name>, "arguments": <arguments object>}</tool_call> '
            "and wait for its result. When you know the answer, reply without a tool call.")


def call_text(name: str, arguments: dict[str, Any]) -> str:
    """A tool call as the model is asked to write it (what :func:`parse_tool_calls` reads)."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def response_text(name: str, text: str, ok: bool = True) -> str:
    """One call's result (or, when not ``ok``, its error) as the model reads it back."""
    return ("<tool_response>" + json.dumps({"name": name, "result" if ok else "error": text})
            + "</tool_response>")


@dataclass(frozen=True)
class ToolCall:
    """One call as the model wrote it; ``error`` when it could not be read."""

    name: str = ""
    arguments: dict[str, Any] | None = None
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>`` block of ``text``, in order; malformed ones as errors."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            value = json.loads(body)
        except json.JSONDecodeError as error:
            calls.append(ToolCall(error=f"the tool call is not JSON: {error.msg}"))
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            calls.append(ToolCall(error='a tool call needs {"name": ..., "arguments": {...}}'))
            continue
        arguments = value.get("arguments", {})
        if not isinstance(arguments, dict):
            calls.append(ToolCall(value["name"], error="the arguments must be an object"))
            continue
        calls.append(ToolCall(value["name"], arguments))
    return calls


def run_call(tools: dict[str, Callable[..., Any]], call: ToolCall,
             timeout_s: float) -> tuple[str, bool]:
    """``(result text, ok)``: the tool's result, or the reason it has none (unknown tool,
    wrong arguments, an exception, too slow). A call that times out is abandoned: Python
    cannot stop a thread, so it may finish in the background, unseen."""
    if call.error is not None:
        return call.error, False
    if call.name not in tools:
        return f"unknown tool {call.name!r}; the tools are {sorted(tools)}", False
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = tools[call.name](**call.arguments)
        except Exception as error:  # a failing tool is an observation, never a crash
            outcome["error"] = f"{type(error).__name__}: {error}"

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return f"the tool {call.name} took longer than {timeout_s:g} s", False
    if "error" in outcome:
        return outcome["error"], False
    return str(outcome.get("value"))[:RESULT_CHARS], True


@dataclass
class ToolEnvironment:
    """An episode in which the model may call ``tools`` before answering: a turn with tool
    calls gets their results back (a ``tool`` turn); the first turn without one ends the
    episode, and ``finish(final_turn_text)`` is its reward."""

    tools: dict[str, Callable[..., Any]]
    finish: Callable[[str], float]
    timeout_s: float = 5.0

    def step(self, response: str) -> Step:
        calls = parse_tool_calls(response)
        if not calls:
            return Step(reward=float(self.finish(response)), done=True)
        results = [run_call(self.tools, call, self.timeout_s) for call in calls]
        observation = "\n".join(response_text(call.name, text, ok)
                                for call, (text, ok) in zip(calls, results, strict=True))
        return Step(observation, role="tool", tool_calls=len(calls),
                    tool_errors=sum(not ok for _, ok in results))

"""Tasks: where prompts and their gold columns come from (``load_task``), and prompt building."""

from postrl.tasks.arithmetic import ArithmeticTask
from postrl.tasks.base import Example, Task
from postrl.tasks.chat import build_prompt, chat_messages, task_prompt
from postrl.tasks.countdown import CountdownTask
from postrl.tasks.files import (
    FileTask,
    load_gsm8k,
    load_saved_dataset,
    load_table,
    parse_gsm8k_answer,
)
from postrl.tasks.reasoning_gym import ReasoningGymTask
from postrl.tasks.registry import TASK_FORMS, load_task, task_options

__all__ = [
    "TASK_FORMS",
    "ArithmeticTask",
    "CountdownTask",
    "Example",
    "ReasoningGymTask",
    "FileTask",
    "Task",
    "build_prompt",
    "chat_messages",
    "load_gsm8k",
    "load_saved_dataset",
    "load_table",
    "load_task",
    "parse_gsm8k_answer",
    "task_options",
    "task_prompt",
]

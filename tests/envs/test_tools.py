"""Tools: schemas from plain functions, the calls a model writes, and calls that fail as
observations, never as crashes."""

import json
import time

import pytest

from postrl.envs.tools import (
    ToolCall,
    parse_tool_calls,
    run_call,
    tool_schema,
)
from postrl.errors import ConfigError
from postrl.models import load_tokenizer
from postrl.tasks import Example, build_prompt, load_task, task_prompt
from postrl.tasks.calculator import calculate, final_integer


def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return "done"


def undocumented(x: int) -> int:
    return x


def call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_a_schema_comes_from_type_hints_and_the_docstring():
    schema = tool_schema(calculate)["function"]
    assert schema["name"] == "calculate"
    assert schema["parameters"]["properties"]["expression"]["type"] == "string"
    assert schema["parameters"]["required"] == ["expression"]
    with pytest.raises(ValueError, match="tool undocumented: .*docstring"):
        tool_schema(undocumented)


def test_calls_are_read_in_order_and_malformed_ones_become_errors():
    text = (f"First {call('calculate', expression='2*3')} then "
            "<tool_call>{not json}</tool_call> <tool_call>[1]</tool_call> "
            '<tool_call>{"name": "calculate", "arguments": "2*3"}</tool_call>')
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("calculate", {"expression": "2*3"})
    assert "not JSON" in calls[1].error and "needs" in calls[2].error
    assert calls[3].error == "the arguments must be an object"
    assert parse_tool_calls("no call here") == []


def test_every_failure_is_an_observation():
    tools = {"calculate": calculate, "slow": slow}
    assert run_call(tools, ToolCall("calculate", {"expression": "(12 + 3) * 4"}), 1) == ("60", True)
    cases = [(ToolCall("nope", {}), "unknown tool 'nope'"),
             (ToolCall("calculate", {"expr": "1"}), "TypeError"),
             (ToolCall("calculate", {"expression": "1/0"}), "ZeroDivisionError"),
             (ToolCall("calculate", {"expression": "__import__('os')"}), "only numbers"),
             (ToolCall("slow", {"seconds": 2.0}), "took longer than 0.1 s")]
    for tool_call, message in cases:
        text, ok = run_call(tools, tool_call, 0.1)
        assert not ok and message in text


def test_a_tool_episode_answers_calls_then_scores_the_answer():
    task = load_task("calculator", num_problems=20)
    example = task.train()[0]
    answer = int(example.columns["answer"])
    expression = example.question.split("What is ")[1].split("?")[0]
    env = task.environment(example)
    step = env.step(call("calculate", expression=expression) + call("calculate", expression="1/0"))
    assert not step.done and step.role == "tool"
    assert (step.tool_calls, step.tool_errors) == (2, 1)
    results = [json.loads(block.split("</tool_response>")[0])
               for block in step.observation.split("<tool_response>")[1:]]
    assert results[0] == {"name": "calculate", "result": str(answer)}
    assert "ZeroDivisionError" in results[1]["error"]
    final = env.step(f"It is {answer}.")
    assert final.done and final.reward == 1.0
    assert task.environment(example).step(f"It is {answer + 1}.").reward == 0.0
    assert final_integer("1,234 or 5") == 5 and final_integer("none") is None


def test_tools_are_offered_by_the_template_or_else_in_the_system_message():
    tokenizer = load_tokenizer("smollm2-135m-instruct")  # its template ignores tools
    prompt = build_prompt(tokenizer, "What is 2 + 2?", "Be brief.", tools=(calculate,))
    system = prompt.split("<|im_end|>")[0]
    assert "Be brief." in system and '"name": "calculate"' in system and "<tool_call>" in system
    assert "You are a helpful AI assistant" not in prompt
    rendering = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') }}"
                 "\n{% endif %}assistant: ")
    tokenizer.chat_template = rendering
    prompt = build_prompt(tokenizer, "What is 2 + 2?", None, tools=(calculate,))
    assert prompt == "user: What is 2 + 2?\nTOOLS calculate\nassistant: "


def test_a_recipe_trains_on_the_calculator_task_with_the_tool_in_its_prompts(tmp_path):
    from postrl.train.trainer import Trainer
    from tests.train.test_trainer import read_metrics, tiny_config

    cfg = tiny_config(tmp_path, "dr_grpo", "task=calculator", "stop=[e]", "max_turns=2",
                      "max_new_tokens=16", "steps=1", "rewards=[environment]")
    trainer = Trainer(cfg)
    trainer.train()
    [row] = read_metrics(tmp_path / "dr_grpo")
    assert row["episode/turns_mean"] >= 1 and row["episode/tool_calls"] >= 0
    prompts = [trainer.tokenizer.decode(ids) for ids in trainer.prompt_ids.cache.values()]
    assert prompts and all('"name": "calculate"' in p for p in prompts)
    assert all(p.count("<tool_call>") == 3 and p.count("<tool_response>") == 2 for p in prompts)


def test_calculator_demonstrations_are_worked_episodes_in_the_episode_formats():
    task = load_task("calculator", num_problems=50)
    messages = task.demonstrations
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"] * 2
    for question, called, result, answer in zip(*[iter(messages)] * 4, strict=True):
        env = task.environment(Example("demo", question["content"], {"answer": answer["content"]}))
        [parsed] = parse_tool_calls(called["content"])  # the model's call, as the task reads it
        assert parsed.name == "calculate" and parsed.arguments["expression"] in question["content"]
        step = env.step(called["content"])
        assert step.observation == result["content"]  # what the tool really answers
        assert env.step(answer["content"]).reward == 1.0
    asked = {e.question for e in (*task.train(), *task.test())}
    assert not asked & {m["content"] for m in messages if m["role"] == "user"}
    assert load_task("calculator", num_problems=50, demonstrations=0).demonstrations == ()
    with pytest.raises(ConfigError, match="demonstrations must be at most 2, got 3"):
        load_task("calculator", demonstrations=3)


def test_task_prompt_shows_the_demonstrations_before_the_question():
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    task = load_task("calculator", num_problems=50)
    question = task.test()[0].question
    prompt = task_prompt(tokenizer, task, question, "Be brief.")
    assert prompt == build_prompt(tokenizer, question, "Be brief.", (calculate,),
                                  task.demonstrations)
    worked = [m["content"] for m in task.demonstrations]
    positions = [prompt.index(text) for text in [*worked, question]]
    assert positions == sorted(positions) and prompt.index("Be brief.") < positions[0]
    assert "<|im_start|>tool\n" + worked[2] in prompt
    assert prompt.endswith(question + "<|im_end|>\n<|im_start|>assistant\n")

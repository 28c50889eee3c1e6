"""bench/ab.py: the helpers the A/B scripts share."""

from postrl.tasks import task_prompt
from tests.bench_scripts import load_bench_script


def test_first_prompt_ids_are_the_prompts_a_training_step_builds(tmp_path):
    from postrl.train.trainer import Trainer
    from tests.train.test_trainer import tiny_config

    trainer = Trainer(tiny_config(tmp_path / "first", "grpo", "task=calculator", "steps=1"))
    expected = [trainer.tokenizer(task_prompt(trainer.tokenizer, trainer.task, e.question),
                                  add_special_tokens=False).input_ids
                for e in trainer.sampler.take(2)]
    trainer = Trainer(tiny_config(tmp_path / "second", "grpo", "task=calculator", "steps=1"))
    assert load_bench_script("ab").first_prompt_ids(trainer, 2) == expected


def test_bench_scripts_time_the_trainer_through_its_phases_only():
    """The A/B scripts swap and time a step's phases through ``trainer.phases``
    (``postrl/train/phases.py``), never by replacing or calling the trainer's private
    methods: those may change without notice. (``vs_trl.py``'s TRL trainer is TRL's.)"""
    import ast

    from tests.bench_scripts import BENCH

    private = []
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "trainer" and node.attr.startswith("_")
                    and node.attr != "_generate_and_score_completions"):
                private.append(f"{path.name}:{node.lineno} trainer.{node.attr}")
    assert private == []

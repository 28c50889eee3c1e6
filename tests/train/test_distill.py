"""On-policy distillation on the tiny model: the reverse-KL term's maths, the teacher scoring
the student's own tokens after its own prompt, and a run that moves the student towards a
teacher on held-out prompts."""

import json
import math

import pytest
import torch

from postrl.config import load_config
from postrl.errors import ConfigError
from postrl.models.loading import load_policy
from postrl.models.logprobs import response_logprobs
from postrl.objectives.distill import distill_advantages, distill_metrics, reverse_kl_tokens
from postrl.recipes import get_recipe
from postrl.telemetry.names import is_declared
from postrl.train.batch import compute_advantages
from postrl.train.trainer import Trainer


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """The tiny student's own initial weights with its tied embeddings scaled by 8: a
    sharper version of the student (about 1 nat of reverse KL per token), whose preferences
    the student can reach in a few steps."""
    path = tmp_path_factory.mktemp("teacher")
    model, tokenizer = load_policy("tiny", seed=0)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(8.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def config(tmp_path, *extra):
    return load_config(None, [
        "device=cpu", "recipe=grpo", "recipe_options.kl_coef=0", "model=tiny",
        "task=arithmetic", "steps=2", "prompts_per_step=2", "group_size=4",
        "max_new_tokens=12", f"out={tmp_path / 'run'}", "lr=1e-3", "quiet=true", *extra])


def test_reverse_kl_is_the_log_ratio_on_the_mask_and_the_advantage_its_negative():
    student = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
    teacher = torch.tensor([[-2.0, -1.0, -9.0], [-0.1, -1.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    d = reverse_kl_tokens(student, teacher, mask)
    assert d.tolist() == [[1.0, -1.0, 0.0], [0.0, -2.0, 0.0]]
    assert distill_advantages(d, 0.5).tolist() == [[-0.5, 0.5, 0.0], [0.0, 1.0, 0.0]]
    metrics = distill_metrics(d, teacher, mask)
    assert metrics["distill/reverse_kl"] == pytest.approx(-0.5)
    k3 = [math.expm1(-x) + x for x in (1.0, -1.0, 0.0, -2.0)]
    assert metrics["distill/reverse_kl_k3"] == pytest.approx(sum(k3) / 4)
    assert metrics["distill/teacher_ppl"] == pytest.approx(math.exp((2.0 + 1.0 + 0.1 + 1.0) / 4))
    assert all(is_declared(name) for name in metrics)
    assert distill_metrics(d, teacher, torch.zeros_like(mask)) == {}


def test_the_advantage_gets_the_teachers_term_on_the_students_tokens(tmp_path, teacher_dir):
    trainer = Trainer(config(tmp_path, "recipe_options.distill_coef=0.5",
                             f"teacher.model={teacher_dir}", "steps=1"))
    prepare, seen = trainer.phases.prepare, []

    def keep(batch):
        prepare(batch)
        seen.append(batch)

    trainer.phases.prepare = keep
    metrics = trainer.train()
    batch = seen[0]
    teacher, _ = load_policy(str(teacher_dir))
    rows = torch.arange(batch.rows)
    theirs = response_logprobs(teacher, batch.sequences(rows, trainer.engine.pad_id),
                               trainer.cfg.temperature)[0]
    assert batch.teacher_prompt_ids == batch.prompt_ids  # no prompt of its own: the student's
    torch.testing.assert_close(batch.teacher_logp, theirs, rtol=1e-5, atol=1e-5)
    mask = batch.response_mask
    assert torch.all(batch.reverse_kl[~mask] == 0)
    without, _ = compute_advantages(trainer.recipe, batch, 0.0, None)
    torch.testing.assert_close(batch.advantages, without - 0.5 * batch.reverse_kl)
    assert metrics["distill/reverse_kl"] == pytest.approx(float(batch.reverse_kl[mask].mean()))
    assert metrics["distill/reverse_kl"] > 0.5  # the sharpened teacher is far from the student


def test_distillation_lowers_the_held_out_reverse_kl(tmp_path, teacher_dir):
    # The random student never answers correctly: every group's rewards are equal, so the
    # teacher's term is the whole signal.
    trainer = Trainer(config(tmp_path, "recipe_options.distill_coef=1.0",
                             f"teacher.model={teacher_dir}", "steps=16", "prompts_per_step=4",
                             "eval_every=1000", "eval_n=16", "eval_samples=0"))
    trainer.train()
    records = [json.loads(line) for line in trainer.run.metrics_path.read_text().splitlines()]
    before, after = records[0]["eval/distill_reverse_kl"], records[-1]["eval/distill_reverse_kl"]
    assert records[0]["step"] == 0 and records[-1]["step"] == 16
    assert after < 0.9 * before, (before, after)  # measured: 0.97 -> 0.79
    assert all("distill/reverse_kl" in r for r in records[1:])
    assert all(is_declared(name) for r in records for name in r)


def test_context_distillation_reads_the_teachers_own_prompt(tmp_path):
    trainer = Trainer(config(tmp_path, "recipe_options.distill_coef=1.0", "teacher.model=self",
                             "teacher.system_prompt=Think about digits.", "steps=1"))
    seen = []
    prepare = trainer.phases.prepare
    trainer.phases.prepare = lambda batch: (prepare(batch), seen.append(batch))
    trainer.train()
    batch = seen[0]
    text = trainer.tokenizer.decode(batch.teacher_prompt_ids[0])
    assert "Think about digits." in text
    assert "Think about digits." not in trainer.tokenizer.decode(batch.prompt_ids[0])
    # the same initial weights, another prompt: the teacher's log-probs differ from the
    # student's first ones, which a KL penalty to the reference would not
    assert float(batch.reverse_kl.abs().max()) > 1e-4


def test_the_teacher_scores_only_the_models_tokens_of_an_episode(tmp_path, teacher_dir):
    trainer = Trainer(config(tmp_path, "task=guess_number", "recipe_options.distill_coef=1.0",
                             f"teacher.model={teacher_dir}", "steps=1", "max_turns=3",
                             "stop=[e]", "max_new_tokens=24"))  # turns end at an "e"
    seen = []
    prepare = trainer.phases.prepare
    trainer.phases.prepare = lambda batch: (prepare(batch), seen.append(batch))
    trainer.train()
    batch = seen[0]
    assert batch.env_mask is not None and batch.env_mask.any()
    assert torch.all(batch.reverse_kl[batch.env_mask] == 0)
    assert torch.all(batch.advantages[batch.env_mask] == 0)
    assert batch.reverse_kl[batch.response_mask].abs().sum() > 0


@pytest.mark.parametrize(("options", "named"), [
    (["recipe_options.distill_coef=1.0"], "teacher.model"),
    (["teacher.model=self", "teacher.system_prompt=x"], "recipe_options.distill_coef"),
    (["teacher.system_prompt=x"], "teacher.model"),
    (["recipe_options.distill_coef=1.0", "teacher.model=self"], "teacher.model"),
    (["recipe_options.distill_coef=-1.0", "teacher.model=self", "teacher.system_prompt=x"],
     "distill_coef must be >= 0"),
])
def test_half_a_distillation_setup_is_refused_by_name(tmp_path, options, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        config(tmp_path, *options)


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path, teacher_dir):
    other = tmp_path / "other"
    model, tokenizer = load_policy(str(teacher_dir))
    tokenizer.add_tokens(["<not-in-the-student>"])
    model.save_pretrained(other)
    tokenizer.save_pretrained(other)
    with pytest.raises(ConfigError, match="another tokenizer than the student"):
        Trainer(config(tmp_path, "recipe_options.distill_coef=1.0", f"teacher.model={other}"))


def test_explain_names_the_distillation_component():
    from postrl.components import differing

    plain = get_recipe("grpo")
    taught = plain.with_(distill_coef=0.5)
    assert [c.title for c in differing(plain, taught)] == ["distillation"]
    with pytest.raises(ConfigError, match="geometric"):
        get_recipe("grpo").with_(ratio="geometric", distill_coef=1.0)

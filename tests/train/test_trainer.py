"""The trainer end to end on the tiny model: every recipe, dynamic sampling, PPO's critic."""

import json
from pathlib import Path

import pytest
import torch

from postrl.config import load_config
from postrl.recipes import PRESETS
from postrl.telemetry.names import is_declared
from postrl.train.trainer import Trainer

REWARDS = str(Path(__file__).with_name("rewards_for_tests.py"))

ALWAYS = {
    "step", "rollout/tokens_generated", "rollout/tokens_wasted", "rollout/responses",
    "reward/mean", "accuracy/mean", "batch/zero_variance_frac", "batch/groups_kept",
    "length/mean", "length/correct_mean", "length/incorrect_mean", "length/truncated_frac",
    "loss/total", "loss/policy", "loss/per_token", "loss/per_response", "entropy/mean",
    "clip/low_frac", "clip/high_frac", "ratio/mean", "ratio/max", "ratio/seq_std", "grad/norm",
    "lr", "time/generate_s", "time/score_s", "time/train_s", "throughput/tokens_per_s",
}


def tiny_config(tmp_path, recipe: str, *extra: str):
    return load_config(None, [
        # the CPU even where a GPU is (device=auto would pick it); extra options may override
        "device=cpu", f"recipe={recipe}", "model=tiny", "task=arithmetic", "steps=3",
        "prompts_per_step=2", "group_size=4", "max_new_tokens=12", f"out={tmp_path / recipe}",
        "lr=1e-3", "quiet=true",
        f"rewards=[{REWARDS}:length_parity]", "micro_batch_size=3", *extra,
    ])


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def held_gradients(trainer: Trainer) -> list[str]:
    """Parameters that still hold a gradient (none should between steps: sampling runs
    without them)."""
    optimized = [p for optimizer in (trainer.optimizer, trainer.critic_optimizer) if optimizer
                 for group in optimizer.param_groups for p in group["params"]]
    named = {id(p): n for model in (trainer.lm, trainer.critic) if model is not None
             for n, p in model.named_parameters()}
    return [named.get(id(p), "an optimizer's parameter") for p in
            [*optimized, *(p for m in (trainer.lm, trainer.critic) if m for p in m.parameters())]
            if p.grad is not None]


@pytest.mark.parametrize("recipe", sorted(PRESETS))
def test_every_recipe_trains_three_steps(tmp_path, recipe):
    extra = ["recipe_options.overlong_buffer=4"] if PRESETS[recipe].overlong_penalty else []
    if PRESETS[recipe].dynamic_sampling:  # the random model is never partly correct
        extra.append("recipe_options.dynamic_sampling_by=reward")
    trainer = Trainer(tiny_config(tmp_path, recipe, *extra))
    # skip work the recipe does not need: no reference model without a KL term
    assert (trainer.reference is None) == (not PRESETS[recipe].needs_reference)
    assert (trainer.critic is None) == (not PRESETS[recipe].critic)
    before = [p.detach().clone() for p in trainer.lm.parameters()]
    trainer.train()
    rows = read_metrics(tmp_path / recipe)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        missing = ALWAYS - row.keys()
        assert not missing, missing
        assert all(is_declared(k) for k in row)
        assert all(v is None or v == v for k, v in row.items() if k.startswith("loss/"))
        if PRESETS[recipe].needs_reference:
            assert "kl/mean" in row
        if PRESETS[recipe].critic:
            assert "loss/value" in row
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.lm.parameters(),
                                                               strict=True))
    assert not held_gradients(trainer)
    samples = [json.loads(x) for x in (tmp_path / recipe / "samples.jsonl").read_text().split("\n")
               if x]
    assert samples and {"prompt", "completion", "reward", "correct"} <= samples[0].keys()
    assert (tmp_path / recipe / "final" / "config.json").is_file()
    assert (tmp_path / recipe / "config.yaml").is_file()


def test_tokens_generated_is_the_sum_of_response_lengths(tmp_path, monkeypatch):
    trainer = Trainer(tiny_config(tmp_path, "grpo"))
    lengths = []
    generate = trainer.engine.generate

    def counting(*args, **kwargs):
        rollouts = generate(*args, **kwargs)
        lengths.append(int(rollouts.lengths.sum()))
        return rollouts

    monkeypatch.setattr(trainer.engine, "generate", counting)
    trainer.train()
    rows = read_metrics(tmp_path / "grpo")
    assert [r["rollout/tokens_generated"] for r in rows] == [sum(lengths[: i + 1])
                                                             for i in range(3)]


def test_dynamic_sampling_keeps_no_zero_variance_group_and_counts_waste(tmp_path):
    cfg = tiny_config(tmp_path, "dapo", f"rewards=[{REWARDS}:parity_on_odd_answers]",
                      "recipe_options.overlong_penalty=false",
                      "recipe_options.dynamic_sampling_by=reward",
                      "recipe_options.max_sampling_rounds=4", "steps=2")
    trainer = Trainer(cfg)
    kept_groups = []
    original = trainer.phases.update

    def spy(batch):
        grouped = batch.rewards.view(-1, batch.group_size)
        kept_groups.append(grouped.clone())
        return original(batch)

    trainer.phases.update = spy
    trainer.train()
    assert kept_groups
    for grouped in kept_groups:
        assert (grouped.max(dim=1).values > grouped.min(dim=1).values).all()
    rows = read_metrics(tmp_path / "dapo")
    assert any(r["batch/zero_variance_frac"] > 0 for r in rows)
    assert rows[-1]["rollout/tokens_wasted"] > 0
    assert rows[-1]["rollout/tokens_wasted"] < rows[-1]["rollout/tokens_generated"]


def test_a_step_calls_the_phases_the_trainer_holds(tmp_path):
    """``trainer.phases`` is the public seam for measuring (``postrl/train/phases.py``):
    replacements that call the originals run once a step each, prepare before update, and
    the step logs what the update returned."""
    trainer = Trainer(tiny_config(tmp_path, "grpo", "steps=2"))
    calls = []
    prepare, update = trainer.phases.prepare, trainer.phases.update

    def prepared(batch):
        calls.append("prepare")
        prepare(batch)

    def updated(batch):
        calls.append("update")
        return {**update(batch), "loss/total": 123.0}

    trainer.phases.prepare, trainer.phases.update = prepared, updated
    trainer.train()
    assert calls == ["prepare", "update"] * 2
    assert [r["loss/total"] for r in read_metrics(tmp_path / "grpo")] == [123.0, 123.0]


def test_ppo_critic_value_loss_falls_on_a_fixed_batch(tmp_path):
    # value clipping around fixed old values would put a floor under the loss: train the
    # critic on the plain squared error
    trainer = Trainer(tiny_config(tmp_path, "ppo", "critic_lr=3e-3",
                                  "recipe_options.value_clip=null"))
    from postrl.train.batch import assemble

    batch = assemble(trainer.draw(0, trainer.engine).collected.groups, overlong_filter=False)
    trainer.phases.prepare(batch)
    trainer.cfg.critic_warmup_steps = 100  # critic only: the batch stays fixed
    losses = [trainer.phases.update(batch)["loss/value"] for _ in range(15)]
    assert losses[-1] < 0.3 * losses[0]


def test_lora_trains_only_adapters_against_the_base_as_reference(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "grpo", "lora.r=4", "lora.target_modules=[q_proj]",
                                  "steps=2"))
    assert trainer.reference is not None and trainer.reference.frozen is None
    frozen = {n: p.detach().clone() for n, p in trainer.lm.named_parameters()
              if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in trainer.lm.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    trainer.train()
    params = dict(trainer.lm.named_parameters())
    assert all(torch.equal(params[n], v) for n, v in frozen.items())
    assert any(not torch.equal(params[n], v) for n, v in adapters.items())
    assert read_metrics(tmp_path / "grpo")[-1]["kl/mean"] > 0
    assert (tmp_path / "grpo" / "final" / "config.json").is_file()


@pytest.mark.parametrize("recipe, extra", [
    ("ppo", ()),  # reference and critic keep float32 weights (autocast)
    ("gspo", ("epochs=2", "minibatches=2")),  # old log-probs from the working copy
    ("grpo", ("lora.r=4", "lora.target_modules=[q_proj]")),  # only the adapters have masters
])
def test_bf16_master_trains_float32_masters_through_a_bf16_working_copy(tmp_path, recipe, extra):
    trainer = Trainer(tiny_config(tmp_path, recipe, "precision=bf16-master", "steps=2", *extra))
    working = trainer.master.working
    assert trainer.scoring_lm is working
    before = [p.detach().clone() for p in trainer.lm.parameters()]
    trainer.train()
    rows = read_metrics(tmp_path / recipe)
    assert all(r["loss/total"] == r["loss/total"] and r["grad/norm"] > 0 for r in rows)
    changed = [not torch.equal(a, p) for a, p in zip(before, trainer.lm.parameters(),
                                                     strict=True)]
    assert any(changed)
    for master, copy in zip(trainer.lm.parameters(), working.parameters(), strict=True):
        assert master.dtype == torch.float32 and copy.dtype == torch.bfloat16
        assert torch.equal(copy, master.detach().bfloat16())  # refreshed after every step
    assert not held_gradients(trainer) and all(p.grad is None for p in working.parameters())
    if recipe == "ppo":
        assert all("kl/mean" in r and "loss/value" in r for r in rows)
        assert all(p.dtype == torch.float32 for p in trainer.critic.parameters())


def test_bf16_autocast_trains_the_float32_weights(tmp_path):
    """``precision=bf16``: float32 weights, bf16 matmuls under autocast, the tied LM head's
    chunk gradients added into the float32 weight's gradient (a bf16 gradient there once
    stopped the update)."""
    trainer = Trainer(tiny_config(tmp_path, "grpo", "precision=bf16", "steps=2"))
    head = trainer.lm.lm_head.weight
    before = head.detach().clone()
    trainer.train()
    rows = read_metrics(tmp_path / "grpo")
    assert len(rows) == 2
    assert all(r["loss/total"] == r["loss/total"] and r["grad/norm"] > 0 for r in rows)
    assert head.dtype == torch.float32 and not torch.equal(before, head.detach())


def test_several_updates_per_batch_go_off_policy(tmp_path):
    """With 2 epochs x 2 minibatches the old log-probs are computed once, before the first
    update; later updates see ratios != 1, so GSPO's tiny clip range becomes active."""
    trainer = Trainer(tiny_config(tmp_path, "gspo", "epochs=2", "minibatches=2", "steps=2"))
    trainer.train()
    rows = read_metrics(tmp_path / "gspo")
    assert all(r["ratio/seq_std"] > 0 for r in rows)
    assert any(r["clip/low_frac"] + r["clip/high_frac"] > 0 for r in rows)


def test_token_budget_stops_the_run_within_one_step(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "grpo", "steps=100", "token_budget=100"))
    trainer.train()
    rows = read_metrics(tmp_path / "grpo")
    per_step = [b["rollout/tokens_generated"] - a["rollout/tokens_generated"]
                for a, b in zip([{"rollout/tokens_generated": 0}, *rows], rows, strict=False)]
    assert rows[-1]["rollout/tokens_generated"] >= 100 > rows[-2]["rollout/tokens_generated"]
    assert rows[-1]["rollout/tokens_generated"] - 100 < max(per_step)


def test_periodic_eval_and_saved_rollout_batches(tmp_path):
    from postrl.train.batch import load_rollout_batch

    trainer = Trainer(tiny_config(tmp_path, "grpo", "eval_every=2", "eval_n=3", "steps=5",
                                  "save_rollouts_every=2"))
    trainer.train()
    rows = read_metrics(tmp_path / "grpo")
    # before any update (step 0), every eval_every steps, and at the end of the budget
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert ["eval/accuracy" in r for r in rows] == [True, False, True, False, True, True]
    assert rows[0]["rollout/tokens_generated"] == 0 and "loss/total" not in rows[0]
    for row in (rows[0], rows[2], rows[5]):
        assert 0 <= row["eval/accuracy"] <= 1 and row["time/eval_s"] > 0
        assert 0 <= row["eval/sampled_accuracy"] <= 1 and 0 <= row["eval/truncated_frac"] <= 1
    assert rows[5]["rollout/tokens_generated"] == trainer.state.tokens_generated > 0
    saved = sorted((tmp_path / "grpo" / "rollouts").glob("*.pt"))
    assert [p.name for p in saved] == ["step_2.pt", "step_4.pt"]
    batch, config = load_rollout_batch(saved[0])
    assert config["resolved_recipe"]["name"] == "grpo"
    assert batch.advantages.shape == batch.response_ids.shape == batch.ref_logp.shape
    assert batch.rows == 8


def test_non_finite_guard_skips_a_poisoned_step_and_training_continues(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "grpo", "steps=4"))
    prepare = trainer.phases.prepare

    def poisoned(batch):  # step 2's advantages are NaN
        prepare(batch)
        if trainer.step == 1:
            batch.advantages = batch.advantages + float("nan")

    trainer.phases.prepare = poisoned
    weights = []
    update = trainer.phases.update

    def spy(batch):
        out = update(batch)
        weights.append(trainer.lm.model.embed_tokens.weight.detach().clone())
        return out

    trainer.phases.update = spy
    trainer.train()
    rows = read_metrics(tmp_path / "grpo")
    assert [r["guard/skipped_steps"] for r in rows] == [0, 1, 1, 1]
    assert torch.equal(weights[0], weights[1])  # the poisoned update never happened
    assert not torch.equal(weights[1], weights[2])  # and the next one did
    assert all(torch.isfinite(p).all() for p in trainer.lm.parameters())


def test_repeated_non_finite_steps_abort_with_a_clear_error(tmp_path):
    from postrl.train.trainer import TrainingError

    trainer = Trainer(tiny_config(tmp_path, "grpo", "steps=5", "max_skipped_steps=2"))
    prepare = trainer.phases.prepare

    def always_poisoned(batch):
        prepare(batch)
        batch.advantages = batch.advantages + float("inf")

    trainer.phases.prepare = always_poisoned
    with pytest.raises(TrainingError, match="not finite in 2 steps in a row"):
        trainer.train()


def test_the_update_constants_carry_no_autograd_graph(tmp_path, monkeypatch):
    """Old log-probs, reference log-probs, values, advantages and returns are constants of the
    update: a graph kept on them holds every micro-batch's activations until the step ends."""
    import postrl.train.prepare as prepare_module

    seen = []
    real = prepare_module.compute_advantages

    def recording(recipe, batch, kl_coef, old_logp):
        advantages, returns = real(recipe, batch, kl_coef, old_logp)
        seen.append([old_logp, batch.ref_logp, batch.old_values, advantages, returns])
        return advantages, returns

    monkeypatch.setattr(prepare_module, "compute_advantages", recording)
    Trainer(tiny_config(tmp_path, "ppo", "steps=1", "epochs=2",
                         "recipe_options.kl_coef=0.05")).train()
    (tensors,) = seen
    assert all(t is not None for t in tensors)  # every one was computed
    assert not any(t.requires_grad for t in tensors)

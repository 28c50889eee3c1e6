"""The update reading the sampler's record of its forward (``postrl.accel.recorded``): the
same step as the update that multiplies, in float32 and bf16-master; each step's record freed
by the backend once stale, however long it is held."""

import copy
import dataclasses

import pytest
import torch

from postrl.accel import decoding
from postrl.accel.recorded import parameter_versions
from postrl.train.scorers import TokenScorer
from postrl.train.trainer import Trainer
from postrl.train.update import Trainable, UpdateSettings, round_metrics, run_updates
from tests.accel.test_recorded import count_reads
from tests.train.test_trainer import tiny_config
from tests.train.test_update import _mixed_batch, without_mismatch


@pytest.mark.parametrize("recipe", ["dr_grpo", "grpo", "gspo", "dhpo"])
def test_the_update_reads_the_samplers_forward_and_makes_the_same_step(tmp_path, recipe,
                                                                        monkeypatch):
    """One update per batch: the sampler recorded its forward (``postrl.accel.recorded``)
    and the update reads it instead of multiplying (grpo: with a reference and its KL term).
    The same gradient norm, metrics and weights as the update that multiplies, and a record
    spoiled (logits scaled) changes the step: it was read."""
    monkeypatch.setattr(decoding, "RECORD_MIN_FLOPS_PER_BYTE", 0.0)  # the tiny model too
    trainer = Trainer(tiny_config(tmp_path, recipe, "prompts_per_step=3", "max_new_tokens=16"))
    batch = _mixed_batch(trainer)
    assert batch.kept_rows is not None
    settings = UpdateSettings(epochs=1, minibatches=1, micro_batch_size=5, temperature=1.0,
                              max_grad_norm=None, pad_id=trainer.engine.pad_id)
    lm, weights = trainer.lm.train(), copy.deepcopy(trainer.lm.state_dict())
    outcomes = []
    for record in (None, batch.kept_rows, "spoiled"):
        lm.load_state_dict(weights)
        batch.kept_rows.record.versions = parameter_versions(lm)  # the recorded weights again
        if record == "spoiled":
            record = batch.kept_rows
            record.record.logits.mul_(50.0)
        # fused, as the trainer's AdamW is: it does not bump the weights' version counters
        optimizer = torch.optim.SGD(lm.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1,
                                    fused=True)
        results = run_updates(Trainable(TokenScorer(lm, tied_grads_in_place=True), optimizer),
                              dataclasses.replace(batch, kept_rows=record), trainer.recipe,
                              trainer.loss_cfg, settings, [torch.arange(batch.rows)])
        outcomes.append((round_metrics(results[0]), copy.deepcopy(lm.state_dict())))
        assert not batch.kept_rows.record.fresh(lm)  # the step changed the weights
    (full, full_state), (fast, state), (spoiled, _) = outcomes
    assert full["grad/norm"] > 1e-3 and fast.keys() == full.keys()
    for key, value in full.items():
        assert fast[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for name, value in full_state.items():
        torch.testing.assert_close(state[name], value, atol=1e-6, rtol=1e-5)
    assert spoiled["grad/norm"] != pytest.approx(full["grad/norm"], rel=0.1)
    assert spoiled["entropy/mean"] < 0.5 * full["entropy/mean"]


def test_a_bf16_master_update_reads_the_working_copys_record(tmp_path, monkeypatch):
    """``bf16-master``: the sampler records the bf16 working copy's forward, the update reads
    it (every linear and the LM head) and makes the step of the update that multiplies, to
    bf16 rounding; the step's refresh of the working copy makes the record stale."""
    monkeypatch.setattr(decoding, "RECORD_MIN_FLOPS_PER_BYTE", 0.0)  # the tiny model too
    trainer = Trainer(tiny_config(tmp_path, "dr_grpo", "prompts_per_step=3", "max_new_tokens=16",
                                  "precision=bf16-master"))
    batch = _mixed_batch(trainer)
    record, working = batch.kept_rows.record, trainer.master.working
    assert record.logits.dtype == torch.bfloat16 and record.fresh(working)
    weights = copy.deepcopy(trainer.lm.state_dict())
    reads = count_reads(monkeypatch)
    outcomes, read = [], []
    for rows in (None, batch.kept_rows):
        trainer.lm.load_state_dict(weights)
        trainer.master.refresh()
        trainer.optimizer.state.clear()  # each update is the optimizer's first step
        record.versions = parameter_versions(working)  # the recorded weights again
        reads.clear()
        outcomes.append(trainer.phases.update(dataclasses.replace(batch, kept_rows=rows)))
        read.append(len(reads))
        assert not record.fresh(working)  # the step refreshed the working copy
    # every linear of every layer and the LM head, in each micro-batch
    assert read[0] == 0 and read[1] >= 7 * len(working.model.layers) + 1
    full, fast = outcomes
    assert fast.keys() == full.keys()
    assert full["grad/norm"] > 1e-3
    # measured: the gradient norms 1e-4 apart, the rest equal; mismatch/* differ by design
    # (read from the record, the trainer's log-probs are the sampler's own)
    for key, value in without_mismatch(full).items():
        assert fast[key] == pytest.approx(value, rel=5e-3, abs=1e-6), key


def test_a_steps_record_is_freed_however_long_it_is_held(tmp_path, monkeypatch):
    """Something outside postrl may keep a step's rollouts alive (math_verify's parse cache
    kept tracebacks whose frames held the trainer's batch): each step's record is stale once
    the update has changed the weights, and the next step's recording frees it and records
    into its memory."""
    monkeypatch.setattr(decoding, "RECORD_MIN_FLOPS_PER_BYTE", 0.0)  # the tiny model too
    trainer = Trainer(tiny_config(tmp_path, "dr_grpo", "max_new_tokens=16"))
    held, memory = [], []
    generate = trainer.engine.generate

    def holding(*args, **kwargs):
        held.append(generate(*args, **kwargs))
        memory.append(held[-1].kept_rows.record.logits.data_ptr())
        return held[-1]

    trainer.engine.generate = holding
    for _ in range(3):
        trainer.train_step()
    assert len(held) == 3 and all(r.kept_rows.record.stale() for r in held)
    assert [r.kept_rows.record.model is None for r in held] == [True, True, False]  # freed
    assert len(set(memory)) == 1  # every step recorded into the first step's memory

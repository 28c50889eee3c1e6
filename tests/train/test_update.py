"""How an optimizer step's rows become micro-batches, and that the arrangement (prompt
groups packed, length-sorted padded rows, one micro-batch) changes no update."""

import copy
import dataclasses

import pytest
import torch

from postrl.train.batch import TrainBatch, assemble
from postrl.train.micro_batches import micro_batches
from postrl.train.replicas import Replica, merge_replicas
from postrl.train.row_skipping import zero_gradient_rows
from postrl.train.scorers import TokenScorer
from postrl.train.setup import records_entropies, records_forward
from postrl.train.trainer import Trainer
from postrl.train.update import (
    Trainable,
    UpdateSettings,
    prompt_grouped,
    round_metrics,
    run_updates,
)
from tests.train.test_trainer import tiny_config


def without_mismatch(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics but mismatch/*: means over the rows the update scored, so a path that
    skips rows measures them on fewer (postrl/objectives/policy_loss.py)."""
    return {k: v for k, v in metrics.items() if not k.startswith("mismatch/")}


def test_prompt_grouped_keeps_a_prompts_rows_together_longest_group_first():
    prompts = [[1, 2], [3], [1, 2], [3], [4, 4, 4], [1, 2]]
    lengths = torch.tensor([5, 9, 2, 1, 3, 7])
    batch = TrainBatch(prompts, torch.zeros(6, 9, dtype=torch.long),
                       torch.zeros(6, 9, dtype=torch.bool), torch.zeros(6),
                       torch.zeros(6, dtype=torch.bool), lengths,
                       torch.zeros(6, dtype=torch.bool), group_size=1)
    # totals (prompt + response): 7, 10, 4, 2, 6, 9 -> [3]: 10; [1, 2]: 9; [4, 4, 4]: 6
    assert prompt_grouped(torch.arange(6), batch).tolist() == [1, 3, 5, 0, 2, 4]
    assert prompt_grouped(torch.tensor([4, 2, 0]), batch).tolist() == [0, 2, 4]


def _lengths_batch(prompts, responses, group_size):
    rows, width = len(prompts), max(responses)
    return TrainBatch(prompts, torch.zeros(rows, width, dtype=torch.long),
                      torch.arange(width)[None] < torch.tensor(responses)[:, None],
                      torch.zeros(rows), torch.zeros(rows, dtype=torch.bool),
                      torch.tensor(responses), torch.zeros(rows, dtype=torch.bool),
                      group_size=group_size)


def test_micro_batches_hold_at_most_their_rows_and_tokens():
    # two groups of 3 rows; prompts of 4 and 2 tokens; responses of 5, 3, 1 and 6, 6, 2
    batch = _lengths_batch([[1] * 4] * 3 + [[2] * 2] * 3, [5, 3, 1, 6, 6, 2], group_size=3)
    rows = torch.arange(6)
    as_lists = lambda micros: [m.tolist() for m in micros]  # noqa: E731
    assert as_lists(micro_batches(rows, batch, 4)) == [[0, 1, 2, 3], [4, 5]]  # rows alone
    # shared prompts: [0, 1]: 4 + 5 + 3 = 12; adding row 2 (1 token) fits 13; row 3 starts
    # its prompt (2 + 6): 21 > 13 -> a new micro-batch: [3, 4]: 2 + 6 + 6 = 14 > 13 -> alone
    assert as_lists(micro_batches(rows, batch, 8, 13)) == [[0, 1, 2], [3], [4, 5]]
    # each row's prompt counted: [0]: 9, + row 1 (4 + 3) = 16 > 13; [1, 2]: 7 + 5;
    # [3]: 8, + row 4 (8) = 16 > 13; [4, 5]: 8 + 4
    assert as_lists(micro_batches(rows, batch, 8, 13, share_prompts=False)) == [
        [0], [1, 2], [3], [4, 5]]
    # a row over the budget runs alone; the order of the rows is kept
    assert as_lists(micro_batches(torch.tensor([4, 0, 5]), batch, 8, 3)) == [[4], [0], [5]]
    assert micro_batches(rows[:0], batch, 8, 13) == []
    # a budget that holds everything: micro_batch_size decides
    assert as_lists(micro_batches(rows, batch, 4, 10_000)) == [[0, 1, 2, 3], [4, 5]]


def test_packed_prompt_groups_give_the_update_of_padded_rows_and_of_one_micro_batch(tmp_path):
    """grpo on the tiny model, 3 prompts x 4 samples of different lengths: 2-row and 5-row
    micro-batches of packed prompt groups, length-sorted padded rows without shared prompts
    (as under FSDP2), the whole batch at once and micro-batches cut by a token budget make
    the same optimizer step."""
    trainer = Trainer(tiny_config(tmp_path, "grpo", "prompts_per_step=3", "max_new_tokens=16"))
    batch = assemble(trainer.draw(0, trainer.engine).collected.groups, overlong_filter=False)
    # the random tiny model never stops: cut its responses to lengths 0..16 (packing needs
    # short ones), one fully masked
    batch.lengths = torch.tensor([16, 3, 9, 1, 12, 16, 5, 7, 2, 14, 16, 10])
    batch.response_mask = torch.arange(16)[None] < batch.lengths[:, None]
    batch.response_mask[3] = False
    trainer.phases.prepare(batch)
    settings = UpdateSettings(epochs=1, minibatches=1, micro_batch_size=2, temperature=1.0,
                              max_grad_norm=None, pad_id=trainer.engine.pad_id)
    plan = [torch.arange(batch.rows)]
    after = []
    # the last: a budget of a prompt and 20 response tokens: micro-batches of one to three
    # rows, whatever micro_batch_size says
    budget = max(len(p) for p in batch.prompt_ids) + 20
    cut = micro_batches(prompt_grouped(torch.arange(batch.rows), batch), batch, batch.rows,
                        budget)
    assert 3 < len(cut) < batch.rows
    for micro, share, tokens in ((2, True, 0), (5, True, 0), (2, False, 0),
                                 (batch.rows, True, 0), (batch.rows, True, budget)):
        lm = copy.deepcopy(trainer.lm).train()
        optimizer = torch.optim.SGD(lm.parameters(), lr=1.0)  # the step is the gradient
        scorer = TokenScorer(lm, share, tied_grads_in_place=share)
        results = run_updates(Trainable(scorer, optimizer),
                    batch, trainer.recipe, trainer.loss_cfg,
                    dataclasses.replace(settings, micro_batch_size=micro, share_prompts=share,
                                        micro_batch_tokens=tokens),
                    plan)
        after.append((results[0].grad_norm, lm.state_dict()))
    assert after[0][0] > 1e-3  # a real gradient
    for norm, state in after[1:]:
        assert norm == pytest.approx(after[0][0], rel=1e-5)
        for name, value in after[0][1].items():
            torch.testing.assert_close(state[name], value, atol=1e-6, rtol=1e-5, msg=name)


def _mixed_batch(trainer):
    """3 prompts x 4 samples of different lengths; the middle group's rewards all equal (no
    gradient), one row of the first group with no token left (as after overlong filtering)."""
    batch = assemble(trainer.draw(0, trainer.engine).collected.groups, overlong_filter=False)
    batch.lengths = torch.tensor([16, 3, 9, 1, 12, 16, 5, 7, 2, 14, 16, 10])
    batch.response_mask = torch.arange(16)[None] < batch.lengths[:, None]
    batch.response_mask[3] = False
    batch.rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.0, 1.0, 1.0, 0.0])
    trainer.phases.prepare(batch)
    return batch


def _zero_rows(batch, trainer):
    return zero_gradient_rows(torch.arange(batch.rows), batch, trainer.loss_cfg, False)


@pytest.mark.parametrize("recipe", ["dr_grpo", "gspo", "dhpo", "cispo"])
def test_rows_without_a_gradient_run_forward_only_and_change_no_step_or_metric(tmp_path,
                                                                              recipe):
    """Two epochs (the second with ratios away from 1): the forward-only rows give the same
    gradient norms, diagnostics and weights as a backward through every row; a third step
    over the zero-variance group alone still steps the optimizer's momentum."""
    trainer = Trainer(tiny_config(tmp_path, recipe, "prompts_per_step=3", "max_new_tokens=16",
                                  "epochs=2"))
    batch = _mixed_batch(trainer)
    rows = torch.arange(batch.rows)
    zero = _zero_rows(batch, trainer)
    assert zero.tolist() == [False, False, False, True] + [True] * 4 + [False] * 4
    settings = UpdateSettings(epochs=2, minibatches=1, micro_batch_size=3, temperature=1.0,
                              max_grad_norm=None, pad_id=trainer.engine.pad_id)
    plan = [rows, rows, rows[4:8]]
    outcomes = []
    for forward_only in (False, True):
        lm = copy.deepcopy(trainer.lm).train()
        grad_modes = []
        lm.get_input_embeddings().register_forward_hook(
            lambda *_, modes=grad_modes: modes.append(torch.is_grad_enabled()))
        # SGD with momentum: linear in the gradients (Adam would magnify float32 roundoff
        # in near-zero gradient entries), and a zero gradient still steps the momentum
        optimizer = torch.optim.SGD(lm.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
        results = run_updates(
            Trainable(TokenScorer(lm, tied_grads_in_place=True), optimizer), batch,
            trainer.recipe, trainer.loss_cfg,
            dataclasses.replace(settings, forward_only_zero_gradient=forward_only), plan)
        outcomes.append(([round_metrics(r) for r in results], lm.state_dict(), grad_modes))
    (full_metrics, full_state, full_modes), (metrics, state, modes) = outcomes
    assert all(full_modes) and not all(modes)  # forward-only rows ran under no_grad
    assert full_metrics[0]["grad/norm"] > 1e-3
    assert full_metrics[2]["grad/norm"] == 0.0
    for full, fast in zip(full_metrics, metrics, strict=True):
        assert fast.keys() == full.keys()
        for key, value in full.items():
            assert fast[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    for name, value in full_state.items():
        torch.testing.assert_close(state[name], value, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("recipe", ["dr_grpo", "gspo", "dhpo", "cispo", "gmpo"])
def test_with_one_update_per_batch_rows_without_a_gradient_run_not_at_all(tmp_path, recipe):
    """One update per batch: every ratio is exactly 1, so what a forward of a row without a
    gradient would add to the diagnostics is known but for its entropy, which the sampler
    recorded. Such rows then run no forward, and the step, weights and metrics are those of
    a backward through every row (the entropy the sampler's, to float32 roundoff)."""
    trainer = Trainer(tiny_config(tmp_path, recipe, "prompts_per_step=3", "max_new_tokens=16"))
    batch = _mixed_batch(trainer)
    assert batch.old_logp is None and batch.sampler_entropy is not None
    rows = torch.arange(batch.rows)
    settings = UpdateSettings(epochs=1, minibatches=1, micro_batch_size=3, temperature=1.0,
                              max_grad_norm=None, pad_id=trainer.engine.pad_id)
    # the whole batch, then the zero-variance group alone (its shortest row still steps):
    # rows through the forward with a backward through every row, with forward-only rows,
    # and with the sampler's entropies standing in
    for step, expected_rows in ((rows, (12, 11, 7)), (rows[4:8], (4, 4, 1))):
        outcomes = []
        for skip, entropies in ((False, batch.sampler_entropy), (True, None),
                                (True, batch.sampler_entropy)):
            lm = copy.deepcopy(trainer.lm).train()
            scorer = TokenScorer(lm, tied_grads_in_place=True)
            scored = []
            scorer.register_forward_hook(
                lambda _, args, __, scored=scored: scored.append(args[0].input_ids.shape[0]))
            optimizer = torch.optim.SGD(lm.parameters(), lr=0.1, momentum=0.9,
                                        weight_decay=0.1)
            results = run_updates(
                Trainable(scorer, optimizer),
                dataclasses.replace(batch, sampler_entropy=entropies), trainer.recipe,
                trainer.loss_cfg, dataclasses.replace(settings, forward_only_zero_gradient=skip),
                [step])
            outcomes.append((round_metrics(results[0]), lm.state_dict(), sum(scored)))
        (full, full_state, _), _, (fast, state, _) = outcomes
        assert tuple(rows_run for *_, rows_run in outcomes) == expected_rows
        assert full["grad/norm"] > 1e-3 if len(step) == batch.rows else full["grad/norm"] == 0
        assert fast.keys() == full.keys()
        assert fast["ratio/min"] == fast["ratio/max"] == 1.0
        for key, value in without_mismatch(full).items():
            assert fast[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        for name, value in full_state.items():
            torch.testing.assert_close(state[name], value, atol=1e-6, rtol=1e-5)


class Rank(Replica):
    """Replica ``rank`` of ``size`` without a process group: its gradients stay its own (a
    DDP all-reduce would average them)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


def test_on_two_replicas_rows_without_a_gradient_run_not_at_all(tmp_path):
    """Data-parallel replicas split the rows with a gradient and leave out the others, whose
    diagnostics replica 0 adds: the two replicas' gradients average to one process's with a
    backward through every row, and their merged diagnostics are its diagnostics."""
    trainer = Trainer(tiny_config(tmp_path, "dr_grpo", "prompts_per_step=3",
                                  "max_new_tokens=16"))
    batch = _mixed_batch(trainer)
    settings = UpdateSettings(epochs=1, minibatches=1, micro_batch_size=3, temperature=1.0,
                              max_grad_norm=None, pad_id=trainer.engine.pad_id)
    outcomes = []
    for replica, skip in ((Rank(0, 1), False), (Rank(0, 2), True), (Rank(1, 2), True)):
        lm = copy.deepcopy(trainer.lm).train()
        scorer = TokenScorer(lm, tied_grads_in_place=True)
        scored = []
        scorer.register_forward_hook(
            lambda _, args, __, scored=scored: scored.append(args[0].input_ids.shape[0]))
        optimizer = torch.optim.SGD(lm.parameters(), lr=0.0)
        results = run_updates(Trainable(scorer, optimizer), batch, trainer.recipe,
                              trainer.loss_cfg,
                              dataclasses.replace(settings, forward_only_zero_gradient=skip,
                                                  replica=replica),
                              [torch.arange(batch.rows)])
        outcomes.append((results, {n: p.grad for n, p in lm.named_parameters()}, sum(scored)))
    (full, full_grads, full_rows), (first, grads0, rows0), (second, grads1, rows1) = outcomes
    assert (full_rows, rows0 + rows1) == (12, 7)  # the 7 rows with a gradient, split 4 + 3
    for name, grad in full_grads.items():
        torch.testing.assert_close((grads0[name] + grads1[name]) / 2, grad, atol=1e-6,
                                   rtol=1e-5, msg=name)
    want = full[0].diagnostics.finish()
    have = merge_replicas([first, second])[0].diagnostics.finish()
    assert have.keys() == want.keys()
    for key, value in without_mismatch(want).items():
        assert have[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize(("recipe", "options", "records"), [
    ("dr_grpo", [], True), ("gspo", [], True), ("rloo", [], True),
    ("dr_grpo", ["epochs=2"], False),  # old log-probs: ratios away from 1
    ("dr_grpo", ["minibatches=2"], False),
    ("dr_grpo", ["train_workers=2", "launcher=ray"], True),  # replicas: shares of the rest
    ("dr_grpo", ["train_workers=2", "launcher=ray", "train_parallel=fsdp2"], True),
    ("grpo", [], False),  # a KL term: every row has a gradient
    ("ppo", [], False),  # a critic
    # dynamic sampling: no group without variance reaches the update
    ("dapo", ["recipe_options.overlong_buffer=4"], False),
])
def test_the_sampler_records_entropies_only_where_the_update_can_use_them(tmp_path, recipe,
                                                                         options, records):
    config = tiny_config(tmp_path, recipe, *options)
    assert records_entropies(config, config.build_recipe()) is records


def test_a_kl_term_or_an_entropy_bonus_gives_every_row_a_gradient(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "dr_grpo", "prompts_per_step=3",
                                  "max_new_tokens=16"))
    batch = _mixed_batch(trainer)
    assert _zero_rows(batch, trainer).sum() == 5
    for change in ({"kl_coef": 0.01}, {"entropy_coef": 0.01}):
        loss_cfg = dataclasses.replace(trainer.loss_cfg, **change)
        assert not zero_gradient_rows(torch.arange(batch.rows), batch, loss_cfg, False).any()
    assert not zero_gradient_rows(torch.arange(batch.rows), batch, trainer.loss_cfg,
                                  True).any()  # a critic to train


@pytest.mark.parametrize(("options", "records"), [
    ([], True), (["epochs=2"], False), (["minibatches=2"], False),
    (["precision=bf16"], False), (["precision=bf16-master"], True),
    (["precision=bf16-master", "epochs=2"], False), (["torch_compile=true"], True),
    (["train_workers=2", "launcher=ray"], False), (["reuse_sampler_forward=false"], False),
    (["lora.r=4"], False),
])
def test_the_sampler_records_its_forward_only_where_the_update_runs_those_weights(
        tmp_path, options, records):
    assert records_forward(tiny_config(tmp_path, "grpo", *options)) is records

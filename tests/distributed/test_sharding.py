"""How a round's prompts and a minibatch's rows are spread over workers, without Ray: every
piece is covered once, in order, and the merged results equal one process's."""

import pytest
import torch

from postrl.objectives import Diagnostics
from postrl.rollout import HFRolloutEngine, SamplingParams
from postrl.train.distributed.rollout import cat_rollouts, follow_turns, prompt_slices
from postrl.train.replicas import RoundResult, merge_replicas, replica_micro_batches


@pytest.mark.parametrize("prompts, workers", [(4, 2), (5, 2), (3, 3), (2, 3), (7, 4)])
def test_prompt_slices_cover_every_prompt_once_in_order(prompts, workers):
    slices = prompt_slices(prompts, workers)
    assert [i for start, stop in slices for i in range(start, stop)] == list(range(prompts))
    sizes = [stop - start for start, stop in slices]
    assert all(sizes) and max(sizes) - min(sizes) <= 1 and len(slices) == min(prompts, workers)


def test_a_later_turn_goes_to_the_worker_that_had_its_episode():
    """Turn 0 gave prompts [1] and [2] (3 episodes each) to worker 0, [3] to worker 1; at the
    next turn the running episodes' prompts extend those: each reaches its worker, and an
    empty share keeps its place (worker 0 below, once its episodes have ended)."""
    previous = [[[1], [2]], [[3]]]
    running = [[1, 7, 8], [1, 9], [2, 5], [3, 4], [3, 6, 6]]
    assert follow_turns(previous, running) == [(0, 3), (3, 5)]
    assert follow_turns(previous, [[3, 4], [3, 6, 6]]) == [(0, 0), (0, 2)]
    # a prompt that extends none follows the one before it
    assert follow_turns(previous, [[1, 7], [9, 9], [3, 1]]) == [(0, 2), (2, 3)]
    # out of order, a prompt is not followed back: shares stay contiguous
    assert follow_turns(previous, [[3, 1], [1, 2]]) == [(0, 0), (0, 2)]
    # three workers, the middle one without running episodes
    assert follow_turns([[[1]], [[2]], [[3]]], [[1, 1], [3, 3]]) == [(0, 1), (1, 1), (1, 2)]


@pytest.mark.parametrize("rows, size, micro", [(8, 2, 3), (5, 2, 2), (3, 3, 8), (7, 3, 1)])
def test_replica_shares_cover_every_row_once_in_order(rows, size, micro):
    minibatch = torch.randperm(rows, generator=torch.Generator().manual_seed(rows))
    shares = [replica_micro_batches(minibatch, rank, size, micro) for rank in range(size)]
    covered = [int(i) for share in shares for m, weight in share for i in m if weight]
    assert covered == minibatch.tolist()
    assert all(len(m) <= micro for share in shares for m, _ in share)


def test_a_replica_without_rows_runs_one_row_with_weight_zero():
    """Every DDP replica must take part in the all-reduce: an empty share becomes one row of
    weight 0 (the dynamic-sampling shortfall can leave fewer rows than workers)."""
    minibatch = torch.tensor([5])
    assert replica_micro_batches(minibatch, 0, 2, 4) == [(minibatch, 1.0)]
    [(rows, weight)] = replica_micro_batches(minibatch, 1, 2, 4)
    assert rows.tolist() == [5] and weight == 0.0


@pytest.mark.parametrize("rows, size, micro", [(5, 2, 2), (1, 2, 4), (7, 3, 2), (8, 2, 3)])
def test_fsdp2_replicas_run_equal_numbers_of_micro_batches(rows, size, micro):
    """Under FSDP2 every forward is a collective: shares of 3 and 2 rows at 2 a micro-batch
    would run 2 and 1 (the run hung); the shorter is padded with weight-0 rows."""
    minibatch = torch.arange(10, 10 + rows)
    shares = [replica_micro_batches(minibatch, rank, size, micro, equal_counts=True)
              for rank in range(size)]
    assert len({len(share) for share in shares}) == 1
    trained = [int(r) for share in shares for micro_rows, w in share if w for r in micro_rows]
    assert trained == minibatch.tolist()
    padding = [micro_rows for share in shares for micro_rows, w in share if not w]
    assert all(len(p) == 1 for p in padding)


def test_merged_replica_results_equal_one_process():
    def result(share: float, low: float, high: float) -> RoundResult:
        diagnostics = Diagnostics()
        diagnostics.add("loss/policy", share)
        diagnostics.low("ratio/min", low)
        diagnostics.high("ratio/max", high)
        return RoundResult(diagnostics, value_loss=share, value_clip=share / 2, grad_norm=3.0)

    [merged] = merge_replicas([[result(0.25, 0.9, 1.1)], [result(0.5, 0.8, 1.05)]])
    assert merged.diagnostics.finish() == {"loss/policy": 0.75, "ratio/min": 0.8,
                                           "ratio/max": 1.1}
    assert (merged.value_loss, merged.value_clip, merged.grad_norm) == (0.75, 0.375, 3.0)
    assert not merged.skipped


def test_sampling_is_keyed_by_prompt_index_not_by_worker(tiny):
    """One call on all prompts gives the same completions as contiguous slices of them with
    their first prompt index (what the rollout actors get), however the prompts are split."""
    model, tokenizer = tiny
    engine = HFRolloutEngine(model, tokenizer, entropies=True)
    prompts = [tokenizer(f"{a} + {a} =").input_ids for a in range(5)]
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    whole = engine.generate(prompts, 3, params, seed=11)
    for workers in (2, 3, 5):
        parts = [engine.generate(prompts[start:stop], 3, params, seed=11, first_prompt=start)
                 for start, stop in prompt_slices(len(prompts), workers)]
        split = cat_rollouts(parts, engine.pad_id)
        assert split.texts == whole.texts
        assert torch.equal(split.response_ids, whole.response_ids)
        assert torch.equal(split.response_mask, whole.response_mask)
        assert torch.allclose(split.logprobs, whole.logprobs, atol=1e-5)
        assert torch.allclose(split.entropies, whole.entropies, atol=1e-5)
        assert split.finish_reasons == whole.finish_reasons
    # and the seed matters: another seed gives other samples
    assert engine.generate(prompts, 3, params, seed=12).texts != whole.texts

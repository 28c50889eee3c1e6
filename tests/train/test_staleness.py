"""max_staleness: a schedule of which weights draw each batch, run in order or by a sampler
thread beside the trainer, with the same numbers; and a run killed while the sampler runs
ahead resumes to the same metrics and weights."""

import hashlib
import json
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

from postrl.config import load_config
from postrl.errors import ConfigError
from postrl.recipes import get_recipe
from postrl.train.sampling import Collected
from postrl.train.staleness import (
    Drawn,
    InOrder,
    Overlapped,
    Queue,
    Schedule,
    drawn_by,
    state_copy,
)
from postrl.train.trainer import Trainer
from tests.train.test_resume import options as resume_options

HERE = Path(__file__).parent
REWARDS = HERE / "rewards_for_tests.py"
CLOCK = ("time/", "throughput/", "memory/", "async/queue_wait_s", "async/sampler_idle_s",
         "async/trainer_idle_s")  # vary from run to run


def options(out: Path, *extra: str) -> list[str]:
    """test_resume's tiny run, for five steps (later options override earlier ones)."""
    return resume_options(out, "grpo", "steps=5", *extra)


def metrics_without_clock(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(CLOCK)} for r in rows]


def weights_sha(run: Path) -> str:
    return hashlib.sha256((run / "final" / "model.safetensors").read_bytes()).hexdigest()


def train(out: Path, *extra: str) -> list[dict]:
    Trainer(load_config(None, options(out, *extra))).train()
    return metrics_without_clock(out)


# ---- the schedule, on its own -----------------------------------------------------------

def test_batch_t_is_drawn_by_the_weights_of_update_t_minus_k_or_the_first():
    assert [drawn_by(t, 0) for t in range(4)] == [0, 1, 2, 3]
    assert [drawn_by(t, 2) for t in range(6)] == [0, 0, 0, 1, 2, 3]


class Recorder:
    """A draw that notes which weights version (the trainer's step, or the sampler copy's
    ``version``) drew which batch."""

    def __init__(self, version_of):
        self.version_of, self.log = version_of, []

    def __call__(self, step, engine):
        version = self.version_of(engine)
        self.log.append((step, version))
        return Drawn(step, version, Collected([], [], 1), 0, {"generate": 0.0, "score": 0.0},
                     (0, step))


@pytest.mark.parametrize("k", [0, 1, 3])
def test_in_order_draws_each_batch_at_the_start_of_the_step_whose_weights_are_due(k):
    trainer_step = [0]
    draw = Recorder(lambda engine: trainer_step[0])
    schedule = InOrder(draw, None, Schedule(k, last=6))
    for step in range(7):
        trainer_step[0] = step
        taken = schedule.take(step)
        assert taken.step == step and taken.version == drawn_by(step, k)
        assert taken.staleness == min(step, k)
    assert [s for s, _ in draw.log] == list(range(7))  # each batch once, never past `last`
    assert all(v == drawn_by(s, k) for s, v in draw.log)


def test_the_sampler_thread_draws_the_same_batches_with_the_weights_published_to_it():
    k, model = 2, torch.nn.Linear(1, 1, bias=False)
    draw = Recorder(lambda m: int(m.weight.item()))
    with torch.no_grad():
        model.weight.fill_(0)
    schedule = Overlapped(draw, model, Schedule(k, last=7), state_copy, model.load_state_dict)
    trained = torch.nn.Linear(1, 1, bias=False)
    for step in range(8):
        taken = schedule.take(step)
        assert (taken.step, taken.version) == (step, drawn_by(step, k))
        with torch.no_grad():
            trained.weight.fill_(step + 1)  # "update step" made version step + 1
        schedule.publish(step + 1, trained)
    schedule.close()
    assert draw.log == [(s, drawn_by(s, k)) for s in range(8)]
    assert not schedule.thread.is_alive()


def test_the_queue_a_checkpoint_keeps_is_the_schedules_whatever_the_thread_has_done():
    k, model = 3, torch.nn.Linear(1, 1, bias=False)
    draw = Recorder(lambda m: 0)
    schedule = Overlapped(draw, model, Schedule(k), state_copy, model.load_state_dict)
    assert [d.step for d in schedule.queued(after=-1)] == [0, 1, 2]
    schedule.take(0)
    schedule.publish(1, model)  # the thread may now draw batch 4 as well
    assert [d.step for d in schedule.queued(after=0)] == [1, 2, 3]
    schedule.close()
    queue = Queue()
    queue.hold(schedule.queued(after=0), trained=(0, 9))
    assert queue.position == (0, 3)  # after the last batch drawn for a later step


def test_a_failure_in_the_sampler_thread_is_raised_in_the_trainer():
    def broken(step, engine):
        raise RuntimeError("the sampler broke")

    schedule = Overlapped(broken, None, Schedule(1, last=3), state_copy, print)
    with pytest.raises(RuntimeError, match="the sampler broke"):
        schedule.take(0)
    schedule.close()
    assert threading.active_count() >= 1


# ---- whole runs ---------------------------------------------------------------------------

def test_in_order_and_overlapped_runs_give_identical_metrics_and_weights(tmp_path):
    """The must-show: max_staleness=2 in order and with the sampler thread beside the
    trainer write the same metrics.jsonl (clock aside) and the same final weights."""
    staleness = "recipe_options.max_staleness=2"
    in_order = train(tmp_path / "in_order", staleness)
    overlapped = train(tmp_path / "overlapped", staleness, "overlap_sampling=true")
    assert [r["async/staleness_max"] for r in in_order] == [0, 1, 2, 2, 2]
    assert overlapped == in_order
    assert weights_sha(tmp_path / "overlapped") == weights_sha(tmp_path / "in_order")
    # and staleness changed the run: the synchronous one trains on other samples
    synchronous = train(tmp_path / "synchronous")
    assert "async/staleness_max" not in synchronous[0]
    assert synchronous[0]["reward/mean"] == in_order[0]["reward/mean"]  # batch 0: same weights
    assert weights_sha(tmp_path / "synchronous") != weights_sha(tmp_path / "in_order")


def test_several_updates_per_batch_and_a_correction_run_the_same_both_ways(tmp_path):
    extra = ("recipe_options.max_staleness=1", "recipe_options.mismatch_weight=token",
             "epochs=2", "minibatches=2", "steps=3")
    in_order = train(tmp_path / "in_order", *extra)
    overlapped = train(tmp_path / "overlapped", *extra, "overlap_sampling=true")
    assert overlapped == in_order
    # stale samples: the proximal policy is not the behaviour policy after the first step
    assert in_order[0]["mismatch/kl_k3"] < 1e-6 < in_order[2]["mismatch/kl_k3"]


RUNS = {  # every recipe family, dynamic sampling, an environment and bf16-master, stale
    "bf16-master": ("precision=bf16-master",),  # the thread samples a bf16 copy of its own
    "ppo": ("recipe=ppo", "critic_lr=1e-3"),
    "dapo": ("recipe=dapo", f"rewards=[{REWARDS}:parity_on_odd_answers]",
             "recipe_options.overlong_buffer=4"),
    "environment": ("task=guess_number", "stop=[e]", "max_turns=3", "max_new_tokens=12",
                    f"rewards=[environment, {REWARDS}:length_parity]"),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_ppo_dynamic_sampling_and_environments_run_stale_the_same_both_ways(tmp_path, run):
    extra = (*RUNS[run], "recipe_options.max_staleness=1", "steps=3")
    in_order = train(tmp_path / "in_order", *extra)
    assert train(tmp_path / "overlapped", *extra, "overlap_sampling=true") == in_order
    assert weights_sha(tmp_path / "overlapped") == weights_sha(tmp_path / "in_order")
    assert [r["async/staleness_max"] for r in in_order] == [0, 1, 1]


@pytest.mark.parametrize("resumed_with", ["overlap_sampling=true", "overlap_sampling=false"])
def test_a_run_killed_while_the_sampler_runs_ahead_resumes_to_the_same_run(tmp_path,
                                                                          resumed_with):
    """The must-show: killed after logging step 3 (its sampler thread drawing batch 5), the
    run resumes from step 2's checkpoint, which holds the batches drawn for steps 3 and 4, to
    the same metrics.jsonl and final weights, with the thread or in order."""
    extra = ("recipe_options.max_staleness=2", "overlap_sampling=true")
    whole = train(tmp_path / "whole", *extra)
    out = tmp_path / "resumed"
    child = subprocess.run([sys.executable, str(HERE / "killable_run.py"), "after_log", "3",
                            *options(out, *extra)], capture_output=True, text=True)
    assert child.returncode == -9, child.stderr[-2000:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(load_config(None, options(out, "recipe_options.max_staleness=2",
                                                    resumed_with, "resume=auto")))
    assert trainer.resumed_from == 2 and [d.step for d in trainer.queue.batches] == [2, 3]
    trainer.train()
    assert metrics_without_clock(out) == whole
    assert weights_sha(out) == weights_sha(tmp_path / "whole")


def test_old_policy_behaviour_takes_the_ratio_against_the_samplers_log_probs(tmp_path):
    trainer = Trainer(load_config(None, options(tmp_path / "run", "epochs=2",
                                                "recipe_options.old_policy=behaviour")))
    from postrl.train.batch import assemble

    batch = assemble(trainer.draw(0, trainer.engine).collected.groups, overlong_filter=False)
    sampler = batch.sampler_logp.clone()
    trainer.phases.prepare(batch)
    assert torch.equal(batch.old_logp, sampler) and batch.sampler_logp is None
    trainer.close()


def test_refusals_name_the_option(tmp_path):
    with pytest.raises(ConfigError, match="overlap_sampling=true needs the recipe's "
                                          "max_staleness"):
        load_config(None, options(tmp_path / "a", "overlap_sampling=true"))
    with pytest.raises(ConfigError, match="not broadcast"):
        load_config(None, options(tmp_path / "b", "overlap_sampling=true", "launcher=ray",
                                  "weight_sync=broadcast", "recipe_options.max_staleness=1"))
    with pytest.raises(ConfigError, match="max_staleness must be >= 0"):
        get_recipe("grpo").with_(max_staleness=-1)
    with pytest.raises(ConfigError, match="nothing left to correct"):
        get_recipe("grpo").with_(old_policy="behaviour", mismatch_weight="token")

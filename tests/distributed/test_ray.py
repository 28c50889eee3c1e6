"""launcher=ray on a real local Ray cluster (2 CPUs), the tiny model, real gloo groups:
2 rollout actors and 2 trainer workers (DDP with the weights broadcast from rank 0, DDP
through the object store, FSDP2) give the run of one process (same completions, per-step
losses and parameters to 1e-5); a dead actor is named, and resume=auto finishes."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

import postrl  # noqa: E402
from postrl.cli import main  # noqa: E402
from postrl.config import load_config  # noqa: E402
from postrl.telemetry import read_metrics  # noqa: E402
from postrl.train.distributed.failures import WorkerError  # noqa: E402
from postrl.train.replicas import merge_replicas  # noqa: E402
from postrl.train.scorers import TokenScorer  # noqa: E402
from postrl.train.setup import records_entropies  # noqa: E402
from postrl.train.trainer import Trainer  # noqa: E402
from postrl.train.update import Trainable, UpdateSettings, run_updates  # noqa: E402

REWARDS = Path(__file__).parents[1] / "train" / "rewards_for_tests.py"
NOT_COMPARED = ("time/", "throughput/", "memory/", "async/queue_wait_s",
                "async/sampler_idle_s", "async/trainer_idle_s",  # vary from run to run
                # both continue an episode's cache from turn to turn, but a worker's smaller
                # batch recomputes fewer kept tokens (postrl.rollout.kept_turns): checked apart
                "rollout/prefill_tokens")
RAY = ["launcher=ray", "rollout_workers=2", "train_workers=2", "worker_cpus=0.5"]
# float sums in another order (each worker arranges its own share into micro-batches): the
# runs are not bit-identical; the largest parameter differences after 3 steps are those of
# one-process runs with another micro_batch_size (docs/scaling.md; Adam magnifies tiny
# gradient differences on parameters whose gradients are tiny)
TOLERANCE = 1e-5


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    """One local Ray instance for the module; the trainers join it."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"py_modules": [postrl]})
    yield
    ray.shutdown()


def options(out: Path, recipe: str, *extra: str) -> list[str]:
    # two update rounds per batch (epochs x minibatches) exercise the driver-drawn shuffle and
    # the off-policy path; micro_batch_size=3 splits rows differently from the 2-row shares
    return [f"recipe={recipe}", "model=tiny", "task=arithmetic", "steps=3", "prompts_per_step=2",
            "group_size=4", "max_new_tokens=8", f"out={out}", "lr=1e-3", "quiet=true",
            f"rewards=[{REWARDS}:length_parity]", "micro_batch_size=3", "threads=1",
            "minibatches=2", "epochs=2", "log_samples=8", *extra]


def metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)} for r in rows]


def completions(run: Path) -> list[str]:
    return [json.loads(line)["completion"]
            for line in (run / "samples.jsonl").read_text().splitlines()]


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a.state_dict().values(),
                                                          b.state_dict().values(), strict=True))


@pytest.fixture(scope="module")
def grpo_on_ray(tmp_path_factory):
    """A 3-step GRPO run on 2 rollout actors and 2 trainer workers (shared by two tests),
    the weights broadcast from train rank 0 to the rollout actors (gloo on the CPU)."""
    out = tmp_path_factory.mktemp("ray") / "grpo"
    trainer = Trainer(load_config(None, options(out, "grpo", *RAY, "weight_sync=broadcast")))
    assert trainer.cluster.broadcast
    trainer.train()
    return out, trainer


def max_moment_diff(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> float:
    states = a.state_dict()["state"], b.state_dict()["state"]
    assert states[0].keys() == states[1].keys() and states[0]
    return max(float((mine[key] - theirs[key]).abs().max())
               for index, mine in states[0].items() for theirs in [states[1][index]]
               for key in ("exp_avg", "exp_avg_sq"))


# FSDP2: sharded parameters and AdamW moments; save_every=3 pulls the moments to the driver
FSDP2 = ("train_parallel=fsdp2", "save_every=3")
# one update per batch, groups without variance: the workers split the rows with a gradient
# and leave the others out (their diagnostics from the sampler's entropies)
ONE_UPDATE = ("epochs=1", "minibatches=1", f"rewards=[{REWARDS}:parity_on_odd_answers]")
# multi-turn episodes: the driver's environments answer each turn the workers sample
EPISODES = ("task=guess_number", "stop=[e]", "max_turns=3", "max_new_tokens=12",
            f"rewards=[environment, {REWARDS}:length_parity]")
STALE = ("recipe_options.max_staleness=2",)  # the rollout actors draw two updates ahead


@pytest.mark.parametrize("recipe, scaling", [("grpo", "ddp+broadcast"), ("ppo", "ddp"),
                                             ("grpo", "fsdp2"), ("dr_grpo", "ddp, one update"),
                                             ("grpo", "ddp, episodes"), ("grpo", "ddp, stale"),
                                             ("grpo", "ddp, stale, thread")])
def test_two_actors_and_two_workers_reproduce_one_process(tmp_path, recipe, scaling, grpo_on_ray):
    both = {"ddp, one update": ONE_UPDATE, "ddp, episodes": EPISODES, "ddp, stale": STALE,
            "ddp, stale, thread": STALE}.get(scaling, ())
    single = Trainer(load_config(None, options(tmp_path / "single", recipe, *both)))
    single.train()
    if scaling == "ddp+broadcast":
        out, distributed = grpo_on_ray
    else:
        out = tmp_path / "ray"
        extra = {"fsdp2": FSDP2, "ddp, stale, thread": ("overlap_sampling=true",)}.get(
            scaling, ())  # the one process runs the schedule in order
        distributed = Trainer(load_config(None, options(out, recipe, *RAY, *extra, *both)))
        distributed.train()
        if both == EPISODES:
            assert any(r["episode/turns_mean"] > 1 for r in metrics(out))
            # later turns reach the worker that keeps their episode: never more prefill
            prefilled = [[r["rollout/prefill_tokens"] for r in read_metrics(run / "metrics.jsonl")]
                         for run in (out, tmp_path / "single")]
            assert all(a <= b for a, b in zip(*prefilled, strict=True)), prefilled
        if both == STALE:
            assert [r["async/staleness_max"] for r in metrics(out)] == [0, 1, 2]
        if both == ONE_UPDATE:  # the path is taken (tests/train/test_update.py: which rows)
            assert records_entropies(distributed.cfg, distributed.recipe)
            assert any(r["batch/zero_variance_frac"] > 0 for r in metrics(out))
    assert completions(out) == completions(tmp_path / "single")
    expected, got = metrics(tmp_path / "single"), metrics(out)
    assert [r["step"] for r in got] == [1, 2, 3]
    for want, have in zip(expected, got, strict=True):
        assert want.keys() == have.keys()
        for key, value in want.items():  # None: a mean over no responses, in both runs
            assert have[key] == (value if value is None else
                                 pytest.approx(value, rel=TOLERANCE, abs=TOLERANCE)), key
    assert max_param_diff(single.lm, distributed.lm) < TOLERANCE
    if recipe == "ppo":
        assert max_param_diff(single.critic, distributed.critic) < TOLERANCE
    if scaling == "fsdp2":  # the moments gathered from the shards are one process's
        assert max_moment_diff(single.optimizer, distributed.optimizer) < TOLERANCE


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_uneven_and_empty_shares_give_the_update_of_one_process(tmp_path, parallel):
    """One fixed batch, a plan with a 1-row minibatch (worker 2 has no row: it runs a
    weight-0 row to join the all-reduce), a 3-row one (shares of 2 and 1) and a 5-row one
    (3 and 2 rows: 2 and 1 micro-batches, which FSDP2 pads to 2 and 2)."""
    trainer = Trainer(load_config(None, options(tmp_path / "ray", "grpo", "steps=1",
                                                "launcher=ray", "train_workers=2",
                                                "worker_cpus=0.5",
                                                f"train_parallel={parallel}")))
    local = Trainer(load_config(None, options(tmp_path / "local", "grpo", "steps=1")))
    try:
        from postrl.train.batch import assemble

        batch = assemble(local.draw(0, local.engine).collected.groups, overlong_filter=False)
        local.phases.prepare(batch)
        plan = [torch.tensor([6]), torch.tensor([0, 3, 5]), torch.tensor([1, 2, 4, 7]),
                torch.tensor([0, 1, 2, 3, 4])]
        settings = UpdateSettings(epochs=1, minibatches=4, micro_batch_size=2, temperature=1.0,
                                  max_grad_norm=1.0, pad_id=local.engine.pad_id)
        distributed = trainer.cluster.update(batch, settings, plan, lr=1e-3)
        local.policy.train()
        expected = run_updates(Trainable(TokenScorer(local.lm), local.optimizer), batch,
                               local.recipe, local.loss_cfg, settings, plan)
        assert max_param_diff(local.lm, trainer.lm) < TOLERANCE
        for want, have in zip(merge_replicas([expected]), distributed, strict=True):
            assert have.grad_norm == pytest.approx(want.grad_norm, rel=TOLERANCE)
            finished = have.diagnostics.finish()
            for key, value in want.diagnostics.finish().items():
                assert finished[key] == pytest.approx(value, rel=TOLERANCE, abs=1e-7), key
    finally:
        trainer.cluster.close()


def kill(actor) -> None:
    os.kill(ray.get(actor.pid.remote()), signal.SIGKILL)


def test_a_dead_rollout_worker_is_named_and_resume_finishes_the_run(tmp_path, grpo_on_ray,
                                                                    capsys):
    out = tmp_path / "killed"
    trainer = Trainer(load_config(None, options(out, "grpo", *RAY, "save_every=1")))
    update = trainer.phases.update

    def update_then_kill(batch):
        result = update(batch)
        if trainer.step == 1:  # after step 2's update (step counts from 0): step 3 fails
            kill(trainer.cluster.rollout.actors[1])
        return result

    trainer.phases.update = update_then_kill
    with pytest.raises(WorkerError, match=r"^rollout worker 2/2 died \(its process ended.*"
                                          r"rerun it with resume=auto$"):
        trainer.train()
    assert [r["step"] for r in metrics(out)] == [1, 2]  # step 3 never logged
    assert main(["train", *options(out, "grpo", *RAY, "save_every=1", "resume=auto")]) == 0
    printed = capsys.readouterr()
    assert "saved" in printed.out
    assert "rollout worker 1/2: cpu" not in printed.err  # quiet=true: no device lines
    # the resumed run is the uninterrupted one, line for line
    reference, _ = grpo_on_ray
    assert metrics(out) == metrics(reference)


def test_a_dead_train_worker_is_named(tmp_path):
    trainer = Trainer(load_config(None, options(tmp_path / "run", "grpo", *RAY)))
    prepare = trainer.phases.prepare

    def prepare_then_kill(batch):
        prepare(batch)
        kill(trainer.cluster.trainers.actors[0])

    trainer.phases.prepare = prepare_then_kill
    with pytest.raises(WorkerError, match=r"^train worker 1/2 died .*This run writes no "
                                          r"checkpoints \(save_every=0\)"):
        trainer.train()


def test_without_a_ray_session_the_cli_starts_a_local_instance_and_stops_it(tmp_path):
    """A fresh process with no Ray session and no ray_address: postrl starts a local Ray
    instance, ships its own code to the workers, trains, and shuts the instance down; once
    the actors are up it says where each computes, one line each."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    run = subprocess.run([sys.executable, "-m", "postrl.cli", "train",
                          *options(tmp_path / "run", "grpo", "steps=1", "launcher=ray"),
                          "quiet=false"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Started a local Ray instance" in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("postrl: ")]
    assert lines == ["postrl: rollout worker 1/1: cpu", "postrl: train worker 1/1: cpu"]
    assert (tmp_path / "run" / "final" / "config.json").is_file()

"""The trainer: one step is prompts -> rollouts -> rewards -> filters -> advantages -> loss ->
update -> metrics. Every choice an algorithm makes comes from the recipe's components (their
maths: docs/algorithms.md); nothing here branches on a recipe's name."""

from __future__ import annotations

import functools
import time
import warnings
import weakref

import torch

from postrl.config import TrainConfig
from postrl.devices import resolve_device
from postrl.errors import PostRLError
from postrl.models.policy import ReferencePolicy, ValueModel, causal_lm, save_policy
from postrl.models.precision import (
    MasterWeights,
    precision_warning,
)
from postrl.process import configure_process
from postrl.rollout import HFRolloutEngine, SamplingParams
from postrl.tasks import load_task
from postrl.telemetry import JsonlSink, MultiSink, RunDir, TrainProgress, make_sinks
from postrl.telemetry.run_dir import check_out_path
from postrl.telemetry.run_lock import RunLock
from postrl.telemetry.trackers import check_sinks
from postrl.train import staleness
from postrl.train.batch import TrainBatch, assemble, save_rollout_batch
from postrl.train.distributed.weights import engine_weights
from postrl.train.drawing import Drawer, thread_sampler
from postrl.train.evaluate import training_eval
from postrl.train.grading import Grader
from postrl.train.metrics import StepResult, sample_rows, step_metrics
from postrl.train.phases import Phases
from postrl.train.prepare import Scorers, prepare
from postrl.train.resume import checkpoint_to_resume, maybe_save, resume
from postrl.train.sampling import PromptSampler, PromptTokens
from postrl.train.scorers import TokenScorer, ValueScorer
from postrl.train.setup import (
    episode_limits,
    load_trained_policy,
    lr_factor,
    make_optimizers,
    on_device,
    records_entropies,
    records_forward,
    seed_everything,
)
from postrl.train.state import RunObjects, RunState
from postrl.train.teacher import Teacher, held_out_reverse_kl
from postrl.train.update import (
    Trainable,
    UpdateSettings,
    average_rounds,
    drop_gradients,
    round_metrics,
    run_updates,
    update_plan,
)
from postrl.train.warm_start import WarmStart, warm_start


class TrainingError(PostRLError):
    """Training cannot go on (e.g. non-finite updates again and again)."""


class Trainer:
    """One run, trained to its end (``train()``) or a step at a time (``train_step()``); it
    locks its run directory until ``close()`` (``train()``, a ``with`` block) or collection."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.recipe = cfg.build_recipe()
        self.loss_cfg = self.recipe.policy_loss_config(cfg.max_new_tokens)
        configure_process(cfg.threads, cfg.reuse_freed_memory)
        self.device = resolve_device(cfg.device)
        if self.device.type == "cpu" and (cfg.launcher == "local" or not cfg.worker_gpus):
            slow = precision_warning(cfg.precision)
            if slow:
                warnings.warn(slow, stacklevel=2)
        truncated = cfg.top_k or cfg.top_p < 1  # the hf sampler records untruncated log-probs
        if self.loss_cfg.corrects_mismatch and truncated and cfg.rollout_backend == "hf":
            warnings.warn("the mismatch correction weighs tokens by pi_old / pi_sampler of the "
                          "untruncated distribution; with top_k or top_p the sampler drew from a "
                          "truncated one, which these weights do not correct (docs/recipes.md)",
                          stacklevel=2)
        seed_everything(cfg.seed)
        self._load_inputs()  # every input is checked before the run directory is touched
        self.lock = RunLock.acquire(cfg.run_dir())
        # a trainer dropped without close() (a notebook's, a script's) unlocks when collected
        weakref.finalize(self, self.lock.release)
        self.restored_earlier = False  # an overwritten run put back (close)
        try:
            self.run = RunDir.create(cfg.run_dir(), overwrite=cfg.overwrite,
                                     resume=cfg.resume != "no")
            resumed = (resume(self.objects(), cfg, self.run, self.checkpoint)
                       if cfg.resume != "no" else None)
            self.state = resumed or RunState()
            self.resumed_from = None if resumed is None else resumed.step
            self._start_engines()
        except BaseException:
            self.close(failed=True)
            raise

    def _load_inputs(self) -> None:
        """Load and check everything a run reads: the task, the reward functions, the model
        (and LoRA), the sampling options, the trackers, the checkpoint to resume from."""
        cfg = self.cfg
        check_out_path(cfg.run_dir())  # before the slow loads, as RunDir.create will again
        RunDir(cfg.run_dir()).check_can_start(cfg.overwrite, cfg.resume != "no")
        self.task = load_task(cfg.task, **cfg.task_options)
        self.grader = Grader.for_run(cfg, self.task, self.recipe, str(self.device))
        self.sampling = SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_new_tokens,
                                       tuple(cfg.stop))
        check_sinks(cfg.report_to)
        self.checkpoint = checkpoint_to_resume(cfg) if cfg.resume != "no" else None
        model, self.tokenizer = load_trained_policy(cfg)
        on_device(model, self.device)  # before the reference, critic and optimizer copy it
        self.policy = model
        self.lm = causal_lm(model)
        self.reference = ReferencePolicy(model) if self.recipe.needs_reference else None
        self.critic = ValueModel(model) if self.recipe.critic else None
        self.teacher = Teacher.for_run(cfg, model, self.tokenizer, self.task, self.reference,
                                       self.device)
        self.episodes = episode_limits(cfg, self.lm, self.task)  # None: single-turn
        self.engine = HFRolloutEngine(self.lm, self.tokenizer, batch_size=None,
                                      precision=cfg.sampling_precision,
                                      entropies=records_entropies(cfg, self.recipe),
                                      record_forward=records_forward(cfg) and not self.episodes)
        self.optimizer, self.critic_optimizer = make_optimizers(cfg, model, self.critic)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, functools.partial(lr_factor, cfg))
        self.sampler = PromptSampler(self.task.train(), cfg.seed)
        self.queue = staleness.Queue()  # what a checkpoint keeps of the batches drawn ahead
        self.schedule: staleness.InOrder | staleness.Overlapped | None = None  # made lazily
        self.drawn_position = (0, 0)  # the prompt sampler's place after the last step's batch
        self.update_generator = torch.Generator().manual_seed(cfg.seed)
        self.prompt_ids = PromptTokens(self.tokenizer, self.lm, cfg.max_new_tokens)
        # draw(step, engine): a step's samples (tests and bench scripts call it too)
        self.draw = Drawer(cfg, self.recipe, self.task, self.tokenizer, self.sampler,
                           self.prompt_ids, self.grader, self.sampling, self.episodes)
        self.phases = Phases(self._prepare, self._update)  # the seam for measuring: phases.py
        self.state = RunState()  # where the run stands (resumed: the checkpoint's)

    def _start_engines(self) -> None:
        """The bf16 working copy, and Ray's workers or vLLM, from the (resumed) weights."""
        cfg = self.cfg
        # bf16-master: a bf16 working copy scores and trains; self.lm keeps the float32 masters
        self.master = MasterWeights(self.lm) if cfg.precision == "bf16-master" else None
        if self.master is not None:  # the sampler records the working copy's forward
            self.engine.scoring_model = self.master.working
        self.cluster = None
        if cfg.launcher == "ray":  # rollout actors and trainer workers start from this state
            from postrl.train.distributed.cluster import start_cluster  # Ray: an optional extra

            self.cluster = start_cluster(cfg, self.objects(), self.tokenizer.pad_token_id)
            self.engine = self.cluster.rollout
        elif cfg.rollout_backend == "vllm":  # holds its own copy of the (resumed) weights
            from postrl.rollout.vllm import VLLMRolloutEngine

            self.engine = VLLMRolloutEngine.from_config(self.lm, self.tokenizer, cfg)

    def close(self, failed: bool = False) -> None:
        """Stop the workers and unlock the run directory (again: no cost). ``failed`` before
        the first step was logged puts back an earlier run that ``overwrite`` was replacing."""
        if not self.lock.held:
            return
        cluster, self.cluster = getattr(self, "cluster", None), None
        schedule, self.schedule = getattr(self, "schedule", None), None
        if schedule is not None:  # a failed run does not wait for the sampler's batch
            schedule.close(wait=not failed)
        try:
            if cluster is not None:
                cluster.close()
            elif hasattr(getattr(self, "engine", None), "close"):  # vLLM's processes
                self.engine.close()
        finally:
            run = getattr(self, "run", None)
            if failed and run is not None:
                self.restored_earlier = run.restore_replaced()
            self.lock.release()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.close(failed=error is not None)

    @property
    def step(self) -> int:
        """The steps finished (``state.step``)."""
        return self.state.step

    def objects(self) -> RunObjects:
        """The objects a checkpoint saves and resume loads (``postrl/train/state.py``)."""
        return RunObjects(self.lm, self.critic, self.optimizer, self.critic_optimizer,
                          self.scheduler, self.update_generator, self.sampler, self.queue)

    def done(self) -> bool:
        budget = self.cfg.token_budget
        return self.step >= self.cfg.steps or (budget is not None
                                               and self.state.tokens_generated >= budget)

    # ---- one step -------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """Train until ``steps`` or the token budget; save the final policy; last metrics."""
        if not self.lock.held:
            raise TrainingError(f"this trainer of {self.run.path} was closed; make a new one")
        failed = True
        try:
            metrics = self._train_steps()
            save_policy(self.policy, self.tokenizer, self.run.final_dir)
            failed = False
        finally:
            self.close(failed)
        return metrics

    def _train_steps(self) -> dict[str, float]:
        if self.resumed_from is None:
            self.run.write_config(self.cfg.resolved())
        metrics: dict[str, float] = {}
        sinks = MultiSink([JsonlSink(self.run.metrics_path),
                           *make_sinks(self.cfg.report_to, self.run.path)])
        # step 0's evaluation is logged with step 1, so an overwritten run is put back if the
        # first step fails (nothing is logged before a step has finished)
        at_start = self.cfg.eval_every and self.step == 0 and not self.done()
        start = self._evaluate() if at_start else None
        # the teacher's samples, learnt before step 1 (and logged with it: part of its cost)
        warm = (self._warm_start() if self.step == 0 and self.cfg.teacher.warm_start_prompts
                else {})
        with sinks, TrainProgress(self.cfg.steps, self.cfg.token_budget,
                                  quiet=self.cfg.quiet) as bar:
            while not self.done():
                metrics = {**self.train_step(), **warm}
                warm = {}
                if self.cfg.eval_every and (self.step % self.cfg.eval_every == 0 or self.done()):
                    metrics.update(self._evaluate())
                if start is not None:
                    sinks.log(0, start)
                    start = None
                sinks.log(self.step, metrics)
                self.run.commit_replacement()  # the new run has started
                bar.update(self.step, metrics)
                self._save()
            if warm:  # the teacher's samples spent the whole token budget: no step ran
                rows = [start, {**warm, "rollout/tokens_generated": self.state.tokens_generated}]
                for row in filter(None, rows):
                    sinks.log(0, row)
                self.run.commit_replacement()
        self._save(final=True)
        return metrics

    def _schedule(self) -> staleness.InOrder | staleness.Overlapped:
        """Who draws each step's samples, and when (``staleness.py``): this thread at each
        step's start, or with ``overlap_sampling`` a thread beside it, on its own copy of the
        weights; a resumed run's queue first."""
        schedule = staleness.Schedule(self.recipe.max_staleness, self.step,
                                      tuple(self.queue.batches), self.cfg.steps - 1)
        if not self.cfg.overlap_sampling:
            return staleness.InOrder(self.draw, self.engine, schedule)
        engine, copy, load = thread_sampler(self.cfg, self.cluster, self.engine, self.lm,
                                            self.tokenizer)
        return staleness.Overlapped(self.draw, engine, schedule, copy, load)

    def _save(self, final: bool = False) -> None:
        """A checkpoint when due, with the batches drawn ahead (and Ray's optimizer state)."""
        every = self.cfg.save_every
        due = every and self.step > 0 and (final or self.step % every == 0)
        if due and self.cluster is not None:
            self.cluster.pull_optimizer_states(self.optimizer, self.critic_optimizer)
        if due and self.schedule is not None:
            self.queue.hold(self.schedule.queued(after=self.step - 1), self.drawn_position)
        maybe_save(self.objects(), self.state, self.cfg, self.run, final)

    def train_step(self) -> dict[str, float]:
        timings = dict.fromkeys(("generate", "score", "reference", "train", "sync"), 0.0)
        started = time.perf_counter()
        if self.device.type == "cuda":  # memory/peak_gb is this step's
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.schedule is None:
            self.schedule = self._schedule()
        drawn = self.schedule.take(self.step)
        waited = time.perf_counter() - started
        self.drawn_position = drawn.sampler_position
        timings.update(drawn.timings)  # the seconds that drew this step's own samples
        collected = drawn.collected
        self.state.count_sampled(collected)
        groups = collected.groups
        batch = (assemble(groups, self.recipe.overlong_filter,
                          self.teacher.prompt_ids if self.teacher else None) if groups else None)
        update_metrics: dict[str, float] = {}
        if batch is not None:
            t = time.perf_counter()
            self.phases.prepare(batch)
            timings["reference"] = time.perf_counter() - t
            t = time.perf_counter()
            update_metrics = self.phases.update(batch)
            timings["train"] = time.perf_counter() - t
            t = time.perf_counter()
            if (self.cluster is None and self.cfg.rollout_backend == "vllm"
                    and not self.cfg.overlap_sampling):  # its own copy (the thread pushes)
                self.engine.load_weights(engine_weights(self.lm))
            timings["sync"] = time.perf_counter() - t
        self._guard(update_metrics.pop("guard/skipped_updates", 0.0) > 0, update_metrics)
        with warnings.catch_warnings():
            # the schedule counts steps: one with no rows left, whose updates the guard
            # skipped, or (with Ray) whose optimizer stepped on the workers, still counts
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler", UserWarning)
            self.scheduler.step()
        self.state.step += 1
        self.schedule.publish(self.step, self.lm)  # the weights due to draw a later batch
        result = StepResult(collected, batch, update_metrics, timings,
                            time.perf_counter() - started)
        metrics = step_metrics(self.state, result, self.optimizer.param_groups[0]["lr"],
                               self.device, self.recipe.overlong_filter)
        if self.recipe.max_staleness:
            idle = waited if isinstance(self.schedule, staleness.Overlapped) else 0.0
            metrics.update(staleness.async_metrics(drawn, idle, started + waited))
        metrics["guard/skipped_steps"] = self.state.skipped_steps
        metrics["reward/errors"] = drawn.reward_errors
        self.run.append_samples(self.step, sample_rows(collected, self.cfg.log_samples))
        every = self.cfg.save_rollouts_every
        if batch is not None and every and self.step % every == 0:
            save_rollout_batch(batch, self.run.path / "rollouts" / f"step_{self.step}.pt",
                               self.cfg.resolved())
        return metrics

    def _guard(self, skipped: bool, update_metrics: dict[str, float]) -> None:
        """Count updates skipped for a non-finite loss; abort after max_skipped_steps in a row."""
        self.state.count_update(skipped)
        in_a_row = self.state.skipped_in_a_row
        if in_a_row >= self.cfg.max_skipped_steps:
            first = self.step + 2 - in_a_row
            raise TrainingError(
                f"the loss or gradient was not finite in {in_a_row} steps in a row "
                f"(steps {first}-{self.step + 1}; last loss/total="
                f"{update_metrics.get('loss/total')}); the updates were skipped and the weights "
                "are unharmed. Lower lr, check the rewards for huge values, or raise "
                "max_skipped_steps")

    def _evaluate(self) -> dict[str, float]:
        """Held-out metrics now, tagged with the tokens generated so far (equal cost)."""
        metrics = training_eval(self.lm, self.tokenizer, self.task, self.cfg)
        if self.teacher is not None:
            metrics.update(held_out_reverse_kl(self.lm, self.tokenizer, self.task, self.teacher,
                                               self.cfg))
        return {**metrics, "rollout/tokens_generated": self.state.tokens_generated}

    def _warm_start(self) -> dict[str, float]:
        """``postrl/train/warm_start.py``: the student learns the teacher's accepted samples;
        their tokens count as generated."""
        parts = WarmStart(self.teacher.sampler_engine(self.engine), self.teacher, self.grader,
                          lambda e: self.draw.prompt(e)[1], self.episodes, self.engine.pad_id)
        metrics, collected = warm_start(parts, self.lm, self.sampling, self.cfg)
        self.state.count_sampled(collected)
        if self.master is not None:
            self.master.refresh()
        if self.cluster is None and self.cfg.rollout_backend == "vllm":  # its own copy
            self.engine.load_weights(engine_weights(self.lm))
        return metrics

    def _prepare(self, batch: TrainBatch) -> None:
        scorers = Scorers(self.scoring_lm, self.reference, self.critic, self.teacher,
                          self.device, self.engine.pad_id)
        prepare(batch, scorers, self.recipe, self.cfg)

    @property
    def scoring_lm(self):
        """What the update differentiates: the policy or its bf16 copy (bf16-master)."""
        return self.master.working if self.master is not None else self.lm

    def _update(self, batch: TrainBatch) -> dict[str, float]:
        settings = UpdateSettings(
            epochs=self.cfg.epochs, minibatches=self.cfg.minibatches,
            micro_batch_size=self.cfg.micro_batch_size,
            micro_batch_tokens=self.cfg.micro_batch_tokens, temperature=self.cfg.temperature,
            max_grad_norm=self.cfg.max_grad_norm, pad_id=self.engine.pad_id,
            precision=self.cfg.precision, device=str(self.device),
            train_policy=self.step >= self.cfg.critic_warmup_steps or self.critic is None)
        # the plan (which rows make each optimizer step) is drawn here, whatever the workers
        plan = update_plan(batch.rows, settings.epochs, settings.minibatches,
                           self.update_generator)
        if self.cluster is not None:  # trains the workers, then syncs this copy and rollouts
            results = self.cluster.update(batch, settings, plan,
                                          self.optimizer.param_groups[0]["lr"])
        else:
            self.policy.train()
            self.scoring_lm.train()
            # with LoRA, self.lm is the base model with the adapters injected (and active)
            models = Trainable(TokenScorer(self.scoring_lm, tied_grads_in_place=True,
                                           compile_layers=self.cfg.torch_compile),
                               self.optimizer,
                               ValueScorer(self.critic, compile_layers=self.cfg.torch_compile)
                               if self.critic else None,
                               self.critic_optimizer, self.master)
            results = run_updates(models, batch, self.recipe, self.loss_cfg, settings, plan)
            drop_gradients(models)  # the next update makes them afresh: not held in sampling
        return average_rounds([round_metrics(r) for r in results])

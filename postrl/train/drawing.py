"""Drawing one step's samples: prompts -> rollouts -> rewards, in rounds (DAPO's dynamic
sampling may take several), by whichever engine the schedule hands it (``staleness.py``);
and the engine ``overlap_sampling``'s thread draws with."""

from __future__ import annotations

import time
from dataclasses import dataclass

from postrl.config import TrainConfig
from postrl.recipes import Recipe
from postrl.rollout import HFRolloutEngine, SamplingParams
from postrl.rollout.episodes import EpisodeLimits, play_examples
from postrl.tasks import task_prompt
from postrl.train.distributed.weights import engine_weights, trainable_state
from postrl.train.grading import Grader
from postrl.train.sampling import Group, PromptSampler, PromptTokens, collect
from postrl.train.staleness import Copy, Drawn, Load, drawn_by, sampler_copy, state_copy


@dataclass
class Drawer:
    """What a run draws its samples with. Calling it draws step ``step``'s samples with
    ``engine`` as it is now: the prompt sampler's next prompts, and random streams that depend
    on the step and the round alone, so the same step draws the same samples whichever thread
    draws it and whenever."""

    cfg: TrainConfig
    recipe: Recipe
    task: object
    tokenizer: object
    sampler: PromptSampler
    prompt_ids: PromptTokens
    grader: Grader
    sampling: SamplingParams
    episodes: EpisodeLimits | None  # None: single-turn

    def __call__(self, step: int, engine) -> Drawn:
        timings = {"generate": 0.0, "score": 0.0}
        errors = [0]
        collected = collect(lambda r: self._round(step, r, engine, timings, errors),
                            self.cfg.prompts_per_step, self.recipe.dynamic_sampling,
                            self.recipe.max_sampling_rounds, self.recipe.dynamic_sampling_by)
        return Drawn(step, drawn_by(step, self.recipe.max_staleness), collected, errors[0],
                     timings, (self.sampler.epoch, self.sampler.position))

    def prompt(self, example) -> tuple[str, list[int]]:
        """``example``'s prompt as the student reads it: its text and tokens (the tokens
        are made once per example)."""
        text = task_prompt(self.tokenizer, self.task, example.question, self.cfg.system_prompt)
        return text, self.prompt_ids(example.id, text)

    def _round(self, step: int, round_index: int, engine, timings: dict[str, float],
               errors: list[int]) -> list[Group]:
        cfg = self.cfg
        examples = self.sampler.take(cfg.prompts_per_step)
        prompts, ids = map(list, zip(*map(self.prompt, examples), strict=True))
        stream = cfg.seed if cfg.sampling_seed is None else cfg.sampling_seed
        seed = hash((stream, step, round_index)) % (2**31)
        t = time.perf_counter()
        if self.episodes is None:
            rollouts = engine.generate(ids, cfg.group_size, self.sampling, seed)
        else:
            rollouts = play_examples(engine, self.tokenizer, self.task, examples, ids,
                                     cfg.group_size, self.sampling, seed, self.episodes)
        timings["generate"] += time.perf_counter() - t
        t = time.perf_counter()
        groups, round_errors = self.grader.groups(examples, prompts, rollouts)
        errors[0] += round_errors
        timings["score"] += time.perf_counter() - t
        return groups


def thread_sampler(cfg: TrainConfig, cluster, engine, lm, tokenizer) -> tuple[object, Copy, Load]:
    """What ``overlap_sampling``'s thread draws with, and how each version of the weights
    reaches it (``staleness.Overlapped``): Ray's rollout actors (through the object store) or
    vLLM (``engine``, its own copy), the thread pushing every version instead of the update;
    else the lean sampler over a copy of the policy ``lm`` of its own."""
    if cluster is not None:
        return engine, trainable_state, cluster.rollout.load_weights
    if cfg.rollout_backend == "vllm":
        return engine, engine_weights, engine.load_weights
    model = sampler_copy(lm)
    return (HFRolloutEngine(model, tokenizer, batch_size=None, precision=cfg.sampling_precision),
            state_copy, model.load_state_dict)
